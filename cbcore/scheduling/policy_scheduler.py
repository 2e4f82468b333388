"""The scheduler: one class owns the queues, the phases, admission and preemption.

This docstring is the scheduling specification; ``tests/test_scheduling_contract.py``
has a test per rule. The four policies answer questions (:mod:`cbcore.scheduling.policy`),
always through the door (:mod:`cbcore.scheduling.door`), which checks each answer.

**What the answers mean.** ``key``/``order``: the order sequences are served
in; the last in order is evicted first among the running. ``outranks(a, b)``:
waiting ``a`` may evict running ``b``. ``limits``: the most sequences (also
the cap on running sequences) and tokens this step carries. ``may_admit``:
False skips a waiting sequence this step without stopping those behind it.
``num_tokens``: how many pending tokens run now; 0 skips the sequence this
step, more than pending means all of it; a decode always runs its one token
without asking. ``choose_victim``: which candidate to evict; the ``mode``
parameter of the preemption policy says how (``recompute``: its KV is freed
and it waits at its queue position; ``swap``: its KV goes to host memory, or
it is recomputed when the host pool is full).

**One step**, ``schedule()``: the budget's ``limits`` first, then three phases
in the order ``scheduler.order`` names: ``decode-first`` (the default) runs
*running, swapped, waiting*; ``prefill-first`` runs *waiting, running,
swapped*. The rules, in the order they apply:

1. *Running.* The running sequences in queue order, decodes before ongoing
   prefill chunks (prefills first under prefill-first), while the step has
   a sequence slot and tokens left. Each gets ``num_tokens``; when the KV
   cache cannot grow by that much, the preemption policy evicts one of the
   running sequences not yet scheduled this step, again until it fits; with
   no other candidate, the sequence itself is evicted. A sequence alone in
   the cache that still does not fit ends with an error. When every decode
   fits at once they are all scheduled, in queue order, without asking.
2. *Swapped.* Swapped-out sequences return in queue order before anything
   new starts, while a slot, tokens and their blocks are there; the first
   that does not fit stops the phase. Those evicted this step stay out.
3. *Waiting.* Skipped in a step that preempted or swapped in, and while
   anything is swapped out: memory is tight and new work would only be
   evicted again. Otherwise waiting sequences in queue order: those
   ``may_admit`` refuses are passed over; a sequence's cached prefix is
   mapped first, so ``num_tokens`` and the budget see only the rest; the
   first that does not fit (no slot, no tokens, no KV blocks) stops
   admission: *no overtaking*. Before giving up, a waiting sequence evicts
   the running ones it ``outranks`` (victims chosen among them), but only if
   evicting all of them would make room: an eviction that cannot admit it
   only destroys work. A sequence alone in the cache and still too big ends
   with an error, and admission goes on behind it.
4. Every swap-out is planned before any swap-in (the runner copies out first).
5. A sequence's first admission time is stamped once; preemptions keep it.

**Events** reach the policies only after a step has committed (never while it
is planned, so a step can be planned again without a request whose policy
failed): ``on_step_end`` with what each scheduled sequence computed and
sampled and who was preempted, then ``on_finish`` for each that ended.
``on_arrival`` comes from ``add()``; an abort's ``on_finish`` from ``abort()``.
"""

from __future__ import annotations

import time
from bisect import insort
from collections.abc import Callable, Mapping
from collections.abc import Sequence as Seq
from typing import Any, Literal

from cbcore.config import SLOTS, EngineConfig
from cbcore.log import get_logger
from cbcore.plugins import get_registry
from cbcore.scheduling.block_manager import BlockManager
from cbcore.scheduling.door import Door, GuardedScheduler, PolicyError, describe
from cbcore.scheduling.policy import LazyViews, SchedulerState, StepResult
from cbcore.scheduling.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from cbcore.scheduling.sequence import FinishReason, Sequence, SequenceStatus

log = get_logger(__name__)

WAITING, RUNNING, SWAPPED = SequenceStatus.WAITING, SequenceStatus.RUNNING, SequenceStatus.SWAPPED


class PolicyScheduler:
    """The scheduler a config's ``queue``/``budget``/``prefill``/``preemption`` sections compose."""

    def __init__(
        self, door: Door, blocks: BlockManager, clock: Callable[[], float] = time.perf_counter,
        order: Literal["decode-first", "prefill-first"] = "decode-first",
    ) -> None:  # fmt: skip
        self.door, self.blocks, self.clock = door, blocks, clock
        self.decode_first = order == "decode-first"
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []
        self._by_id: dict[str, Sequence] = {}
        self.step_index = self.num_preemptions = self.num_swap_fallbacks = 0
        self.num_partial_prefills = 0  # scheduled prefill chunks shorter than what was pending
        self._ordered: list[Sequence] | None = None  # this step's waiting order, once asked

    # -- requests ------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Register ``seq`` and tell the policies; if one raises, nothing of it stays (the error names it)."""
        if seq.request_id in self._by_id:
            raise ValueError(f"request id {seq.request_id!r} is already in the scheduler")
        object.__setattr__(seq.view, "_blocks", self.blocks if self.blocks.prefix_caching else None)
        now = self.clock()
        if self.door.fixed_keys:
            seq.queue_key = self.door.key(seq, now)
        self.door.arrived(seq, now)
        seq.status = WAITING
        # Stored keys: the queue stays in key order (after equal keys, as a stable sort of arrivals), so
        # no step sorts thousands of waiting sequences.
        insort(self.waiting, seq, key=lambda s: s.queue_key) if self.door.fixed_keys else self.waiting.append(seq)
        self._by_id[seq.request_id] = seq

    def get(self, request_id: str) -> Sequence | None:
        return self._by_id.get(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def abort(self, request_id: str) -> Sequence | None:
        """End a request wherever it is (with the error the engine recorded on it, if any) and free its KV."""
        if (seq := self._by_id.get(request_id)) is None:
            return None
        self._remove(seq)
        now = self.clock()
        seq.finish(FinishReason.ABORT if seq.error is None else FinishReason.ERROR, now, seq.error)
        del self._by_id[request_id]
        for failure in self.door.finished(seq, now):
            if failure.request_id is None:  # a MemoryError: it stops the engine, as anywhere else
                raise failure
        return seq

    def holding(self) -> list[Sequence]:
        """The sequences that hold state between steps (the waiting hold no KV); the step transaction's fast path."""
        return self.running + self.swapped

    def snapshot(self) -> Callable[[], None]:
        """Capture the queues and counters; the engine's step transaction restores the sequences."""
        lists = (list(self.waiting), list(self.running), list(self.swapped))
        counters = (self.step_index, self.num_preemptions, self.num_swap_fallbacks, self.num_partial_prefills)

        def restore() -> None:
            self.waiting, self.running, self.swapped = (list(x) for x in lists)
            self._by_id = {s.request_id: s for q in lists for s in q}
            self.step_index, self.num_preemptions, self.num_swap_fallbacks, self.num_partial_prefills = counters

        return restore

    def on_step_end(self, out: SchedulerOutput, results: Seq[StepResult]) -> list[PolicyError]:
        """The committed step's bookkeeping, then its events; returns the events' failures (each names its request)."""
        blocks, seqs, finished = self.blocks, [item.seq for item in out.scheduled], SequenceStatus.FINISHED
        blocks.register_computed(seqs)  # KV written this step becomes findable (finished ones' too)
        now = self.clock()
        ended = [s for s in seqs if s.status is finished] + out.failed
        if ended:
            gone = set(ended)
            self.running = [s for s in self.running if s not in gone]
            for seq in ended:
                blocks.free(seq)
                self._by_id.pop(seq.request_id, None)
        failures = self.door.step_ended(results, now) if self.door.hearing["on_step_end"] else []
        if self.door.hearing["on_finish"]:
            for seq in ended:
                failures += self.door.finished(seq, now)
        return failures

    # -- one step ------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        self.step_index += 1
        now = self._now = self.clock()
        self._ordered = None
        self._state = state = SchedulerState(
            now, self.step_index, LazyViews(self._waiting_order), tuple([s.view for s in self.running]),
            tuple([s.view for s in self.swapped]), self.blocks.view,
        )  # fmt: skip
        limits = self.door.limits(state)
        self._tokens_left, self._seqs_left = limits.max_num_tokens, limits.max_num_seqs
        self._out = SchedulerOutput(limits=limits)
        self._tokens: dict[Sequence, int] = {}  # scheduled this step
        self._views: list[Any] = []  # their views, for num_tokens(..., scheduled)
        for phase in (self._run, self._swap_in, self._admit) if self.decode_first else (self._admit, self._run, self._swap_in):
            phase()
        return self._out

    def _waiting_order(self) -> list[Sequence]:
        if self._ordered is None:
            self._ordered = list(self.waiting) if self.door.fixed_keys else self.door.order(self.waiting, self._now)
        return self._ordered

    def _add(self, seq: Sequence, n: int) -> None:
        if n < len(seq.token_ids) - seq.num_computed_tokens:
            self.num_partial_prefills += 1  # (the step's undo restores the counters)
        self._out.scheduled.append(ScheduledSeq(seq, n))
        self._tokens[seq] = n
        self._views.append(seq.view)
        self._tokens_left -= n
        self._seqs_left -= 1

    def _has_slot(self) -> bool:
        return self._seqs_left > 0 and len(self.running) < self._out.limits.max_num_seqs

    def _run(self) -> None:
        """Phase 1: the running sequences (rule 1)."""
        door, blocks, now = self.door, self.blocks, self._now
        decodes, prefills, tokens = [], [], self._tokens
        for s in door.order(self.running, now):
            if (pending := len(s.token_ids) - s.num_computed_tokens) >= 1 and s not in tokens:
                (decodes if pending == 1 else prefills).append(s)
        for members, decoding in ((decodes, True), (prefills, False))[:: 1 if self.decode_first else -1]:
            group = [s for s in members if s.status is RUNNING]  # a victim of the group before stays out
            if decoding and self._all_decodes(group):
                continue
            for seq in group:
                if seq.status is not RUNNING or seq in self._tokens:
                    continue  # evicted as a victim earlier in this loop
                if self._seqs_left <= 0 or self._tokens_left <= 0:
                    break
                n = door.num_tokens(seq, self._tokens_left, self._views)
                if n <= 0:
                    continue
                while not blocks.try_grow(seq, n):  # evict until it fits (rule 1)
                    if blocks.num_used_blocks == len(seq.block_table):
                        self._fail(seq, seq.num_computed_tokens + n)
                        break
                    candidates = [s for s in self.running if s not in self._tokens]
                    victim = door.victim(candidates, now) if len(candidates) > 1 else seq
                    self._preempt(victim)
                    if victim is seq:
                        break
                else:
                    self._add(seq, n)

    def _all_decodes(self, decodes: list[Sequence]) -> bool:
        """Schedule every decode at once if all of them fit: the common step, without
        the per-sequence eviction checks (same plan and block ids as the loop would give)."""
        if len(decodes) > min(self._seqs_left, self._tokens_left):
            return False
        needy = self.blocks.needing_a_block(decodes)
        if len(needy) > self.blocks.num_free_blocks:
            return False
        for seq in needy:
            self.blocks.grow(seq, 1)
        self._out.scheduled.extend([ScheduledSeq(seq, 1) for seq in decodes])
        self._tokens.update(dict.fromkeys(decodes, 1))
        self._views.extend([s.view for s in decodes])
        self._tokens_left -= len(decodes)
        self._seqs_left -= len(decodes)
        return True

    def _swap_in(self) -> None:
        """Phase 2: swapped-out sequences come back first (rule 2)."""
        if not self.swapped:
            return
        evicted = set(self._out.preempted)
        for seq in self.door.order(self.swapped, self._now):
            if seq in evicted:
                continue
            if self._seqs_left <= 0 or self._tokens_left <= 0 or len(self.running) >= self._out.limits.max_num_seqs:
                break
            n = self.door.num_tokens(seq, self._tokens_left, self._views)
            if n <= 0 or not self.blocks.can_swap_in(seq, n):
                break
            self._out.swap_in.extend(self.blocks.swap_in(seq))
            self.swapped.remove(seq)
            seq.status = RUNNING
            self.running.append(seq)
            self.blocks.grow(seq, n)
            self._add(seq, n)

    def _admit(self) -> None:
        """Phase 3: admissions in queue order, no overtaking (rules 3 and 5)."""
        out, blocks, door, now = self._out, self.blocks, self.door, self._now
        if out.preempted or out.swap_in or self.swapped or not self.waiting or self._tokens_left <= 0:
            return
        ordered = self._waiting_order()  # the order the budget saw, if it asked
        for seq in ordered:  # the list is unchanged while this phase runs
            if self._tokens_left <= 0:
                break
            if seq.status is not WAITING or not door.may_admit(seq, self._state):
                continue  # the budget's choice, not a lack of room: those behind may still fit
            hit = blocks.acquire_cached(seq)  # the rest is what num_tokens and the budget see
            n = door.num_tokens(seq, self._tokens_left, self._views)
            fits = n > 0 and self._has_slot() and blocks.can_grow(seq, n)
            if n > 0 and not fits:  # evict what it outranks, if that would make room (rule 3)
                lower = []
                for r in self.running:
                    if door.outranks(seq, r, now):
                        lower.append(r)
                if blocks.num_free_blocks + blocks.num_freed_by(lower) >= blocks.blocks_needed(seq, n):
                    while lower and not fits:
                        victim = door.victim(lower, now)
                        lower.remove(victim)
                        self._preempt(victim)
                        fits = self._has_slot() and blocks.can_grow(seq, n)
            if not fits:
                tokens = seq.num_computed_tokens + n
                alone = n > 0 and self._has_slot() and blocks.num_used_blocks == len(seq.block_table)
                if seq.block_table:  # give back the cached prefix it mapped
                    blocks.free(seq)
                seq.num_computed_tokens = 0
                if not alone:
                    break
                self._fail(seq, tokens)  # alone in the cache and still too big: those behind may fit
                continue
            blocks.record_lookup(seq, hit)
            self.waiting.remove(seq)
            seq.status = RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
            self.running.append(seq)
            blocks.grow(seq, n)
            self._add(seq, n)

    # -- memory pressure -----------------------------------------------------

    def _preempt(self, victim: Sequence) -> None:
        """Evict a running ``victim`` by the preemption policy's mode, taking back its share of this step."""
        out = self._out
        if victim in self._tokens:
            n = self._tokens.pop(victim)
            if n < len(victim.token_ids) - victim.num_computed_tokens:
                self.num_partial_prefills -= 1
            out.scheduled = [s for s in out.scheduled if s.seq is not victim]
            self._views.remove(victim.view)
            self._tokens_left += n
            self._seqs_left += 1
        self.running.remove(victim)
        swap = self.door.mode == "swap"
        if swap and self.blocks.can_swap_out(victim):
            out.swap_out.extend(self.blocks.swap_out(victim))
            victim.status = SWAPPED
            self.swapped.append(victim)
        else:
            if swap:
                self.num_swap_fallbacks += 1
                log.warning("host swap space full; recomputing instead", request_id=victim.request_id,
                            host_free=self.blocks.num_free_host_blocks, needed=len(victim.block_table))  # fmt: skip
            self.blocks.free(victim)
            victim.num_computed_tokens = 0
            victim.status = WAITING
            insort(self.waiting, victim, key=lambda s: s.queue_key) if self.door.fixed_keys else self.waiting.append(victim)
        victim.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(victim)

    def _fail(self, seq: Sequence, tokens: int) -> None:
        """End ``seq`` with an error: ``tokens`` tokens of it need more KV blocks than the whole cache has."""
        blocks = self.blocks
        message = (f"request {seq.request_id!r} needs {blocks.blocks_for_tokens(tokens)} KV blocks for {tokens} tokens "
                   f"but the cache has {blocks.num_blocks} blocks of {blocks.block_size}; raise kv_cache.num_blocks "
                   "or lower max_new_tokens")  # fmt: skip
        self._remove(seq)
        seq.finish(FinishReason.ERROR, self._now, message)
        self._out.failed.append(seq)
        log.error("request failed", request_id=seq.request_id, error=message)

    def _remove(self, seq: Sequence) -> None:
        """Out of whichever queue holds it, with its KV (device or host)."""
        if seq.status is RUNNING:
            self.running.remove(seq)
            self.blocks.free(seq)
        elif seq.status is SWAPPED:
            self.swapped.remove(seq)
            self.blocks.drop_host(seq)
        elif seq.status is WAITING:
            self.waiting.remove(seq)
            self.blocks.free(seq)  # nothing, or the cached prefix it mapped


def build_scheduler(config: EngineConfig, num_blocks: int, clock: Callable[[], float]) -> tuple[Scheduler, dict[int, str]]:
    """The configured scheduler over a fresh :class:`BlockManager`, and its plugins' names (for errors)."""
    registry = get_registry(tuple(config.plugins))
    sched, kv = config.scheduler, config.kv_cache

    def blocks_with(default_host_blocks: int) -> BlockManager:
        host = default_host_blocks if kv.num_host_blocks is None else kv.num_host_blocks
        return BlockManager(num_blocks, kv.block_size, host, prefix_caching=kv.prefix_caching)

    if sched.name is not None:
        plugin = registry.create("scheduler", sched.name, sched.params, "scheduler", blocks_with(0))
        guarded = GuardedScheduler(plugin, describe(plugin, registry.get("scheduler", sched.name).origin))
        return guarded, guarded.names
    specs: Mapping[str, Any] = {slot: getattr(sched, slot) for slot in SLOTS}
    policies = {slot: registry.create(slot, s.name, s.params, f"scheduler.{slot}") for slot, s in specs.items()}
    door = Door(**policies, origins={slot: registry.get(slot, s.name).origin for slot, s in specs.items()})
    # swap space defaults to the size of the device pool
    blocks = blocks_with(num_blocks if door.mode == "swap" else 0)
    return PolicyScheduler(door, blocks, clock, sched.order), door.names
