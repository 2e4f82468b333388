"""Scheduling behaviour without a model: PolicyScheduler driven by :class:`cbcore.testing.FakeRun`.

The built-in policies' behaviour over whole runs (priority, static waves,
chunked prefill, swap); ``tests/test_scheduling_contract.py`` has the
scheduler's own rules, one test each.
"""

from __future__ import annotations

import random
from typing import Any
from unittest import mock

import pytest
import torch

from cbcore.execution.kv_cache import KVCache
from cbcore.policies import FCFS, ChunkedPrefill, Priority, Recompute, Static, Swap, WholePrompt
from cbcore.policies.chunked_prefill import ChunkedPrefillParams
from cbcore.policies.preemption import SwapParams
from cbcore.policies.priority import PriorityParams
from cbcore.policies.static import StaticParams
from cbcore.scheduling.block_manager import BlockManager
from cbcore.scheduling.policy import PrefillPolicy, QueuePolicy
from cbcore.scheduling.policy_scheduler import PolicyScheduler
from cbcore.scheduling.sampling_params import SamplingParams
from cbcore.scheduling.scheduler import SchedulerOutput
from cbcore.scheduling.sequence import Sequence
from cbcore.testing import FakeRun, budget

# -- priority ----------------------------------------------------------------------


def test_priority_serves_lower_value_first_then_arrival() -> None:
    run = FakeRun(Priority(), budget(max_seqs=1), WholePrompt())
    for rid, prio in [("a", 2), ("b", 0), ("c", 1), ("d", 0)]:
        run.add(rid, 4, 2, priority=prio)
        run.now += 0.1
    run.run()
    order = [rid for step in run.steps for rid in step.first_time]
    assert order == ["b", "d", "c", "a"]


def _stream_of_urgent_requests(aging_s: float | None) -> int | None:
    """A priority-5 request waits behind a new priority-0 request every step; when does it start?"""
    run = FakeRun(Priority(PriorityParams(aging_s=aging_s)), budget(max_seqs=1), WholePrompt())
    run.add("low", 4, 2, priority=5)
    counter = iter(range(1000))

    def arrive(r: FakeRun) -> None:
        if len(r.steps) < 40:
            r.add(f"urgent-{next(counter)}", 4, 2, priority=0)

    run.run(each=arrive)
    return next(i for i, step in enumerate(run.steps) if "low" in step.first_time)


def test_priority_aging_lets_a_starved_request_through() -> None:
    # Without aging the low-priority request waits for the whole urgent stream.
    assert _stream_of_urgent_requests(None) >= 40
    # With aging_s=1 (one step = 1 s) its effective value at time t is 5 - t and that of an
    # urgent request that arrived at k is k - t: it outranks every urgent request that arrived
    # after t=5. Those that arrived at 0..4 still go first, two steps each: it starts at step 10.
    assert _stream_of_urgent_requests(1.0) == 10


def test_equal_priorities_never_preempt_each_other() -> None:
    run = FakeRun(Priority(), budget(max_seqs=1), WholePrompt())
    run.add("first", 4, 6, priority=1)
    run.step()
    run.add("second", 4, 2, priority=1)
    run.run()
    assert run.sched.num_preemptions == 0


def test_priority_preempts_lower_priority_running_for_kv_blocks() -> None:
    # 8 blocks of 4: the low-priority request holds 6 blocks; the urgent one needs 4.
    run = FakeRun(Priority(), budget(), WholePrompt(), num_blocks=8)
    low = run.add("low", 24, 8, priority=3)
    run.step()
    assert len(low.block_table) == 6
    run.add("urgent", 16, 2, priority=0)
    step = run.step()
    assert [s.request_id for s in step.out.preempted] == ["low"]
    assert "urgent" in step.first_time
    assert low.num_computed_tokens == 0 and low.num_preemptions == 1  # recompute: starts over
    run.run()
    assert low.is_finished and low.num_output_tokens == 8


@pytest.mark.parametrize("queue", [Priority(PriorityParams(preempt_running=False)), FCFS()])
def test_no_running_preemption_without_preempts_running(queue: QueuePolicy) -> None:
    run = FakeRun(queue, budget(), WholePrompt(), num_blocks=8)
    run.add("low", 24, 8, priority=3)
    run.step()
    run.add("urgent", 16, 2, priority=0)
    step = run.step()
    assert not step.out.preempted and "urgent" not in step.first_time
    run.run()
    assert run.sched.num_preemptions == 0


def test_priority_takes_a_slot_from_a_lower_priority_running_request() -> None:
    run = FakeRun(Priority(), budget(max_seqs=2), WholePrompt())
    run.add("low-a", 4, 20, priority=3)
    run.add("low-b", 4, 20, priority=2)
    run.step()
    run.add("urgent", 4, 2, priority=0)
    step = run.step()
    # the victim is chosen by the preemption policy (newest) among the lower-ranked ones
    assert [s.request_id for s in step.out.preempted] == ["low-b"]
    assert "urgent" in step.first_time


def test_priority_does_not_preempt_when_eviction_cannot_make_room() -> None:
    # The urgent prompt needs 9 blocks; the lower-priority request holds only 2 of 8.
    run = FakeRun(Priority(), budget(), WholePrompt(), num_blocks=12)
    run.add("high", 20, 30, priority=0)  # 5 blocks, more as it decodes
    run.add("low", 4, 30, priority=5)  # 1-2 blocks
    run.step()
    run.add("urgent", 36, 2, priority=1)  # outranks only "low"
    step = run.step()
    assert not step.out.preempted


# -- static ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prefill", "max_tokens", "num_blocks"),
    [
        (WholePrompt(), 512, 256),
        (WholePrompt(), 24, 256),
        (ChunkedPrefill(), 24, 256),
        (WholePrompt(), 512, 9),
    ],
    ids=["whole", "budget-spreads-prefills", "chunked", "kv-pressure"],
)
def test_static_never_admits_mid_wave(prefill: PrefillPolicy, max_tokens: int, num_blocks: int) -> None:
    static = Static(StaticParams(max_num_seqs=3, max_num_batched_tokens=max_tokens))
    run = FakeRun(FCFS(), static, prefill, num_blocks=num_blocks)
    shapes = [(10, 13), (20, 9), (5, 1), (16, 12), (8, 4), (30, 2), (3, 7), (12, 5), (6, 6), (9, 2)]
    for i, (plen, cap) in enumerate(shapes[:7]):
        run.add(f"r{i}", plen, cap)
    late = iter(range(7, len(shapes)))
    members: list[set[str]] = []  # the wave as the policy holds it, when each step is planned
    limits = static.limits

    def spy(state: Any) -> Any:
        result = limits(state)
        members.append(static.wave | (set() if static.closed else set(static.joining(state))))
        return result

    static.limits = spy  # type: ignore[method-assign]
    while run.sched.has_unfinished():
        if len(run.steps) % 5 == 2 and (i := next(late, None)) is not None:
            run.add(f"r{i}", *shapes[i])  # a few requests arrive while waves run
        tokens_before = {rid for rid, s in run.seqs.items() if s.num_output_tokens}
        unfinished_before = {rid for rid, s in run.seqs.items() if not s.is_finished}
        step = run.step()
        wave, k = members[-1], len(run.steps) - 1
        assert set(step.first_time) <= wave, f"step {k}: admitted non-members {set(step.first_time) - wave}"
        decoding = tokens_before & unfinished_before
        assert decoding <= wave, f"step {k}: {decoding - wave} of an older wave still decode"
        if k and decoding:  # the wave has produced tokens: it is closed to newcomers
            assert wave <= members[-2], f"step {k}: {wave - members[-2]} joined a running wave"
        assert len(wave) <= 3
    assert all(s.is_finished for s in run.seqs.values())
    assert static.waves_started >= 4
    if num_blocks == 9:
        assert run.sched.num_preemptions > 0


def test_static_with_priority_admits_a_pending_member_behind_a_newcomer() -> None:
    # The wave {a, b} cannot prefill in one step; "urgent" arrives in between and ranks first but
    # is not a member: b must still be admitted (a refusal by the budget is not a lack of room).
    static = Static(StaticParams(max_num_seqs=2, max_num_batched_tokens=16))
    run = FakeRun(Priority(), static, WholePrompt())
    run.add("a", 12, 6, priority=1)
    run.add("b", 12, 6, priority=1)
    run.step()
    run.add("urgent", 4, 2, priority=0)
    run.run()
    order = [rid for step in run.steps for rid in step.first_time]
    assert order == ["a", "b", "urgent"]


# -- chunked prefill ---------------------------------------------------------------


@pytest.mark.parametrize("order", ["decode-first", "prefill-first"])
def test_chunked_prefill_respects_the_token_budget(order: str) -> None:
    params = ChunkedPrefillParams(long_prefill_threshold=20)
    run = FakeRun(FCFS(), budget(max_seqs=6, max_tokens=16), ChunkedPrefill(params), order=order)
    for i, plen in enumerate([50, 3, 33, 1, 17, 64, 9]):
        run.add(f"r{i}", plen, 6)
    run.run()
    assert all(step.plan.num_tokens <= 16 for step in run.steps)
    assert run.sched.num_partial_prefills > 0
    mixed = [s for s in run.steps if s.plan.num_tokens - s.plan.num_decode_tokens and s.plan.num_decode_tokens]
    assert mixed, "prefill chunks never shared a step with decodes"
    for step in run.steps:
        # a token is sampled exactly for the chunks that complete what was pending
        assert step.sampled == [rid for rid, _, final in step.chunks if final]
        long_chunks = [c for c in step.chunks if c[1] > 1 and not c[2]]
        assert len(long_chunks) <= 7
    # decode-first: a step that carries a prefill chunk also carries every running decode
    if order == "decode-first":
        for step in run.steps:
            if any(not final for _, _, final in step.chunks):
                assert step.plan.num_decode_tokens == sum(1 for r in step.plan.rows if r.decode), (
                    "a decode waited for a prefill"
                )


def test_chunk_size_caps_each_chunk() -> None:
    run = FakeRun(FCFS(), budget(max_tokens=64), ChunkedPrefill(ChunkedPrefillParams(chunk_size=8)))
    run.add("long", 30, 2)
    run.run()
    chunks = [n for step in run.steps for rid, n, _ in step.chunks]
    assert chunks[:4] == [8, 8, 8, 6]


def test_long_prefill_threshold_limits_long_prefills_per_step() -> None:
    params = ChunkedPrefillParams(long_prefill_threshold=10, max_long_prefills=1)
    run = FakeRun(FCFS(), budget(max_tokens=100), ChunkedPrefill(params))
    run.add("long-a", 40, 1)
    run.add("long-b", 40, 1)
    run.add("short", 5, 1)
    step = run.step()
    # long-b is over the threshold and may not join: admission stops there (no overtaking)
    assert [c[0] for c in step.chunks] == ["long-a"]


def test_whole_prompt_runs_an_oversized_prompt_alone() -> None:
    run = FakeRun(FCFS(), budget(max_tokens=16), WholePrompt())
    run.add("big", 40, 2)
    run.add("small", 4, 2)
    first = run.step()
    assert first.chunks == [("big", 40, True)]
    assert run.sched.num_partial_prefills == 0


# -- swap --------------------------------------------------------------------------


def test_swap_round_trip_restores_block_contents_exactly() -> None:
    torch.manual_seed(0)
    kv = KVCache(3, 16, 4, 2, 8, torch.float32, "cpu", num_host_blocks=16)
    kv.k.normal_()
    kv.v.normal_()
    blocks = BlockManager(16, 4, 16)
    victim = Sequence("victim", [1] * 13, SamplingParams())
    victim.num_computed_tokens = 13
    blocks.grow(victim, 0)
    before_k, before_v = _contents(kv, victim.block_table)

    kv.copy_out(blocks.swap_out(victim))
    other = Sequence("other", [1] * 60, SamplingParams())
    blocks.grow(other, 60)  # takes every free block, including the victim's old ones
    kv.k.normal_()
    kv.v.normal_()
    blocks.free(other)
    kv.copy_in(blocks.swap_in(victim))

    after_k, after_v = _contents(kv, victim.block_table)
    assert torch.equal(before_k, after_k) and torch.equal(before_v, after_v)


def _contents(kv: KVCache, table: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    slots = (torch.tensor(table)[:, None] * kv.block_size + torch.arange(kv.block_size)).reshape(-1)
    return kv.k[:, slots].clone(), kv.v[:, slots].clone()


@pytest.mark.parametrize("order", ["decode-first", "prefill-first"])
@pytest.mark.parametrize("queue", [FCFS(), Priority()], ids=["fcfs", "priority"])
def test_swap_preemption_keeps_every_cached_token(order: str, queue: QueuePolicy) -> None:
    swap = Swap(SwapParams(victim="lowest-priority"))
    prefill = ChunkedPrefill(ChunkedPrefillParams(chunk_size=8))
    run = FakeRun(
        queue, budget(max_seqs=6, max_tokens=24), prefill, swap, num_blocks=24, host_blocks=64, kv=True, order=order
    )
    for i, (plen, cap) in enumerate([(20, 30), (9, 40), (30, 12), (4, 50), (14, 25), (26, 20), (2, 60)]):
        run.add(f"r{i}", plen, cap, priority=i % 3)
    run.run()
    assert run.sched.num_preemptions > 0
    assert any(s.out.swap_in for s in run.steps) and any(s.out.swap_out for s in run.steps)
    assert run.sched.num_swap_fallbacks == 0
    assert all(s.num_output_tokens == s.params.max_new_tokens for s in run.seqs.values())


def test_recompute_preemption_keeps_every_cached_token() -> None:
    run = FakeRun(
        FCFS(), budget(max_seqs=6, max_tokens=24), ChunkedPrefill(), Recompute(), num_blocks=20, kv=True
    )
    for i, (plen, cap) in enumerate([(20, 30), (9, 40), (30, 12), (4, 50), (14, 25)]):
        run.add(f"r{i}", plen, cap)
    run.run()
    assert run.sched.num_preemptions > 0


class _SortedEveryStep(FCFS):
    _fixed_keys = False


class _PrioritySortedEveryStep(Priority):
    def __init__(self) -> None:
        super().__init__()
        self._fixed_keys = False


def _random_trace(queue: QueuePolicy) -> list[tuple]:
    """Per step: who ran with how many tokens, who was preempted, every scheduled block table."""
    run = FakeRun(queue, budget(5, 24), num_blocks=24, block_size=4)
    plans = []
    schedule = run.sched.schedule

    def recording_schedule() -> SchedulerOutput:
        out = schedule()
        plans.append(
            (
                tuple((s.seq.request_id, s.num_tokens, tuple(s.seq.block_table)) for s in out.scheduled),
                tuple(p.request_id for p in out.preempted),
            )
        )
        return out

    run.sched.schedule = recording_schedule  # type: ignore[method-assign]
    rng = random.Random(3)
    pending = list(range(40))
    while pending or run.sched.has_unfinished():
        for _ in range(min(len(pending), rng.choice((0, 0, 1, 3)))):
            i = pending.pop(0)
            run.add(f"r{i}", rng.randint(1, 20), rng.randint(1, 12), priority=rng.randint(0, 2))
        if run.sched.has_unfinished():
            run.step()
        else:
            run.now += 1.0
    assert any(preempted for _, preempted in plans)  # memory was tight enough to reorder the queue
    return plans


@pytest.mark.parametrize(
    ("fixed", "sorted_every_step"), [(FCFS, _SortedEveryStep), (Priority, _PrioritySortedEveryStep)]
)
def test_fixed_queue_keys_plan_exactly_like_sorting_every_step(fixed: type, sorted_every_step: type) -> None:
    """The stored-key shortcut (a sorted waiting list, keys computed at arrival) changes no decision."""
    assert _random_trace(fixed()) == _random_trace(sorted_every_step())


@pytest.mark.parametrize("queue", [FCFS, Priority])
def test_decodes_in_one_pass_plan_exactly_like_the_per_sequence_loop(queue: type) -> None:
    """Same sequences, tokens, preemptions and block ids as checking each decode on its own."""
    calls = []  # every decode through the per-sequence loop instead
    with mock.patch.object(PolicyScheduler, "_all_decodes", lambda self, decodes: calls.append(1) or False):
        per_sequence = _random_trace(queue())
    assert calls  # the one-pass path was really turned off, at every step that decoded
    assert _random_trace(queue()) == per_sequence
