"""One step of the composed scheduler: who runs, who is evicted, who is admitted.

Three phases over the policies' answers. In decode-first order they run as
listed; prefill-first admits waiting prompts first, then serves the running
sequences (prefills before decodes), then the swapped ones:

1. running   — decodes and ongoing prefill chunks, in queue order; when the KV
               cache cannot grow, the preemption policy evicts a victim among
               the running sequences not yet scheduled this step (possibly the
               sequence itself, which then waits);
2. swapped   — sequences evicted by swap come back before anything new starts;
3. waiting   — admissions in queue order of those the budget policy admits,
               stopping at the first that does not fit (no overtaking). A
               queue policy with ``preempts_running`` may evict lower-ranked
               running sequences to get a slot or KV blocks, but only when
               that would really make room. Skipped while anything is swapped
               out, and in a step that preempted or swapped in: memory is
               tight and new work would only be evicted again.

Within one step every swap-out is planned before any swap-in. The runner
copies out before it copies in, so this order is what makes it safe for a
swap-in to reuse a device block that a swap-out of the same step just freed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from collections.abc import Sequence as Seq
from functools import cached_property
from typing import Any, Protocol

from cbcore.log import get_logger
from cbcore.scheduling.block_manager import BlockManager
from cbcore.scheduling.policy import SchedulerState
from cbcore.scheduling.policy_set import PolicySet
from cbcore.scheduling.scheduler import ScheduledSeq, SchedulerOutput
from cbcore.scheduling.sequence import FinishReason, Sequence, SequenceStatus

log = get_logger(__name__)


class Queues(Protocol):
    """What the planner changes across steps: the composed scheduler's queues (``PolicyScheduler``)."""

    policies: PolicySet
    blocks: BlockManager
    waiting: list[Sequence]
    running: list[Sequence]
    swapped: list[Sequence]

    def in_queue_order(self, seqs: Seq[Sequence], now: float) -> list[Sequence]: ...
    def admitted(self, seq: Sequence, now: float) -> None: ...
    def preempt(self, victim: Sequence, out: SchedulerOutput, now: float) -> None: ...
    def remove(self, seq: Sequence) -> None: ...
    def forget(self, seq: Sequence, now: float) -> None: ...


class OrderedOnDemand(Seq[Sequence]):
    """The waiting queue in queue order, sorted on first use.

    Most steps with every slot taken never look at the waiting queue, and
    sorting a long one with a time-dependent key (aging) would cost more than
    the rest of the step.
    """

    def __init__(self, order: Callable[[], list[Sequence]]) -> None:
        self._order = order

    @cached_property
    def items(self) -> list[Sequence]:
        return self._order()

    def __getitem__(self, index: Any) -> Any:
        return self.items[index]

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self.items)


class StepPlanner:
    """Builds one :class:`SchedulerOutput`, changing the scheduler's queues and blocks as it decides."""

    def __init__(self, sched: Queues, state: SchedulerState) -> None:
        self.sched, self.state, self.now = sched, state, state.now
        self.policies, self.blocks = sched.policies, sched.blocks
        limits = self.policies.limits(state)
        self.max_seqs = limits.max_num_seqs
        self.out = SchedulerOutput(limits=limits)
        self.tokens_left, self.seqs_left = limits.max_num_tokens, limits.max_num_seqs
        self.tokens: dict[Sequence, int] = {}  # scheduled this step
        self.partials: set[Sequence] = set()  # chunks shorter than what was pending

    def run(self) -> SchedulerOutput:
        self.policies.prefill.begin_step()
        if self.policies.prefill.order == "decode-first":
            phases = (self._running, self._swapped, self._waiting)
        else:
            phases = (self._waiting, self._running, self._swapped)
        for phase in phases:
            phase()
        return self.out

    # -- the plan ------------------------------------------------------------

    def _add(self, seq: Sequence, n: int) -> None:
        if n < seq.num_pending_tokens:
            self.partials.add(seq)
        self.out.scheduled.append(ScheduledSeq(seq, n))
        self.tokens[seq] = n
        self.tokens_left -= n
        self.seqs_left -= 1

    def _tokens_for(self, seq: Sequence) -> int:
        return self.policies.num_tokens(seq, self.tokens_left, not self.tokens)

    def _has_slot(self) -> bool:
        return self.seqs_left > 0 and len(self.sched.running) < self.max_seqs

    # -- phases --------------------------------------------------------------

    def _running(self) -> None:
        order = [s for s in self.sched.in_queue_order(self.sched.running, self.now) if s not in self.tokens]
        decodes = [s for s in order if not s.is_prefilling]  # queue order within decodes and within prefills
        prefills = [s for s in order if s.is_prefilling]
        groups = (decodes, prefills) if self.policies.prefill.order == "decode-first" else (prefills, decodes)
        for group in groups:
            if group is decodes and self._all_decodes(decodes):
                continue
            for seq in group:
                if seq.status is not SequenceStatus.RUNNING or seq in self.tokens:
                    continue  # evicted as a victim earlier in this loop
                if self.seqs_left <= 0 or self.tokens_left <= 0:
                    break
                n = self._tokens_for(seq)
                if n > 0 and self._make_room(seq, n):
                    self._add(seq, n)

    def _all_decodes(self, decodes: list[Sequence]) -> bool:
        """Schedule every decode at once if all of them fit: the common step, without
        the per-sequence eviction checks (same plan and block ids as the loop would give)."""
        if len(decodes) > min(self.seqs_left, self.tokens_left):
            return False
        needy = self.blocks.needing_a_block(decodes)
        if len(needy) > self.blocks.num_free_blocks:
            return False
        for seq in needy:
            self.blocks.grow(seq, 1)
        self.out.scheduled.extend([ScheduledSeq(seq, 1) for seq in decodes])
        self.tokens.update(dict.fromkeys(decodes, 1))
        self.tokens_left -= len(decodes)
        self.seqs_left -= len(decodes)
        return True

    def _swapped(self) -> None:
        sched = self.sched
        if not sched.swapped:
            return
        just_evicted = set(self.out.preempted)
        for seq in [s for s in sched.in_queue_order(sched.swapped, self.now) if s not in just_evicted]:
            if self.seqs_left <= 0 or self.tokens_left <= 0 or len(sched.running) >= self.max_seqs:
                break
            n = self._tokens_for(seq)
            if n <= 0 or not self.blocks.can_swap_in(seq, n):
                break
            self.out.swap_in.extend(self.blocks.swap_in(seq))
            sched.swapped.remove(seq)
            seq.status = SequenceStatus.RUNNING
            sched.running.append(seq)
            self.blocks.grow(seq, n)
            self._add(seq, n)

    def _waiting(self) -> None:
        if self.out.preempted or self.out.swap_in or self.sched.swapped or not self.sched.waiting:
            return
        if self.tokens_left <= 0 or (not self._has_slot() and not self.policies.queue.preempts_running):
            return
        for seq in self.state.waiting:  # queue order; the list is unchanged when this phase runs
            if self.tokens_left <= 0:
                break
            if seq.status is not SequenceStatus.WAITING or not self.policies.budget.may_admit(seq, self.state):
                continue  # the budget's choice, not a lack of room: those behind may still fit
            # Map the cached prefix first: the prefill policy and the budget then see only the rest.
            hit = self.blocks.acquire_cached(seq)
            try:
                if not self._admit(seq, hit):
                    break
            except BaseException:  # a policy raised: a waiting sequence must not keep the blocks it mapped
                if seq.status is SequenceStatus.WAITING:
                    self._return_cached(seq)
                raise

    def _admit(self, seq: Sequence, hit: int) -> bool:
        """Admit ``seq`` (its cached prefix already mapped); False if it does not fit: admissions stop there.

        True also when ``seq`` failed, alone in the cache and still too big: those behind it may fit.
        """
        n = self._tokens_for(seq)
        if n <= 0 or (not self._has_slot() and not self._evict_lower(seq, n, self._has_slot)):
            self._return_cached(seq)
            return False
        fits = lambda: self.blocks.can_grow(seq, n)  # noqa: E731
        if not fits() and not self._evict_lower(seq, n, fits):
            alone = self.blocks.num_used_blocks == len(seq.block_table)  # alone in the cache, still too big
            tokens = seq.num_computed_tokens + n  # before _return_cached() resets what the cache gave
            self._return_cached(seq)
            if alone:
                self._fail(seq, tokens)
            return alone
        self.blocks.record_lookup(seq, hit)
        self.sched.admitted(seq, self.now)
        self.blocks.grow(seq, n)
        self._add(seq, n)
        return True

    def _return_cached(self, seq: Sequence) -> None:
        """Undo :meth:`BlockManager.acquire_cached` for a sequence that stays waiting."""
        if seq.block_table:
            self.blocks.free(seq)
        seq.num_computed_tokens = 0

    # -- memory pressure -----------------------------------------------------

    def _evict_lower(self, seq: Sequence, n: int, enough: Callable[[], bool]) -> bool:
        """Let a waiting ``seq`` evict running sequences its queue ranks below it until ``enough()`` (a slot, KV blocks).

        This is what makes a ranking preemptive (priority, MLFQ): without it a
        request that outranks everything running still waits for a slot to end.
        It evicts nothing unless evicting all of them would give ``seq`` its blocks:
        a preemption that cannot admit ``seq`` only destroys work.
        """
        queue = self.policies.queue
        if not queue.preempts_running:
            return False
        lower = [r for r in self.sched.running if queue.outranks(seq, r, self.now)]
        if self.blocks.num_free_blocks + self.blocks.num_freed_by(lower) < self.blocks.blocks_needed(seq, n):
            return False
        while lower and not enough():
            victim = self.policies.victim(lower, self.now)
            lower.remove(victim)
            self._preempt(victim)
        return enough()

    def _make_room(self, seq: Sequence, n: int) -> bool:
        """Evict until ``seq`` can grow by ``n`` tokens; False if ``seq`` itself lost."""
        while not self.blocks.try_grow(seq, n):
            if self.blocks.num_used_blocks == len(seq.block_table):
                self._fail(seq, seq.num_computed_tokens + n)
                return False
            candidates = [s for s in self.sched.running if s not in self.tokens]
            victim = self.policies.victim(candidates, self.now) if len(candidates) > 1 else seq
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, victim: Sequence) -> None:
        if victim in self.tokens:  # take its share of this step back
            self.partials.discard(victim)
            self.out.scheduled = [s for s in self.out.scheduled if s.seq is not victim]
            self.tokens_left += self.tokens.pop(victim)
            self.seqs_left += 1
        self.sched.preempt(victim, self.out, self.now)

    def _fail(self, seq: Sequence, tokens: int) -> None:
        """End ``seq`` with an error: ``tokens`` tokens of it need more KV blocks than the whole cache has."""
        message = (
            f"request {seq.request_id!r} needs {self.blocks.blocks_for_tokens(tokens)} KV blocks for {tokens}"
            f" tokens but the cache has {self.blocks.num_blocks} blocks of {self.blocks.block_size}; raise"
            " kv_cache.num_blocks or lower max_new_tokens"
        )
        self.sched.remove(seq)
        seq.finish(FinishReason.ERROR, self.now, message)
        self.out.failed.append(seq)
        log.error("request failed", request_id=seq.request_id, error=message)
        self.sched.forget(seq, self.now)
