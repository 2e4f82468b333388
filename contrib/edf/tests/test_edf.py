"""cbcore-edf: deadline order, the fallback class, demotion, registration, equivalence, and past capacity."""

from __future__ import annotations

import pytest
from cbcore_edf import EarliestDeadlineFirst, EDFDemote, EDFParams
from cbcore_edf.policy import EDFDemoteParams

from cbcore.bench.generator import generate
from cbcore.bench.suite import BenchResult
from cbcore.config import EngineConfig
from cbcore.plugins import get_registry
from cbcore.scheduling.sampling_params import SamplingParams
from cbcore.scheduling.sequence import Sequence
from cbcore.sim.profile import load_profile
from cbcore.sim.suite import simulate_suite
from cbcore.testing import random_prompts


def seq(rid: str, arrival: float, deadline_s: float | None, cap: int = 10) -> Sequence:
    return Sequence(rid, [3] * 4, SamplingParams(max_new_tokens=cap), arrival_time=arrival, deadline_s=deadline_s)


def ids(policy: EarliestDeadlineFirst, seqs: list[Sequence], now: float) -> list[str]:
    return [s.request_id for s in policy.order(seqs, now)]


def test_earliest_deadline_first_then_the_fallback_class_in_arrival_order() -> None:
    seqs = [seq("none-early", 0.0, None), seq("late-dl", 1.0, 9.0), seq("soon-dl", 2.0, 1.0), seq("none-late", 3.0, None)]
    edf = EarliestDeadlineFirst()
    assert ids(edf, seqs, now=3.0) == ["soon-dl", "late-dl", "none-early", "none-late"]
    # With a fallback deadline, requests without one compete as if due that long after arrival.
    fallback = EarliestDeadlineFirst(EDFParams(fallback_deadline_s=5.0))
    assert ids(fallback, seqs, now=3.0) == ["soon-dl", "none-early", "none-late", "late-dl"]


def test_demotion_moves_hopeless_requests_into_the_fallback_class_and_keeps_them_there() -> None:
    missed, on_time, none = seq("missed", 0.0, 1.0), seq("on-time", 1.0, 10.0), seq("none", 0.5, None)
    plain, demote = EarliestDeadlineFirst(), EDFDemote()
    assert demote.token_time() == 0.0  # no step measured yet: demoted once late
    assert demote.params.demote
    for s in (missed, on_time, none):
        demote.on_arrival(s.view, now=0.0)
    assert ids(plain, [on_time, none, missed], now=2.0) == ["missed", "on-time", "none"]
    # Past its deadline at t=2: it joins the fallback class, by arrival (before "none", which came later).
    assert ids(demote, [on_time, none, missed], now=2.0) == ["on-time", "missed", "none"]
    assert not demote.outranks(on_time, missed, now=2.0)  # no preemptive admission unless asked
    eager = EDFDemote(EDFDemoteParams(preempt_running=True))
    assert eager.outranks(on_time, missed, now=2.0) and not eager.outranks(missed, none, now=2.0)
    demote.on_step_end([], now=2.0)  # a step ends while it is hopeless: from then on it stays demoted
    assert ids(demote, [on_time, none, missed], now=0.0) == ["on-time", "missed", "none"]
    demote.on_finish(missed, now=3.0)
    assert "missed" not in demote.demoted


def test_demote_tpot_demotes_before_the_deadline_when_the_remaining_tokens_cannot_fit() -> None:
    policy = EarliestDeadlineFirst(EDFParams(demote=True, demote_tpot_s=0.1))
    tight, loose = seq("tight", 0.0, 2.0, cap=30), seq("loose", 0.0, 4.0, cap=5)
    # At t=0 "tight" needs at least 30 x 0.1 = 3 s but is due in 2 s: demoted though not yet late.
    assert ids(policy, [tight, loose], now=0.0) == ["loose", "tight"]
    policy.on_arrival(tight.view, now=0.0)
    policy.on_step_end([], now=0.0)  # demoted as the step ends
    tight.token_ids.extend([7] * 29)  # but once nearly done, a fresh check would pass: demotion is sticky
    assert policy.hopeless(tight, now=0.0)


def test_the_token_time_is_measured_from_the_engines_steps() -> None:
    policy = EDFDemote()
    for now in (0.0, 0.1, 0.2, 0.3, 5.0, 5.1):  # steps 0.1 s apart, and one idle spell
        policy.on_step_end([], now)
    assert policy.token_time() == pytest.approx(0.1)
    # Due in 2 s with 30 tokens to go at 0.1 s each: hopeless though not late.
    assert policy.hopeless(seq("r", 5.1, 2.0, cap=30), now=5.1)
    assert not policy.hopeless(seq("q", 5.1, 4.0, cap=30), now=5.1)


def test_both_names_are_registered_through_the_entry_point() -> None:
    registry = get_registry()
    assert registry.create("queue", "edf", {"fallback_deadline_s": 3.0}, "scheduler.queue").params.fallback_deadline_s == 3.0
    demote = registry.create("queue", "edf-demote", {}, "scheduler.queue")
    assert isinstance(demote, EDFDemote) and demote.params.demote
    with pytest.raises(Exception, match="demote_tpot_s"):
        registry.create("queue", "edf", {"demote_tpot_s": -1}, "scheduler.queue")


def test_edf_keeps_outputs_identical_with_deadlines_and_preemption(cb_equivalence) -> None:
    prompts = random_prompts(6, 4, 24, seed=2)
    report = cb_equivalence(
        {
            "scheduler": {
                "queue": {"name": "edf", "demote": True, "preempt_running": True},
                "budget": {"name": "token-budget", "max_num_seqs": 4, "max_num_batched_tokens": 16},
            },
            "kv_cache": {"block_size": 4, "num_blocks": 14},
        },
        prompts=prompts,
        max_new_tokens=20,
        deadlines_s=[0.001, None, 5.0, 0.002, None, 60.0],
    )
    assert report.engine.scheduler.num_preemptions > 0


def deadline_attainment(mix: str, workload: str) -> float:
    profile = load_profile("h200-llama-3-8b")
    load = generate(workload, profile.model.vocab_size)
    config = EngineConfig.model_validate(
        {"scheduler": {"queue": {"name": mix}, "budget": {"name": "token-budget", "max_num_seqs": 2}}}
    )
    result: BenchResult = simulate_suite(profile, load, [list(r.prompt_token_ids) for r in load.requests], [(mix, config)])
    return result.rows[0]["deadline_attainment"]


def test_past_capacity_plain_edf_collapses_and_demotion_recovers() -> None:
    # A quarter more than two sequences at a time can serve (about 4.8 requests/s): the queue grows.
    workload = "poisson:n=200,rate=6,lengths=fixed,input_len=64,output_len=64,deadlines=0:3,seed=0"
    plain, demoted, fcfs = (deadline_attainment(m, workload) for m in ("edf", "edf-demote", "fcfs"))
    assert plain < 0.3 and fcfs < 0.3 and demoted > 0.6, (plain, demoted, fcfs)
