"""Eviction: making room in the KV cache by preempting, and failing what can never fit.

The preemption policy picks the victim and the mode (recompute or swap); this
module applies the choice to the scheduler's queues, the block manager and the
step being planned, and tells every policy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cbcore.log import get_logger
from cbcore.scheduling.plan_builder import PlanBuilder
from cbcore.scheduling.sequence import FinishReason, Sequence, SequenceStatus

_NO_KEY = object()

if TYPE_CHECKING:
    from cbcore.scheduling.policy_scheduler import PolicyScheduler

log = get_logger(__name__)


class Eviction:
    """Memory pressure for :class:`PolicyScheduler` (a mixin: it shares the scheduler's state)."""

    def _make_room(self: PolicyScheduler, seq: Sequence, n: int, plan: PlanBuilder, now: float) -> bool:
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

    def _choose_victim(self: PolicyScheduler, candidates: list[Sequence], now: float) -> Sequence:
        victim = self.preemption.choose_victim(candidates, self.queue, now)
        if not any(victim is c for c in candidates):
            self._policy_error(
                self.preemption,
                "choose_victim() returns one of the candidates",
                f"it chose {getattr(victim, 'request_id', victim)!r}, which is not among the candidates",
            )
        return victim  # type: ignore[return-value]

    def _preempt(self: PolicyScheduler, victim: Sequence, plan: PlanBuilder, now: float) -> None:
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

    def _too_big(self: PolicyScheduler, seq: Sequence, n: int) -> str:
        need = self.blocks.blocks_for_tokens(seq.num_computed_tokens + n)
        return (
            f"request {seq.request_id!r} needs {need} KV blocks for {seq.num_computed_tokens + n} tokens "
            f"but the cache has {self.blocks.num_blocks} blocks of {self.blocks.block_size}; "
            "raise kv_cache.num_blocks or lower max_new_tokens"
        )

    def _fail(self: PolicyScheduler, seq: Sequence, plan: PlanBuilder, now: float, message: str) -> None:
        self._remove(seq)
        seq.finish(FinishReason.ERROR, now, message)
        plan.out.failed.append(seq)
        log.error("request failed", request_id=seq.request_id, error=message)
        self._forget(seq, now)

    def _remove(self: PolicyScheduler, seq: Sequence) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.blocks.free(seq)
        elif seq.status is SequenceStatus.SWAPPED:
            self.swapped.remove(seq)
            self.blocks.drop_host(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)

    def _forget(self: PolicyScheduler, seq: Sequence, now: float) -> None:
        self._by_id.pop(seq.request_id, None)
        key = self._keys.pop(seq, _NO_KEY)
        if self._forgotten is not None:  # a step is under way: remember, to undo it if it fails
            self._forgotten.append((seq, key))
        for policy in self.policies:
            policy.on_finish(seq, now)
