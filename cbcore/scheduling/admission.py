"""Admission: which waiting sequences start this step, and whom a higher-ranked one may evict.

Admissions follow the queue policy's order and stop at the first request that
does not fit (no overtaking); the budget policy may skip one. A queue policy
with ``preempts_running`` lets a waiting request evict running ones it
outranks, but only when that would really make room for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cbcore.scheduling.plan_builder import PlanBuilder
from cbcore.scheduling.policy import SchedulerState
from cbcore.scheduling.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from cbcore.scheduling.policy_scheduler import PolicyScheduler


class Admission:
    """The waiting phase of :class:`PolicyScheduler` (a mixin: it shares the scheduler's state)."""

    def _schedule_waiting(self: PolicyScheduler, plan: PlanBuilder, state: SchedulerState, max_seqs: int) -> None:
        if plan.out.preempted or plan.out.swap_in or self.swapped or not self.waiting:
            return
        if plan.tokens_left <= 0 or (not self._has_slot(plan, max_seqs) and not self.queue.preempts_running):
            return
        for seq in state.waiting:  # queue order; the list is unchanged when this phase runs
            if plan.tokens_left <= 0:
                break
            if seq.status is not SequenceStatus.WAITING or not self.budget.may_admit(seq, state):
                continue  # the budget's choice, not a lack of room: those behind may still fit
            # Map the cached prefix first: the prefill policy and the budget then see only the rest.
            hit = self.blocks.acquire_cached(seq)
            try:
                verdict = self._admit(seq, hit, plan, state, max_seqs)
            except BaseException:  # a policy raised: a waiting sequence must not keep the blocks it mapped
                if seq.status is SequenceStatus.WAITING:
                    self._return_cached(seq)
                raise
            if verdict == "stop":
                break

    def _admit(
        self: PolicyScheduler, seq: Sequence, hit: int, plan: PlanBuilder, state: SchedulerState, max_seqs: int
    ) -> str:
        """Admit ``seq`` (its cached prefix already mapped): "admitted", "failed" or "stop" (it does not fit)."""
        n = self._tokens_for(seq, plan)
        if n <= 0 or (
            not self._has_slot(plan, max_seqs) and not self._take_slot(seq, n, plan, max_seqs, state.now)
        ):
            self._return_cached(seq)
            return "stop"
        if not self.blocks.can_grow(seq, n) and not self._preempt_for(seq, n, plan, state.now):
            if self.blocks.num_used_blocks == len(seq.block_table):  # alone in the cache and still too big
                message = self._too_big(seq, n)
                self._return_cached(seq)
                self._fail(seq, plan, state.now, message)
                return "failed"
            self._return_cached(seq)
            return "stop"
        self.blocks.record_lookup(seq, hit)
        self.waiting.remove(seq)
        seq.status = SequenceStatus.RUNNING
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = state.now
        self.running.append(seq)
        self.blocks.grow(seq, n)
        plan.add(seq, n)
        return "admitted"

    def _return_cached(self: PolicyScheduler, seq: Sequence) -> None:
        """Undo :meth:`BlockManager.acquire_cached` for a sequence that stays waiting."""
        if seq.block_table:
            self.blocks.free(seq)
        seq.num_computed_tokens = 0

    # -- memory pressure -----------------------------------------------------

    def _has_slot(self: PolicyScheduler, plan: PlanBuilder, max_seqs: int) -> bool:
        return plan.seqs_left > 0 and len(self.running) < max_seqs

    def _take_slot(self: PolicyScheduler, seq: Sequence, n: int, plan: PlanBuilder, max_seqs: int, now: float) -> bool:
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

    def _preempt_for(self: PolicyScheduler, seq: Sequence, n: int, plan: PlanBuilder, now: float) -> bool:
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

    def _could_fit(self: PolicyScheduler, seq: Sequence, n: int, evictable: list[Sequence]) -> bool:
        """Whether evicting all of ``evictable`` would give ``seq`` its blocks.

        Nobody is evicted otherwise: a preemption that cannot admit ``seq``
        only destroys work.
        """
        freeable = self.blocks.num_free_blocks + self.blocks.num_freed_by(evictable)
        return freeable >= self.blocks.blocks_needed(seq, n)
