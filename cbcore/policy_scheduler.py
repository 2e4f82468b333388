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
from collections.abc import Callable, Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

from cbcore.block_manager import BlockManager
from cbcore.log import get_logger
from cbcore.policy import (
    BudgetPolicy,
    PreemptionPolicy,
    PrefillPolicy,
    QueuePolicy,
    SchedulerState,
    StepResult,
)
from cbcore.scheduler import ScheduledSeq, SchedulerOutput, SchedulerStall
from cbcore.sequence import FinishReason, Sequence, SequenceStatus

log = get_logger(__name__)


@dataclass
class _StepPlan:
    out: SchedulerOutput
    tokens_left: int
    seqs_left: int
    tokens: dict[Sequence, int] = field(default_factory=dict)
    partials: set[Sequence] = field(default_factory=set)  # chunks shorter than what was pending

    @property
    def empty(self) -> bool:
        return not self.tokens

    def add(self, seq: Sequence, n: int) -> None:
        if n < seq.num_pending_tokens:
            self.partials.add(seq)
        self.out.scheduled.append(ScheduledSeq(seq, n))
        self.tokens[seq] = n
        self.tokens_left -= n
        self.seqs_left -= 1

    def add_decodes(self, seqs: list[Sequence]) -> None:
        self.out.scheduled.extend([ScheduledSeq(seq, 1) for seq in seqs])
        self.tokens.update(dict.fromkeys(seqs, 1))
        self.tokens_left -= len(seqs)
        self.seqs_left -= len(seqs)

    def unschedule(self, seq: Sequence) -> None:
        n = self.tokens.pop(seq)
        self.partials.discard(seq)
        self.out.scheduled = [s for s in self.out.scheduled if s.seq is not seq]
        self.tokens_left += n
        self.seqs_left += 1


class _OrderedOnDemand(Seq[Sequence]):
    """The waiting queue in queue order, sorted on first use.

    Most steps with every slot taken never look at the waiting queue, and
    sorting a long one with a time-dependent key (aging) would cost more than
    the rest of the step.
    """

    def __init__(self, order: Callable[[], list[Sequence]]) -> None:
        self._order = order
        self._items: list[Sequence] | None = None

    @property
    def items(self) -> list[Sequence]:
        if self._items is None:
            self._items = self._order()
        return self._items

    def __getitem__(self, index: Any) -> Any:
        return self.items[index]

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self.items)


class PolicyScheduler:
    """Implements :class:`cbcore.scheduler.Scheduler` from four narrow policies."""

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

    @property
    def policies(self) -> tuple[QueuePolicy, BudgetPolicy, PrefillPolicy, PreemptionPolicy]:
        return (self.queue, self.budget, self.prefill, self.preemption)

    # -- protocol ------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        if seq.request_id in self._by_id:
            raise ValueError(f"request id {seq.request_id!r} is already in the scheduler")
        self._by_id[seq.request_id] = seq
        now = self.clock()
        for policy in self.policies:
            policy.on_arrival(seq, now)
        if self.queue.fixed_keys:
            self._keys[seq] = self.queue.key(seq, now)
        self._enqueue(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def get(self, request_id: str) -> Sequence | None:
        return self._by_id.get(request_id)

    def in_queue_order(self, seqs: Seq[Sequence], now: float) -> list[Sequence]:
        if self.queue.fixed_keys:
            return sorted(seqs, key=self._keys.__getitem__)
        return self.queue.order(seqs, now)  # type: ignore[return-value]

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
            ordered = _OrderedOnDemand(lambda: list(self.waiting))
        else:
            # A copy even if a policy returns its argument: admission removes from self.waiting.
            ordered = _OrderedOnDemand(lambda: list(self.queue.order(self.waiting, now)))  # type: ignore[arg-type]
        return SchedulerState(
            now=now,
            step=self.step_index,
            waiting=ordered,
            running=tuple(self.running),
            swapped=tuple(self.swapped),
            kv=self.blocks,
        )

    def schedule(self) -> SchedulerOutput:
        now = self.clock()
        self.step_index += 1
        state = self.state(now)
        limits = self.budget.limits(state)
        plan = _StepPlan(SchedulerOutput(), limits.max_num_tokens, limits.max_num_seqs)
        self.prefill.begin_step()
        if self.prefill.order == "decode-first":
            phases = (self._schedule_running, self._schedule_swapped, self._schedule_waiting)
        else:
            phases = (self._schedule_waiting, self._schedule_running, self._schedule_swapped)
        for phase in phases:
            phase(plan, state, limits.max_num_seqs)
        out = plan.out
        self.num_partial_prefills += len(plan.partials)
        _check_swap_order(out)
        if out.is_empty and not out.failed and not out.preempted and self.has_unfinished():
            raise SchedulerStall(
                f"step {self.step_index}: nothing scheduled with {len(self.waiting)} waiting, "
                f"{len(self.running)} running, {len(self.swapped)} swapped; limits {limits}, "
                f"policies {[p.name for p in self.policies]}"
            )
        return out

    def on_step_end(self, output: SchedulerOutput, results: Seq[StepResult]) -> None:
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

    def _tokens_for(self, seq: Sequence, plan: _StepPlan) -> int:
        if seq.num_pending_tokens == 1:
            return 1
        n = self.prefill.num_tokens(seq, plan.tokens_left, plan.empty)
        return max(0, min(n, seq.num_pending_tokens))

    def _schedule_running(self, plan: _StepPlan, state: SchedulerState, max_seqs: int) -> None:
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

    def _schedule_all_decodes(self, decodes: list[Sequence], plan: _StepPlan) -> bool:
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

    def _schedule_swapped(self, plan: _StepPlan, state: SchedulerState, max_seqs: int) -> None:
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

    def _schedule_waiting(self, plan: _StepPlan, state: SchedulerState, max_seqs: int) -> None:
        if plan.out.preempted or plan.out.swap_in or self.swapped or not self.waiting:
            return
        if plan.tokens_left <= 0 or (not self._has_slot(plan, max_seqs) and not self.queue.preempts_running):
            return
        for seq in state.waiting:  # queue order; the list is unchanged when this phase runs
            if plan.tokens_left <= 0:
                break
            if seq.status is not SequenceStatus.WAITING or not self.budget.may_admit(seq, state):
                continue  # the budget's choice, not a lack of room: those behind may still fit
            n = self._tokens_for(seq, plan)
            if n <= 0:
                break
            if not self._has_slot(plan, max_seqs) and not self._take_slot(seq, n, plan, max_seqs, state.now):
                break
            if not self.blocks.can_grow(seq, n) and not self._preempt_for(seq, n, plan, state.now):
                if self.blocks.num_used_blocks == 0:  # alone in an empty cache and still too big
                    self._fail(seq, plan, state.now, self._too_big(seq, n))
                    continue
                break
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = state.now
            self.running.append(seq)
            self.blocks.grow(seq, n)
            plan.add(seq, n)

    # -- memory pressure -----------------------------------------------------

    def _make_room(self, seq: Sequence, n: int, plan: _StepPlan, now: float) -> bool:
        """Evict until ``seq`` can grow by ``n`` tokens; False if ``seq`` itself lost."""
        while not self.blocks.try_grow(seq, n):
            if self.blocks.num_used_blocks == len(seq.block_table):
                self._fail(seq, plan, now, self._too_big(seq, n))
                return False
            candidates = [s for s in self.running if s not in plan.tokens]
            victim = self._choose_victim(candidates, now) if len(candidates) > 1 else seq
            self._preempt(victim, plan, now)
            if victim is seq:
                return False
        return True

    def _has_slot(self, plan: _StepPlan, max_seqs: int) -> bool:
        return plan.seqs_left > 0 and len(self.running) < max_seqs

    def _take_slot(self, seq: Sequence, n: int, plan: _StepPlan, max_seqs: int, now: float) -> bool:
        """Let a waiting ``seq`` evict running sequences its queue ranks below it when all slots are taken.

        This is what makes a ranking preemptive (priority, MLFQ): without it a
        request that outranks everything running still waits for a slot to end.
        """
        if not self.queue.preempts_running:
            return False
        lower = [r for r in self.running if self.queue.outranks(seq, r, now)]
        if not self._could_fit(seq, n, lower):
            return False
        while lower and not self._has_slot(plan, max_seqs):
            victim = self._choose_victim(lower, now)
            lower.remove(victim)
            self._preempt(victim, plan, now)
        return self._has_slot(plan, max_seqs) and plan.tokens_left > 0

    def _preempt_for(self, seq: Sequence, n: int, plan: _StepPlan, now: float) -> bool:
        """Let a waiting ``seq`` evict running sequences its queue ranks below it."""
        if not self.queue.preempts_running:
            return False
        lower = [r for r in self.running if self.queue.outranks(seq, r, now)]
        if not self._could_fit(seq, n, lower):
            return False
        while not self.blocks.can_grow(seq, n):
            victim = self._choose_victim(lower, now)
            lower.remove(victim)
            self._preempt(victim, plan, now)
        return True

    def _could_fit(self, seq: Sequence, n: int, evictable: list[Sequence]) -> bool:
        """Whether evicting all of ``evictable`` would give ``seq`` its blocks.

        Nobody is evicted otherwise: a preemption that cannot admit ``seq``
        only destroys work.
        """
        freeable = self.blocks.num_free_blocks + sum(len(r.block_table) for r in evictable)
        return freeable >= self.blocks.blocks_needed(seq, n)

    def _choose_victim(self, candidates: list[Sequence], now: float) -> Sequence:
        victim = self.preemption.choose_victim(candidates, self.queue, now)
        if victim not in candidates:
            raise RuntimeError(
                f"preemption policy {self.preemption.name!r} chose {getattr(victim, 'request_id', victim)!r}, "
                "which is not among the candidates"
            )
        return victim  # type: ignore[return-value]

    def _preempt(self, victim: Sequence, plan: _StepPlan, now: float) -> None:
        self.running.remove(victim)
        if victim in plan.tokens:
            plan.unschedule(victim)
        swap = self.preemption.mode == "swap"
        if swap and self.blocks.can_swap_out(victim):
            plan.out.swap_out.extend(self.blocks.swap_out(victim))
            victim.status = SequenceStatus.SWAPPED
            self.swapped.append(victim)
        else:
            if swap:
                self.num_swap_fallbacks += 1
                log.warning(
                    "host swap space full; recomputing instead",
                    request_id=victim.request_id,
                    host_free=self.blocks.num_free_host_blocks,
                    needed=len(victim.block_table),
                )
            self.blocks.free(victim)
            victim.num_computed_tokens = 0
            self._enqueue(victim)
        victim.num_preemptions += 1
        self.num_preemptions += 1
        plan.out.preempted.append(victim)
        for policy in self.policies:
            policy.on_preempt(victim, now)

    def _too_big(self, seq: Sequence, n: int) -> str:
        need = self.blocks.blocks_for_tokens(seq.num_computed_tokens + n)
        return (
            f"request {seq.request_id!r} needs {need} KV blocks for {seq.num_computed_tokens + n} tokens "
            f"but the cache has {self.blocks.num_blocks} blocks of {self.blocks.block_size}; "
            "raise kv_cache.num_blocks or lower max_new_tokens"
        )

    def _fail(self, seq: Sequence, plan: _StepPlan, now: float, message: str) -> None:
        self._remove(seq)
        seq.finish(FinishReason.ERROR, now, message)
        plan.out.failed.append(seq)
        log.error("request failed", request_id=seq.request_id, error=message)
        self._forget(seq, now)

    def _remove(self, seq: Sequence) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.blocks.free(seq)
        elif seq.status is SequenceStatus.SWAPPED:
            self.swapped.remove(seq)
            self.blocks.drop_host(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)

    def _forget(self, seq: Sequence, now: float) -> None:
        self._by_id.pop(seq.request_id, None)
        self._keys.pop(seq, None)
        for policy in self.policies:
            policy.on_finish(seq, now)


def _check_swap_order(out: SchedulerOutput) -> None:
    """Fail loudly if a plan would overwrite a host block before it is read back."""
    if out.swap_in and out.swap_out:
        reused = {h for h, _ in out.swap_in} & {h for _, h in out.swap_out}
        if reused:
            raise RuntimeError(f"scheduler bug: host blocks {sorted(reused)} swapped out and in in one step")
