"""One engine step as a transaction: snapshot, check the plan, then commit or undo.

A scheduler is outside code (four policies, or a whole-scheduler plugin) and
a wrong plan would not fail loudly: a sequence scheduled twice gets wrong
tokens, a token without a KV slot overwrites another request's cache. So
whatever produced the plan, :meth:`StepTransaction.check` checks it before
the runner sees it — per scheduled sequence: scheduled once; running; an int
``1 .. pending`` tokens; a KV slot for each — and for the step: the budget's
token and sequence limits, swap pairs naming real blocks, no host block both
swapped out and in. It also keeps the progress guarantee: a scheduler that
plans nothing while work waits (and changed nothing), or whose preemptions
throw away more than a few KV caches' worth of work without one token being
sampled, raises :class:`SchedulerStall`.

Everything a step may change is captured first: the sequences that hold
state (full fields) and those that wait (their waiting state), the block
manager (rebuilt from the restored tables, so nothing is recorded per
block), the scheduler's own queues (``snapshot()``), and the RNG state of the
rows that sample. :meth:`StepTransaction.commit` appends the sampled tokens
and applies the finish rules: it and the undo are the only writers of a
sequence once it is planned. Any failure before the step ends — a policy
raising, a refused plan, a failed forward — is undone by
:meth:`StepTransaction.undo`, and the engine is as it was: it can end the
request a policy failed on and plan the step again without it. Policies see
no event of a step that was undone.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

from cbcore.log import get_logger
from cbcore.scheduling.plan import RowPlan, Sampled, StepPlan
from cbcore.scheduling.policy import StepResult
from cbcore.scheduling.scheduler import Scheduler, SchedulerError, SchedulerOutput, SchedulerStall
from cbcore.scheduling.sequence import FinishReason, Sequence, SequenceStatus

log = get_logger(__name__)

MAX_IDLE_STEPS = 8
WINDOW_CAPACITIES = 4
_seq_of = attrgetter("seq")
_tuple = tuple.__new__  # builds a row's named tuple (all fields, in order) without its Python-level __new__


@dataclass
class Steps:
    """The engine's standing rules for one scheduler: how requests finish, what to call it, its progress."""

    scheduler: Scheduler
    culprit: str  # what to call the scheduler when no single policy broke a rule
    clock: Callable[[], float]
    eos_token_ids: frozenset[int] = frozenset()
    max_model_len: int | None = None
    spent: int = 0  # tokens computed since a token was last sampled
    idle: int = 0  # steps in a row that computed nothing
    planned: float = float("inf")  # the scheduler's clock after the last committed step was planned

    def __post_init__(self) -> None:
        self.window = WINDOW_CAPACITIES * self.scheduler.blocks.capacity_tokens  # the livelock bound, in tokens

    def observe(self, out: SchedulerOutput, computed: int, sampled: int, waiting: int = 1, holding: int = 0) -> None:
        """The progress guarantee, for one checked plan, with how many live requests wait and hold KV."""
        if computed == 0 and not out.failed:
            if not waiting and not holding:
                return
            self.idle += 1
            moved = out.preempted or out.swap_out or out.swap_in
            if not moved or self.idle > MAX_IDLE_STEPS:
                what = "changed nothing" if not moved else f"computed nothing for {self.idle} steps"
                msg = f"planned no tokens while work waits ({waiting} waiting, {holding} holding KV) and {what}: it would spin forever"
                rule = "a step computes tokens while work waits"
                raise SchedulerStall(f"{self.culprit} {msg}", plugin=self.culprit, rule=rule)
            return
        self.idle = 0
        self.spent = 0 if sampled else self.spent + computed
        if self.spent > self.window:
            raise SchedulerStall(
                f"{self.culprit} computed {self.spent} tokens without sampling one (more than {WINDOW_CAPACITIES}x "
                "the KV cache's capacity): preemptions keep throwing work away, a livelock",
                plugin=self.culprit,
                rule="preemptions do not undo all progress",
            )

    def finish_rule(self, seq: Sequence, token: int, now: float) -> None:
        """End ``seq`` if ``token`` stops it (EOS, a stop token) or it reached its length."""
        params = seq.params
        if (not params.ignore_eos and token in self.eos_token_ids) or token in params.stop_token_ids:
            seq.finish(FinishReason.STOP, now)
        elif (n := len(seq.token_ids)) - seq.num_prompt_tokens >= params.max_new_tokens or (
            self.max_model_len is not None and n >= self.max_model_len
        ):
            seq.finish(FinishReason.LENGTH, now)


class StepTransaction:
    """What one step changed, so that it can be undone; one per step (and per re-planning of it)."""

    # The scheduler's answer, and its checked plan (from then on the executor may write KV); (generator,
    # state before sampling) of each row that samples. Set by check().
    out: SchedulerOutput | None = None
    executed: StepPlan | None = None
    rng: Seq[tuple[Any, Any]] = ()

    def __init__(self, steps: Steps, live: Collection[Sequence]) -> None:
        self.steps, self.live = steps, live
        sched = self.scheduler = steps.scheduler
        # A scheduler that names who holds state (``holding()``: the rest wait without KV) and stamps first
        # admissions from its clock while planning: if every stamp so far is older than now, the waiting
        # sequences are not visited unless the step is undone (thousands may wait), and a stamp at or after
        # ``mark`` is this step's. Otherwise: (a waiting seq without KV, its first_scheduled_time) for each.
        self.mark = sched.clock() if hasattr(sched, "holding") else steps.planned
        quick, waiting = self.mark > steps.planned, SequenceStatus.WAITING
        held = sched.holding() if quick else [s for s in live if s.block_table or s.status is not waiting]
        self.idle = None if quick else [(s, s.first_scheduled_time) for s in live if not s.block_table and s.status is waiting]
        self.held = [(s, s.status, s.num_computed_tokens, s.num_preemptions, s.block_table, len(s.block_table)) for s in held]
        self.blocks_point = sched.blocks.undo_point()
        self.restore_own = sched.snapshot()
        self.appended: list[tuple[Sequence, bool]] = []  # (seq, whether it had a first token before the step)

    def check(self, out: SchedulerOutput) -> StepPlan:
        """Check the scheduler's answer and turn it into the runner's plan; save the RNG of the rows that sample."""
        self.out, self.planned = out, self.scheduler.clock() if hasattr(self.scheduler, "holding") else self.steps.planned
        plan, computed, sampled = check_plan(out, self.scheduler.blocks, self.steps.culprit)
        self.steps.observe(out, computed, sampled, len(self.live) - len(self.held), len(self.held))
        self.rng = [(row.generator, row.generator.get_state()) for row in plan.rows if row.generator is not None]
        self.executed = plan
        return plan

    def commit(self, sampled: Sampled) -> tuple[dict[Sequence, int], list[Sequence], list[StepResult]]:
        """Append each sampling row's token, apply the finish rules; what the scheduler is then told.

        Returns the new token of each sequence that sampled, the sequences
        whose sampling failed (they alone end with an error), and the step's
        results for the policies (the preempted included).
        """
        out, now, self.steps.planned = self.out, self.steps.clock(), self.planned
        new_token: dict[Sequence, int] = {}
        failed: list[Sequence] = []
        errors = sampled.errors or [None] * len(sampled.rows)
        scheduled, appended, finish_rule = out.scheduled, self.appended, self.steps.finish_rule  # (per row)
        for row, token, logprobs, error in zip(sampled.rows, sampled.tokens, sampled.logprobs, errors, strict=True):
            seq = scheduled[row].seq
            seq.num_computed_tokens = len(seq.token_ids)
            if error is not None:
                seq.finish(FinishReason.ERROR, now, error)
                failed.append(seq)
                continue
            appended.append((seq, seq.first_token_time is not None))
            seq.append_token(token, now)
            if logprobs is not None:
                seq.logprobs.append(logprobs)
            finish_rule(seq, token, now)
            new_token[seq] = token
        results, running = [], SequenceStatus.RUNNING
        for item in out.scheduled:
            seq = item.seq
            if seq not in new_token and seq.status is running:  # a non-final prefill chunk
                seq.num_computed_tokens += item.num_tokens
            results.append(_tuple(StepResult, (seq.view, item.num_tokens, new_token.get(seq), False)))
        results += [StepResult(seq.view, 0, None, True) for seq in out.preempted]
        return new_token, failed, results

    def undo(self) -> None:
        """Put everything back as it was before the step.

        KV the executor may have written cannot be put back: a sequence whose
        blocks the step gave to another (it was preempted or swapped out, and
        its blocks reused) keeps only its blocks before the first one written,
        and computes the rest again.
        """
        written = self.written() if self.executed is not None else {}
        for seq, had_first in reversed(self.appended):
            seq.token_ids.pop()
            seq.token_times.pop()
            if len(seq.logprobs) > seq.num_output_tokens:
                seq.logprobs.pop()
            if not had_first:
                seq.first_token_time = None
        for generator, state in self.rng:
            generator.set_state(state)
        self.restore_own()
        for seq, status, computed, preemptions, table, n in self.held:
            del table[n:]
            seq.status, seq.num_computed_tokens, seq.num_preemptions, seq.block_table = status, computed, preemptions, table
            seq.finish_reason = seq.finish_time = seq.error = None
            if written:
                self.drop_overwritten(seq, written)
        held = {seq for seq, *_ in self.held}
        idle = self.idle if self.idle is not None else [  # a stamp at or after the mark is this step's
            (s, t if (t := s.first_scheduled_time) is None or t < self.mark else None) for s in self.live if s not in held]
        for seq, first_scheduled in idle:
            seq.status, seq.num_computed_tokens, seq.block_table = SequenceStatus.WAITING, 0, []
            seq.first_scheduled_time, seq.finish_reason, seq.finish_time, seq.error = first_scheduled, None, None, None
        self.scheduler.blocks.reset_to([held[0] for held in self.held], self.blocks_point)

    def written(self) -> dict[int, int]:
        """Device blocks the executed plan writes, each with the first slot written in it."""
        assert self.executed is not None
        size = self.scheduler.blocks.block_size
        first: dict[int, int] = {}
        for row in self.executed.rows:
            start, end = row.start, row.start + len(row.token_ids)
            for i in range(start // size, (end - 1) // size + 1):
                block = row.block_table[i]
                first[block] = min(first.get(block, size), max(start - i * size, 0))
        for _, block in self.executed.swap_in:
            first[block] = 0
        return first

    def drop_overwritten(self, seq: Sequence, written: Mapping[int, int]) -> None:
        """Cut ``seq`` back to before its first block whose computed slots the step may have overwritten."""
        size = self.scheduler.blocks.block_size
        for i, block in enumerate(seq.block_table):
            if block in written and seq.num_computed_tokens > i * size + written[block]:
                log.warning("a failed step reused this request's KV blocks; it computes them again",
                            request_id=seq.request_id, from_token=i * size)  # fmt: skip
                seq.block_table, seq.num_computed_tokens = seq.block_table[:i], i * size
                return


def check_plan(out: SchedulerOutput, blocks: Any, culprit: str) -> tuple[StepPlan, int, int]:
    """The runner's plan for ``out``, its tokens and its sampling rows; raises naming ``culprit`` and the rule.

    The per-row checks run in the loop that builds the plan anyway, so they
    add a few comparisons per row (``tests/benchmarks/test_bench_scheduler.py``).
    """
    if not isinstance(out, SchedulerOutput):
        _fail(culprit, "schedule() returns a SchedulerOutput", f"got {type(out).__name__}")
    block_size, scheduled, running = blocks.block_size, out.scheduled, SequenceStatus.RUNNING
    rows: list[RowPlan] = []
    append = rows.append
    total = sampled = decodes = 0
    try:
        for item in scheduled:
            seq, n = item.seq, item.num_tokens
            start, tokens, table = seq.num_computed_tokens, seq.token_ids, seq.block_table
            end, size = start + n, len(tokens)
            ids = tokens[start:end]
            # n tokens pending (the slice is n long); n > 0; a slot for each; running.
            if not (n > 0 and start >= 0 and end <= size and end <= len(table) * block_size and seq.status is running):
                _diagnose(item, block_size, culprit)
            if end == size:  # the row reaches the last token: it samples
                decode = n == 1 and start >= seq.num_prompt_tokens  # a generated token fed back
                decodes += decode
                sampled += 1
                append(_tuple(RowPlan, (ids, start, table, seq.params, seq.generator, decode)))
            else:
                append(_tuple(RowPlan, (ids, start, table, None, None, False)))
            total += n
    except (AttributeError, TypeError) as exc:
        _fail(culprit, "each scheduled entry is a ScheduledSeq of a Sequence and an int", str(exc))
    if type(total) is not int:
        _fail(culprit, "token counts are ints", f"they sum to {total!r}")
    if len(set(map(_seq_of, scheduled))) != len(scheduled):
        seen: set[Sequence] = set()
        twice = next(s.seq for s in scheduled if s.seq in seen or seen.add(s.seq))
        _fail(culprit, "each sequence is scheduled at most once", f"{twice.request_id!r} appears twice", twice)
    if (limits := out.limits) is not None:
        if total > limits.max_num_tokens and len(scheduled) > 1:  # one prompt alone may exceed it
            _fail(culprit, "the step's tokens fit its budget", f"{total} tokens, budget {limits.max_num_tokens}")
        if len(scheduled) > limits.max_num_seqs:
            _fail(culprit, "the step's sequences fit its budget", f"{len(scheduled)}, limit {limits.max_num_seqs}")
    if out.swap_out or out.swap_in:
        for what, pairs, first, second in (
            ("swap_out", out.swap_out, blocks.num_blocks, blocks.num_host_blocks),
            ("swap_in", out.swap_in, blocks.num_host_blocks, blocks.num_blocks),
        ):
            for pair in pairs:
                a, b = pair
                if not (type(a) is int and type(b) is int and 0 <= a < first and 0 <= b < second):
                    _fail(culprit, "swap pairs name existing blocks", f"{what} pair {pair!r}")
        if {h for h, _ in out.swap_in} & {h for _, h in out.swap_out}:
            _fail(culprit, "no host block is swapped out and in in one step", "a host block is both")
    return StepPlan(rows, out.swap_out, out.swap_in, total, decodes), total, sampled


def _diagnose(item: Any, block_size: int, culprit: str) -> None:
    seq, n = item.seq, item.num_tokens
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
    held, end = len(seq.block_table), seq.num_computed_tokens + n
    detail = f"{rid!r} computes up to token {end} but its {held} blocks hold {held * block_size}"
    _fail(culprit, "a KV slot is allocated for every token", detail, seq)


def _fail(culprit: str, rule: str, detail: str, seq: Sequence | None = None) -> None:
    message = f"{culprit} broke the rule '{rule}': {detail}; nothing of this step was applied"
    raise SchedulerError(message, plugin=culprit, rule=rule, request_id=getattr(seq, "request_id", None))
