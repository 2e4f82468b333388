"""The composed scheduler: the queues of waiting, running and swapped sequences, across steps.

It implements :class:`~cbcore.scheduling.scheduler.Scheduler` from four narrow
policies (:class:`~cbcore.scheduling.policy_set.PolicySet`, which checks each
answer). What one step decides — who runs, who is preempted, who is admitted —
is :class:`~cbcore.scheduling.step_planner.StepPlanner`'s; this class keeps
what outlives a step: the queues, the stored queue keys, the counters, and
the events policies receive when requests arrive, finish or are aborted.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Mapping
from collections.abc import Sequence as Seq
from typing import Any

from cbcore.config import SLOTS, EngineConfig
from cbcore.log import get_logger
from cbcore.plugins import get_registry
from cbcore.scheduling.block_manager import BlockManager
from cbcore.scheduling.policy import (
    BudgetPolicy,
    PreemptionPolicy,
    PrefillPolicy,
    QueuePolicy,
    SchedulerState,
    StepResult,
)
from cbcore.scheduling.policy_set import PolicySet, describe
from cbcore.scheduling.scheduler import Scheduler, SchedulerOutput
from cbcore.scheduling.sequence import FinishReason, Sequence, SequenceStatus
from cbcore.scheduling.step_planner import OrderedOnDemand, StepPlanner

log = get_logger(__name__)


class PolicyScheduler:
    """The scheduler a config's ``queue``/``budget``/``prefill``/``preemption`` sections compose."""

    def __init__(
        self,
        queue: QueuePolicy,
        budget: BudgetPolicy,
        prefill: PrefillPolicy,
        preemption: PreemptionPolicy,
        blocks: BlockManager,
        clock: Callable[[], float] = time.perf_counter,
        origins: Mapping[str, str] | None = None,
    ) -> None:
        self.policies = PolicySet(queue, budget, prefill, preemption, origins)
        self.blocks, self.clock = blocks, clock
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []
        self._by_id: dict[str, Sequence] = {}
        self._keys: dict[Sequence, Any] = {}  # stored queue keys, when the queue has fixed_keys
        self.step_index = self.num_preemptions = self.num_swap_fallbacks = 0
        self.num_partial_prefills = 0  # scheduled prefill chunks shorter than what was pending

    queue = property(lambda self: self.policies.queue)
    budget = property(lambda self: self.policies.budget)
    prefill = property(lambda self: self.policies.prefill)
    preemption = property(lambda self: self.policies.preemption)

    # -- protocol ------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Register ``seq``; if a policy raises, nothing of it stays registered (then re-raise)."""
        if seq.request_id in self._by_id:
            raise ValueError(f"request id {seq.request_id!r} is already in the scheduler")
        now = self.clock()
        self.policies.arrived(seq, now)
        try:
            if self.queue.fixed_keys:
                self._keys[seq] = self.queue.key(seq, now)
            self.enqueue(seq)  # sorting by a key that does not compare raises here, not in a later step
        except Exception:
            self._keys.pop(seq, None)  # enqueue() raises before it inserts: the queue never holds seq
            self.policies.unarrive(seq, now)
            raise
        self._by_id[seq.request_id] = seq

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def get(self, request_id: str) -> Sequence | None:
        return self._by_id.get(request_id)

    def schedule(self) -> SchedulerOutput:
        self.step_index += 1
        planner = StepPlanner(self, self.state(self.clock()))
        out = planner.run()
        self.num_partial_prefills += len(planner.partials)
        return out

    def snapshot(self) -> Callable[[], None]:
        """Capture the queues, keys and counters; the engine's step transaction restores the sequences."""
        lists = (list(self.waiting), list(self.running), list(self.swapped))
        keys = dict(self._keys)  # only add() adds keys: an empty dict stays empty through a step
        counters = (self.step_index, self.num_preemptions, self.num_swap_fallbacks, self.num_partial_prefills)

        def restore() -> None:
            self.waiting, self.running, self.swapped = (list(x) for x in lists)
            self._by_id = {s.request_id: s for q in lists for s in q}
            self._keys = dict(keys)
            self.step_index, self.num_preemptions, self.num_swap_fallbacks, self.num_partial_prefills = counters

        return restore

    def on_step_end(self, output: SchedulerOutput, results: Seq[StepResult]) -> None:
        if self.blocks.prefix_caching:  # KV written this step becomes findable (finished ones' too)
            for item in output.scheduled:
                self.blocks.register_computed(item.seq)
        now = self.clock()
        self.policies.step_ended(results, now)
        if finished := [s.seq for s in output.scheduled if s.seq.is_finished]:
            done = set(finished)
            self.running = [s for s in self.running if s not in done]
            for seq in finished:
                self.blocks.free(seq)
                self.forget(seq, now)

    def abort(self, request_id: str) -> Sequence | None:
        if (seq := self._by_id.get(request_id)) is None:
            return None
        self.remove(seq)
        now = self.clock()
        seq.finish(FinishReason.ABORT, now)
        self.forget(seq, now)
        return seq

    # -- the queues, for the planner -----------------------------------------

    def state(self, now: float) -> SchedulerState:
        # The waiting order is materialised on first read: by the budget policy at the start of the
        # step, or by the waiting phase, which runs before any change to the queue or not at all (a
        # step that preempted admits nothing). Most steps with every slot taken never read it.
        if self.queue.fixed_keys:  # kept sorted by enqueue(); a copy, as admission removes from it
            ordered = OrderedOnDemand(lambda: list(self.waiting))
        else:
            ordered = OrderedOnDemand(lambda: self.in_queue_order(self.waiting, now, lookup=True))
        return SchedulerState(now, self.step_index, ordered, tuple(self.running), tuple(self.swapped), self.blocks)

    def in_queue_order(self, seqs: Seq[Sequence], now: float, lookup: bool = False) -> list[Sequence]:
        """``seqs`` in queue order (a new list). ``lookup``: refresh cached prefixes first if the queue reads them."""
        if self.queue.fixed_keys:
            return sorted(seqs, key=self._keys.__getitem__)
        if lookup and self.blocks.prefix_caching and self.queue.reads_cached_prefix(len(seqs)):
            for seq in seqs:  # a cache-aware order needs fresh num_cached_prompt_tokens
                self.blocks.lookup(seq)
        return self.policies.order(seqs, now)

    def admitted(self, seq: Sequence, now: float) -> None:
        """``seq`` leaves the waiting queue to run; a queue that declared fixed keys is held to it."""
        if self.queue.fixed_keys and (key := self.queue.key(seq, now)) != (arrived := self._keys[seq]):
            detail = f"{seq.request_id!r} arrived with key {arrived!r}, now {key!r}"
            self.policies.error(self.queue, "with fixed_keys, key() never changes after arrival", detail, seq)
        self.waiting.remove(seq)
        seq.status = SequenceStatus.RUNNING
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = now
        self.running.append(seq)

    def enqueue(self, seq: Sequence) -> None:
        """Into the waiting queue; kept sorted when keys are fixed, so a step need not sort it."""
        seq.status = SequenceStatus.WAITING
        if self.queue.fixed_keys:
            bisect.insort(self.waiting, seq, key=self._keys.__getitem__)
        else:
            self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Out of whichever queue holds it, with its KV (device or host)."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.blocks.free(seq)
        elif seq.status is SequenceStatus.SWAPPED:
            self.swapped.remove(seq)
            self.blocks.drop_host(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)

    def preempt(self, victim: Sequence, out: SchedulerOutput, now: float) -> None:
        """Evict a running ``victim`` (its share of this step already taken back) by the policy's mode."""
        self.running.remove(victim)
        swap = self.policies.preemption.mode == "swap"
        if swap and self.blocks.can_swap_out(victim):
            out.swap_out.extend(self.blocks.swap_out(victim))
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
            self.enqueue(victim)
        victim.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(victim)
        self.policies.preempted(victim, now)

    def forget(self, seq: Sequence, now: float) -> None:
        self._by_id.pop(seq.request_id, None)
        self._keys.pop(seq, None)
        self.policies.finished(seq, now)


def build_scheduler(
    config: EngineConfig, num_blocks: int, clock: Callable[[], float]
) -> tuple[Scheduler, dict[int, str]]:
    """The configured scheduler over a fresh :class:`BlockManager`, and its plugins' names (for errors)."""
    registry = get_registry(tuple(config.plugins))
    sched, kv = config.scheduler, config.kv_cache

    def blocks_with(default_host_blocks: int) -> BlockManager:
        host = default_host_blocks if kv.num_host_blocks is None else kv.num_host_blocks
        return BlockManager(num_blocks, kv.block_size, host, prefix_caching=kv.prefix_caching)

    if sched.name is not None:
        scheduler = registry.create("scheduler", sched.name, sched.params, "scheduler", blocks_with(0))
        return scheduler, {id(scheduler): describe(scheduler, registry.get("scheduler", sched.name).origin)}
    specs = {slot: getattr(sched, slot) for slot in SLOTS}
    policies = {slot: registry.create(slot, s.name, s.params, f"scheduler.{slot}") for slot, s in specs.items()}
    # swap space defaults to the size of the device pool
    blocks = blocks_with(num_blocks if policies["preemption"].mode == "swap" else 0)
    origins = {slot: registry.get(slot, s.name).origin for slot, s in specs.items()}
    scheduler = PolicyScheduler(**policies, blocks=blocks, clock=clock, origins=origins)
    return scheduler, scheduler.policies.names
