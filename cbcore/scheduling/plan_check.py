"""The engine's check of every plan, whatever produced it, fused with building the runner's plan.

A scheduler is outside code (a policy mix or a whole-scheduler plugin), and a
wrong plan would not fail loudly: a sequence scheduled twice gets wrong tokens,
a token without a KV slot overwrites another request's cache. So before the
runner sees anything the engine checks, per scheduled sequence:

* it is scheduled at most once;
* it is live and running (not finished, aborted, waiting or swapped out);
* its token count is an int in ``1 .. pending tokens``;
* its block table has a KV slot for every token it computes;

and for the step: the tokens and sequences fit the limits the budget policy
set, and swap pairs name real blocks. The per-row checks run in the loop that
builds the :class:`StepPlan` anyway, so they add a few comparisons per row
(measured in ``tests/benchmarks/test_bench_scheduler.py``).
"""

from __future__ import annotations

from operator import attrgetter

from cbcore.scheduling.plan import RowPlan, StepPlan
from cbcore.scheduling.scheduler import SchedulerError, SchedulerOutput
from cbcore.scheduling.sequence import Sequence, SequenceStatus

_seq_of = attrgetter("seq")


def checked_plan(
    out: SchedulerOutput, block_size: int, num_blocks: int, num_host_blocks: int, culprit: str
) -> tuple[StepPlan, int, int]:
    """The runner's plan for ``out``, its tokens and its sampling rows (for the progress guard).

    Raises :class:`SchedulerError` naming ``culprit`` and the rule."""
    if not isinstance(out, SchedulerOutput):
        _fail(culprit, "schedule() returns a SchedulerOutput", f"got {type(out).__name__}")
    scheduled = out.scheduled
    rows = []
    append = rows.append
    total = sampled = 0
    running = SequenceStatus.RUNNING
    try:
        for item in scheduled:
            seq = item.seq
            n = item.num_tokens
            start = seq.num_computed_tokens
            end = start + n
            tokens = seq.token_ids
            ids = tokens[start:end]
            table = seq.block_table
            # The slice is n long only if n tokens are pending; n > 0; a slot for each; running.
            if not (len(ids) == n > 0 <= start and end <= len(table) * block_size and seq.status is running):
                _diagnose(item, block_size, culprit)
            if end == len(tokens):  # the row reaches the last token: it samples
                sampled += 1
                append(RowPlan(ids, start, table, seq.params, seq.generator))
            else:
                append(RowPlan(ids, start, table, None, None))
            total += n
    except (AttributeError, TypeError) as exc:
        _fail(culprit, "each scheduled entry is a ScheduledSeq of a Sequence and an int", str(exc))
    if type(total) is not int:
        _fail(culprit, "token counts are ints", f"they sum to {total!r}")
    if len(set(map(_seq_of, scheduled))) != len(scheduled):
        seen: set[Sequence] = set()
        twice = next(s.seq for s in scheduled if s.seq in seen or seen.add(s.seq))
        _fail(culprit, "each sequence is scheduled at most once", f"{twice.request_id!r} appears twice", twice)
    limits = out.limits
    if limits is not None:
        if total > limits.max_num_tokens and len(scheduled) > 1:  # one prompt alone may exceed it
            _fail(culprit, "the step's tokens fit its budget", f"{total} tokens, budget {limits.max_num_tokens}")
        if len(scheduled) > limits.max_num_seqs:
            _fail(culprit, "the step's sequences fit its budget", f"{len(scheduled)}, limit {limits.max_num_seqs}")
    if out.swap_out or out.swap_in:
        _check_swaps(out, num_blocks, num_host_blocks, culprit)
    return StepPlan(rows, out.swap_out, out.swap_in), total, sampled


def _diagnose(item: object, block_size: int, culprit: str) -> None:
    seq = item.seq  # type: ignore[attr-defined]
    n = item.num_tokens  # type: ignore[attr-defined]
    rid = seq.request_id
    if seq.status is not SequenceStatus.RUNNING:
        state = f"{seq.status.value} ({seq.finish_reason})" if seq.is_finished else seq.status.value
        _fail(culprit, "only running sequences are scheduled", f"{rid!r} is {state}", seq)
    if seq.num_computed_tokens < 0:
        _fail(culprit, "computed tokens are never negative", f"{rid!r} has {seq.num_computed_tokens}", seq)
    if not isinstance(n, int) or n < 1:
        _fail(culprit, "a scheduled sequence computes at least 1 token", f"{rid!r} got {n!r}", seq)
    if n > seq.num_pending_tokens:
        _fail(culprit, "tokens within the pending tokens", f"{rid!r}: {n} > {seq.num_pending_tokens} pending", seq)
    need = seq.num_computed_tokens + n
    _fail(
        culprit,
        "a KV slot is allocated for every token",
        f"{rid!r} computes up to token {need} but its {len(seq.block_table)} blocks hold "
        f"{len(seq.block_table) * block_size}",
        seq,
    )


def _check_swaps(out: SchedulerOutput, num_blocks: int, num_host_blocks: int, culprit: str) -> None:
    for what, pairs, first, second in (
        ("swap_out", out.swap_out, num_blocks, num_host_blocks),
        ("swap_in", out.swap_in, num_host_blocks, num_blocks),
    ):
        for pair in pairs:
            a, b = pair
            if not (isinstance(a, int) and isinstance(b, int) and 0 <= a < first and 0 <= b < second):
                _fail(culprit, "swap pairs name existing blocks", f"{what} pair {pair!r}")
    if {h for h, _ in out.swap_in} & {h for _, h in out.swap_out}:
        _fail(culprit, "no host block is swapped out and in in one step", "a host block is both")


def _fail(culprit: str, rule: str, detail: str, seq: Sequence | None = None) -> None:
    rid = getattr(seq, "request_id", None)
    raise SchedulerError(
        f"{culprit} broke the rule '{rule}': {detail}; nothing of this step was applied",
        plugin=culprit,
        rule=rule,
        request_id=rid,
    )

