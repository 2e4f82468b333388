"""Each built-in policy on its own, and the composed scheduler's guard rails."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from cbcore.policies import (
    BUILTIN_POLICIES,
    FCFS,
    ChunkedPrefill,
    Priority,
    Recompute,
    Static,
    Swap,
    TokenBudget,
    WholePrompt,
)
from cbcore.policies.chunked_prefill import ChunkedPrefillParams
from cbcore.policies.preemption import PreemptionParams, SwapParams, pick_victim
from cbcore.policies.priority import PriorityParams
from cbcore.policies.static import StaticParams
from cbcore.scheduling.policy import BudgetPolicy, PreemptionPolicy, QueuePolicy, SchedulerState, StepLimits
from cbcore.scheduling.scheduler import SchedulerStall
from cbcore.scheduling.sequence import FinishReason, SequenceStatus
from cbcore.testing import FakeRun, budget


def view(
    rid: str, *, arrival: float = 0.0, priority: int = 0, computed: int = 0, pending: int = 1
) -> SimpleNamespace:
    return SimpleNamespace(
        request_id=rid,
        arrival_time=arrival,
        priority=priority,
        num_computed_tokens=computed,
        num_pending_tokens=pending,
    )


@pytest.mark.parametrize("cls", BUILTIN_POLICIES, ids=lambda c: c.name)
def test_every_builtin_has_defaults_and_refuses_unknown_params(cls: type) -> None:
    policy = cls()
    assert policy.params == cls.Params()
    assert cls.kind in ("queue", "budget", "prefill", "preemption")
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        cls.Params(not_a_param=1)


# -- queue ---------------------------------------------------------------------------


def test_fcfs_orders_by_arrival() -> None:
    seqs = [view("c", arrival=3.0), view("a", arrival=1.0), view("b", arrival=2.0)]
    assert [s.request_id for s in FCFS().order(seqs, now=10.0)] == ["a", "b", "c"]
    assert not FCFS().outranks(seqs[1], seqs[0], now=10.0)  # admission under fcfs never evicts


def test_priority_aging_lowers_the_effective_value_with_waiting_time() -> None:
    aged = Priority(PriorityParams(aging_s=2.0))
    old_low = view("old", arrival=0.0, priority=3)
    new_high = view("new", arrival=9.0, priority=0)
    assert aged.effective_priority(old_low, now=10.0) == pytest.approx(-2.0)
    assert [s.request_id for s in aged.order([new_high, old_low], now=10.0)] == ["old", "new"]
    assert [s.request_id for s in Priority().order([old_low, new_high], now=10.0)] == ["new", "old"]


def test_priority_outranks_only_strictly() -> None:
    prio = Priority()
    a, b = view("a", arrival=0.0, priority=1), view("b", arrival=5.0, priority=1)
    assert not prio.outranks(a, b, now=6.0) and not prio.outranks(b, a, now=6.0)
    urgent = view("u", arrival=6.0, priority=0)
    assert prio.outranks(urgent, a, now=6.0) and not prio.outranks(a, urgent, now=6.0)
    assert not Priority(PriorityParams(preempt_running=False)).outranks(urgent, a, now=6.0)


# -- budget ------------------------------------------------------------------------------


def state(waiting: tuple = ()) -> SchedulerState:
    return SchedulerState(now=0.0, step=1, waiting=waiting, running=(), swapped=(), kv=None)  # type: ignore[arg-type]


def test_token_budget_limits_come_from_params() -> None:
    assert budget(3, 40).limits(state()) == StepLimits(3, 40)
    assert TokenBudget().may_admit(view("x"), state())


def test_static_forms_a_wave_in_queue_order_and_closes_it_on_the_first_token() -> None:
    static = Static(StaticParams(max_num_seqs=2))
    a, b, c = view("a"), view("b"), view("c")
    first = state((a, b, c))
    assert [static.may_admit(s, first) for s in (a, b, c)] == [True, True, False]
    assert static.may_admit(a, first) and static.waves_started == 0  # answers change nothing
    static.on_step_end([SimpleNamespace(seq=a, new_token=5, preempted=False)], now=1.0)  # b did not fit yet
    assert static.closed and static.wave == {"a", "b"} and static.waves_started == 1
    static.on_finish(a, now=1.0)
    later = state((c, b))  # c ranks first now, but the wave is closed: b still joins, c may not
    assert static.may_admit(b, later) and not static.may_admit(c, later)
    static.on_step_end([SimpleNamespace(seq=b, new_token=5, preempted=False)], now=2.0)
    static.on_finish(b, now=3.0)
    assert not static.closed and static.may_admit(c, state((c,)))


# -- prefill -----------------------------------------------------------------------------


def test_chunked_prefill_fills_what_the_budget_leaves_within_chunk_size() -> None:
    seq = view("s", pending=100)
    other = (view("o", pending=1),)
    assert ChunkedPrefill().num_tokens(seq, tokens_left=37, scheduled=other) == 37
    capped = ChunkedPrefill(ChunkedPrefillParams(chunk_size=16))
    assert capped.num_tokens(seq, tokens_left=37, scheduled=other) == 16
    assert capped.num_tokens(view("t", pending=5), tokens_left=37, scheduled=other) == 5


def test_chunked_prefill_counts_the_long_prefills_the_step_holds() -> None:
    policy = ChunkedPrefill(ChunkedPrefillParams(long_prefill_threshold=10, max_long_prefills=2))
    longs = [view(f"l{i}", pending=50) for i in range(3)]
    assert policy.num_tokens(longs[0], 100, ()) == 50
    assert policy.num_tokens(longs[1], 100, longs[:1]) == 50
    assert policy.num_tokens(longs[2], 100, longs[:2]) == 0  # two long ones in the step already
    assert policy.num_tokens(view("short", pending=8), 100, longs[:2]) == 8
    assert policy.num_tokens(longs[2], 100, (view("short", pending=8),)) == 50  # a new step


def test_whole_prompt_runs_whole_or_alone() -> None:
    policy = WholePrompt()
    other = (view("o", pending=1),)
    assert policy.num_tokens(view("s", pending=30), tokens_left=30, scheduled=other) == 30
    assert policy.num_tokens(view("s", pending=31), tokens_left=30, scheduled=other) == 0
    assert policy.num_tokens(view("s", pending=99), tokens_left=30, scheduled=()) == 99


# -- preemption ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rule", "victim"),
    [
        ("newest", "late"),
        ("lowest-priority", "unimportant"),
        ("least-progress", "fresh"),
        ("queue-order", "late"),
    ],
)
def test_victim_rules(rule: str, victim: str) -> None:
    candidates = [
        view("early", arrival=0.0, priority=1, computed=50),
        view("unimportant", arrival=1.0, priority=9, computed=40),
        view("fresh", arrival=2.0, priority=0, computed=3),
        view("late", arrival=3.0, priority=1, computed=20),
    ]
    assert pick_victim(rule, candidates, FCFS(), now=5.0).request_id == victim  # type: ignore[arg-type]
    assert Recompute(PreemptionParams(victim=rule)).params.mode == "recompute"
    assert Swap(SwapParams(victim=rule)).params.mode == "swap"


# -- the composed scheduler's guard rails -------------------------------------------------


class AdmitsNobody(BudgetPolicy):
    name = "admits-nobody"

    def limits(self, state: SchedulerState) -> StepLimits:
        return StepLimits(4, 64)

    def may_admit(self, seq, state) -> bool:  # type: ignore[no-untyped-def]
        return False


def test_a_step_that_plans_nothing_with_work_left_raises_a_stall_naming_the_policies() -> None:
    run = FakeRun(budget=AdmitsNobody())
    run.add("r", 4)
    with pytest.raises(SchedulerStall, match=r"admits-nobody.*planned no tokens while work waits \(1 waiting"):
        run.step()


class PicksAStranger(PreemptionPolicy):
    name = "picks-a-stranger"

    def choose_victim(self, candidates, queue, now):  # type: ignore[no-untyped-def]
        return view("stranger")


def test_a_victim_outside_the_candidates_is_refused() -> None:
    run = FakeRun(preemption=PicksAStranger(), num_blocks=4)
    run.add("a", 6, 20)
    run.add("b", 6, 20)
    with pytest.raises(RuntimeError, match=r"picks-a-stranger.*'stranger'.*not among the candidates"):
        run.run()


def test_a_request_that_outgrows_the_whole_cache_fails_with_sizes() -> None:
    run = FakeRun(num_blocks=3)  # 12 tokens: the prompt fits, its output cannot
    seq = run.add("big", 8, 10)
    run.run()
    assert seq.finish_reason is FinishReason.ERROR
    assert "needs 4 KV blocks for 13 tokens but the cache has 3 blocks of 4" in seq.error
    assert run.blocks.num_free_blocks == 3


def test_duplicate_request_ids_are_refused() -> None:
    run = FakeRun()
    run.add("same", 4)
    with pytest.raises(ValueError, match="'same' is already in the scheduler"):
        run.add("same", 4)


@pytest.mark.parametrize("where", ["waiting", "running", "swapped"])
def test_abort_frees_everything_wherever_the_request_is(where: str) -> None:
    queue = Priority(PriorityParams(aging_s=1e6))
    run = FakeRun(queue, preemption=Swap(), num_blocks=6, host_blocks=8, budget=budget(max_seqs=1))
    a = run.add("a", 8, 30)
    if where != "waiting":
        run.step()
    if where == "swapped":
        run.add("urgent", 8, 2, priority=-1)  # outranks a: takes its slot, a is swapped out
        run.step()
        assert a.status is SequenceStatus.SWAPPED
    run.sched.abort("a")
    assert a.finish_reason is FinishReason.ABORT
    assert run.blocks.num_free_host_blocks == 8
    run.run()
    assert run.blocks.num_free_blocks == 6


class StillSetsFixedKeys(QueuePolicy):
    """Written for the old policy API: ``fixed_keys`` is no longer read."""

    name = "still-sets-fixed-keys"
    fixed_keys = True

    def key(self, seq, now):  # type: ignore[no-untyped-def]
        return (seq.arrival_time,)


def test_a_policy_setting_a_name_that_left_the_api_is_refused_naming_its_replacement() -> None:
    with pytest.raises(TypeError, match="sets 'fixed_keys', which cbcore no longer reads: remove it"):
        FakeRun(queue=StillSetsFixedKeys())
