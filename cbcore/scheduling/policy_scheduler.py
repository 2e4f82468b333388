"""The composed scheduler: one queue, budget, prefill and preemption policy.

Each step runs three phases over the policies' answers. In decode-first
order they run as listed; prefill-first admits waiting prompts first, then
serves the running sequences (prefills before decodes), then the swapped ones:

1. running   — decodes and ongoing prefill chunks, in queue order; when the KV
               cache cannot grow, the preemption policy evicts a victim among
               the running sequences not yet scheduled this step (possibly the
               sequence itself, which then waits);
2. swapped   — sequences evicted by swap come back before anything new starts;
3. waiting   — admissions in queue order of those the budget policy admits,
               stopping at the first that does not fit (no overtaking). A
               queue policy with ``preempts_running`` may evict lower-ranked
               running sequences to get a slot or KV blocks. Skipped while
               anything is swapped out, and in a step that preempted or
               swapped in: memory is tight and new work would only be
               evicted again.

Within one step every swap-out is planned before any swap-in. The runner
copies out before it copies in, so this order is what makes it safe for a
swap-in to reuse a device block that a swap-out of the same step just freed,
and impossible for a swap-out to overwrite a host block that a swap-in of the
same step still has to read.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import Any, NoReturn

from cbcore.log import get_logger
from cbcore.scheduling.admission import Admission
from cbcore.scheduling.blame import describe
from cbcore.scheduling.block_manager import BlockManager
from cbcore.scheduling.eviction import _NO_KEY, Eviction
from cbcore.scheduling.plan_builder import OrderedOnDemand, PlanBuilder, check_swap_order
from cbcore.scheduling.policy import (
    BudgetPolicy,
    Policy,
    PreemptionPolicy,
    PrefillPolicy,
    QueuePolicy,
    SchedulerState,
    StepLimits,
    StepResult,
)
from cbcore.scheduling.rollback import SeqUndo
from cbcore.scheduling.scheduler import SchedulerError, SchedulerOutput, SchedulerStall
from cbcore.scheduling.sequence import FinishReason, Sequence, SequenceStatus

log = get_logger(__name__)


class PolicyScheduler(Admission, Eviction):
    """Implements :class:`cbcore.scheduling.scheduler.Scheduler` from four narrow policies."""

    def __init__(
        self,
        queue: QueuePolicy,
        budget: BudgetPolicy,
        prefill: PrefillPolicy,
        preemption: PreemptionPolicy,
        blocks: BlockManager,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.queue = queue
        self.budget = budget
        self.prefill = prefill
        self.preemption = preemption
        self.blocks = blocks
        self.clock = clock
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []
        self._by_id: dict[str, Sequence] = {}
        self._keys: dict[Sequence, Any] = {}  # stored queue keys, when the queue has fixed_keys
        self.step_index = 0
        self.num_preemptions = 0
        self.num_swap_fallbacks = 0
        self.num_partial_prefills = 0  # scheduled prefill chunks shorter than what was pending
        self._forgotten: list[tuple[Sequence, Any]] | None = None  # (seq, stored key) forgotten this step
        self.names: dict[int, str] = {id(p): describe(p) for p in self.policies}  # the engine adds origins
        for policy, expected in ((queue, QueuePolicy), (budget, BudgetPolicy), (prefill, PrefillPolicy), (preemption, PreemptionPolicy)):
            if not isinstance(policy, expected):
                raise TypeError(f"{self.names[id(policy)]} is not a {expected.__name__}")
        if preemption.mode not in ("recompute", "swap"):
            raise ValueError(f"{self.names[id(preemption)]}: mode must be 'recompute' or 'swap', got {preemption.mode!r}")
        if prefill.order not in ("decode-first", "prefill-first"):
            raise ValueError(
                f"{self.names[id(prefill)]}: order must be 'decode-first' or 'prefill-first', got {prefill.order!r}"
            )

    @property
    def policies(self) -> tuple[QueuePolicy, BudgetPolicy, PrefillPolicy, PreemptionPolicy]:
        return (self.queue, self.budget, self.prefill, self.preemption)

    # -- protocol ------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Register ``seq``; if a policy raises, nothing of it stays registered (then re-raise)."""
        if seq.request_id in self._by_id:
            raise ValueError(f"request id {seq.request_id!r} is already in the scheduler")
        now = self.clock()
        told: list[Policy] = []
        try:
            for policy in self.policies:
                told.append(policy)
                policy.on_arrival(seq, now)
            if self.queue.fixed_keys:
                self._keys[seq] = self.queue.key(seq, now)
            self._enqueue(seq)  # sorting by a key that does not compare raises here, not in a later step
        except Exception:
            self._keys.pop(seq, None)
            if seq in self.waiting:
                self.waiting.remove(seq)
            for policy in told:  # they saw an arrival that did not happen
                try:
                    policy.on_finish(seq, now)
                except Exception:  # the first error is the one to report
                    log.warning("on_finish raised while undoing an arrival", policy=policy.name)
            raise
        self._by_id[seq.request_id] = seq

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def get(self, request_id: str) -> Sequence | None:
        return self._by_id.get(request_id)

    def in_queue_order(self, seqs: Seq[Sequence], now: float) -> list[Sequence]:
        if self.queue.fixed_keys:
            return sorted(seqs, key=self._keys.__getitem__)
        ordered = self.queue.order(seqs, now)
        if not isinstance(ordered, list | tuple) or len(ordered) != len(seqs) or set(ordered) != set(seqs):
            self._policy_error(
                self.queue, "order() returns each given sequence exactly once", _not_a_permutation(ordered, seqs)
            )
        return ordered  # type: ignore[return-value]

    def _policy_error(self, policy: Policy, rule: str, detail: str, seq: Sequence | None = None) -> NoReturn:
        culprit = self.names[id(policy)]
        raise SchedulerError(
            f"{culprit} broke the rule '{rule}': {detail}",
            plugin=culprit,
            rule=rule,
            request_id=None if seq is None else seq.request_id,
        )

    def _enqueue(self, seq: Sequence) -> None:
        """Into the waiting queue; kept sorted when keys are fixed, so a step need not sort it."""
        seq.status = SequenceStatus.WAITING
        if self.queue.fixed_keys:
            bisect.insort(self.waiting, seq, key=self._keys.__getitem__)
        else:
            self.waiting.append(seq)

    def state(self, now: float) -> SchedulerState:
        # Materialised on first read: by the budget policy at the start of the step, or by the
        # waiting phase, which runs before any change to the queue or not at all (a step that
        # preempted admits nothing). Most steps with every slot taken never read it.
        if self.queue.fixed_keys:
            ordered = OrderedOnDemand(lambda: list(self.waiting))
        else:
            # A copy even if a policy returns its argument: admission removes from self.waiting.
            ordered = OrderedOnDemand(lambda: self._order_waiting(now))
        return SchedulerState(
            now=now,
            step=self.step_index,
            waiting=ordered,
            running=tuple(self.running),
            swapped=tuple(self.swapped),
            kv=self.blocks,
        )

    def _order_waiting(self, now: float) -> list[Sequence]:
        if self.blocks.prefix_caching and self.queue.reads_cached_prefix(len(self.waiting)):
            for seq in self.waiting:  # a cache-aware order needs fresh num_cached_prompt_tokens
                self.blocks.lookup(seq)
        return list(self.in_queue_order(self.waiting, now))

    def schedule(self) -> SchedulerOutput:
        now = self.clock()
        self.step_index += 1
        state = self.state(now)
        limits = self.budget.limits(state)
        if not (
            isinstance(limits, StepLimits)
            and type(limits.max_num_seqs) is int
            and type(limits.max_num_tokens) is int
            and limits.max_num_seqs >= 1
            and limits.max_num_tokens >= 1
        ):
            self._policy_error(self.budget, "limits() returns StepLimits of two ints >= 1", f"got {limits!r}")
        plan = PlanBuilder(SchedulerOutput(limits=limits), limits.max_num_tokens, limits.max_num_seqs)
        self.prefill.begin_step()
        if self.prefill.order == "decode-first":
            phases = (self._schedule_running, self._schedule_swapped, self._schedule_waiting)
        else:
            phases = (self._schedule_waiting, self._schedule_running, self._schedule_swapped)
        for phase in phases:
            phase(plan, state, limits.max_num_seqs)
        out = plan.out
        self.num_partial_prefills += len(plan.partials)
        check_swap_order(out)
        if out.is_empty and not out.failed and not out.preempted and self.has_unfinished():
            culprit = ", ".join(self.names[id(p)] for p in self.policies)
            raise SchedulerStall(
                f"step {self.step_index}: nothing scheduled with {len(self.waiting)} waiting, "
                f"{len(self.running)} running, {len(self.swapped)} swapped; limits {limits}, "
                f"policies {culprit}",
                plugin=culprit,
                rule="a step computes tokens while work waits",
            )
        return out

    def snapshot(self) -> Callable[[], None]:
        """Capture what a step may change; the returned function puts it back (see rollback.py)."""
        waiting, running, swapped = list(self.waiting), list(self.running), list(self.swapped)
        undo = SeqUndo(running + swapped, waiting, self.blocks, self.clock())
        counters = (self.step_index, self.num_preemptions, self.num_swap_fallbacks, self.num_partial_prefills)
        forgotten = self._forgotten = []

        def restore() -> None:
            self.waiting, self.running, self.swapped = waiting, running, swapped
            undo.restore(self.blocks)
            self._by_id = {s.request_id: s for s in (*waiting, *running, *swapped)}
            for seq, key in forgotten:
                if key is not _NO_KEY:
                    self._keys[seq] = key
            self.step_index, self.num_preemptions, self.num_swap_fallbacks, self.num_partial_prefills = counters

        return restore

    def on_step_end(self, output: SchedulerOutput, results: Seq[StepResult]) -> None:
        if self.blocks.prefix_caching:  # KV written this step becomes findable (finished ones' too)
            for item in output.scheduled:
                self.blocks.register_computed(item.seq)
        now = self.clock()
        for policy in self.policies:
            policy.on_step_end(results, now)
        finished = [s.seq for s in output.scheduled if s.seq.is_finished]
        if not finished:
            return
        done = set(finished)
        self.running = [s for s in self.running if s not in done]
        for seq in finished:
            self.blocks.free(seq)
            self._forget(seq, now)

    def abort(self, request_id: str) -> Sequence | None:
        seq = self._by_id.get(request_id)
        if seq is None:
            return None
        self._remove(seq)
        now = self.clock()
        seq.finish(FinishReason.ABORT, now)
        self._forget(seq, now)
        return seq

    # -- phases --------------------------------------------------------------

    def _tokens_for(self, seq: Sequence, plan: PlanBuilder) -> int:
        pending = seq.num_pending_tokens
        if pending == 1:
            return 1
        n = self.prefill.num_tokens(seq, plan.tokens_left, plan.empty)
        if type(n) is not int or n < 0:
            self._policy_error(self.prefill, "num_tokens() returns an int >= 0", f"got {n!r}", seq)
        if n > plan.tokens_left and not plan.empty:
            self._policy_error(
                self.prefill,
                "num_tokens() stays within tokens_left (only a prompt alone in a step may exceed it)",
                f"{n} tokens for {seq.request_id!r} with {plan.tokens_left} left",
                seq,
            )
        return min(n, pending)  # more than is pending: all of it (documented)

    def _schedule_running(self, plan: PlanBuilder, state: SchedulerState, max_seqs: int) -> None:
        order = [s for s in self.in_queue_order(self.running, state.now) if s not in plan.tokens]
        # Queue order within decodes and within prefills.
        decodes: list[Sequence] = []
        prefills: list[Sequence] = []
        for seq in order:
            (prefills if seq.is_prefilling else decodes).append(seq)
        groups = (decodes, prefills) if self.prefill.order == "decode-first" else (prefills, decodes)
        for group in groups:
            if group is decodes and self._schedule_all_decodes(decodes, plan):
                continue
            for seq in group:
                if seq.status is not SequenceStatus.RUNNING or seq in plan.tokens:
                    continue  # evicted as a victim earlier in this loop
                if plan.seqs_left <= 0 or plan.tokens_left <= 0:
                    break
                n = self._tokens_for(seq, plan)
                if n > 0 and self._make_room(seq, n, plan, state.now):
                    plan.add(seq, n)

    def _schedule_all_decodes(self, decodes: list[Sequence], plan: PlanBuilder) -> bool:
        """Schedule every decode at once if all of them fit: the common step, without
        the per-sequence eviction checks (same plan and block ids as the loop would give)."""
        if len(decodes) > min(plan.seqs_left, plan.tokens_left):
            return False
        needy = self.blocks.needing_a_block(decodes)
        if len(needy) > self.blocks.num_free_blocks:
            return False
        for seq in needy:
            self.blocks.grow(seq, 1)
        plan.add_decodes(decodes)
        return True

    def _schedule_swapped(self, plan: PlanBuilder, state: SchedulerState, max_seqs: int) -> None:
        if not self.swapped:
            return
        just_evicted = set(plan.out.preempted)
        for seq in self.in_queue_order(self.swapped, state.now):
            if seq in just_evicted:
                continue
            if plan.seqs_left <= 0 or plan.tokens_left <= 0 or len(self.running) >= max_seqs:
                break
            n = self._tokens_for(seq, plan)
            if n <= 0 or not self.blocks.can_swap_in(seq, n):
                break
            plan.out.swap_in.extend(self.blocks.swap_in(seq))
            self.swapped.remove(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self.blocks.grow(seq, n)
            plan.add(seq, n)


def _not_a_permutation(ordered: object, given: Seq[Sequence]) -> str:
    if not isinstance(ordered, list | tuple):
        return f"got {type(ordered).__name__}"
    twice = [s for s in set(ordered) if ordered.count(s) > 1]
    if twice:
        return f"{getattr(twice[0], 'request_id', twice[0])!r} appears {ordered.count(twice[0])} times"
    extra = [s for s in ordered if s not in set(given)]
    if extra:
        return f"{getattr(extra[0], 'request_id', extra[0])!r} was not given"
    return f"{len(ordered)} sequences back for {len(given)} given"
