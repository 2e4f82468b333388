"""The benchmark's metrics at their edges: the TPOT objective, mismatched inputs, a run that took no time."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from cbcore.bench.metrics import SLO, client_service, percentile, step_summary, summarize
from cbcore.bench.workload import BenchRequest
from cbcore.outputs import RequestMetrics, RequestOutput, StepStats


def metrics(token_times: tuple[float, ...]) -> RequestMetrics:
    return RequestMetrics(0.0, 0.0, token_times[0], token_times, token_times[-1], 0, 4, len(token_times))


def test_the_tpot_objective_is_missed_by_a_slow_request_and_met_by_a_one_token_one() -> None:
    slo = SLO(tpot=0.05)
    assert metrics((0.1, 0.12)).tpot == pytest.approx(0.02) and slo.met(metrics((0.1, 0.12)))
    assert metrics((0.1, 0.3)).tpot == pytest.approx(0.2) and not slo.met(metrics((0.1, 0.3)))
    assert metrics((0.1,)).tpot is None and slo.met(metrics((0.1,)))  # as vLLM: a one-token output's TPOT is 0


def test_client_service_refuses_requests_and_outputs_that_do_not_pair_up() -> None:
    req = SimpleNamespace(client_id="a")
    out = SimpleNamespace(metrics=None)
    with pytest.raises(ValueError):
        client_service([req, req], [out])


def test_a_run_whose_steps_took_no_time_has_no_overhead_share() -> None:
    step = StepStats(1, 1, 1, 1, 0, 1, 8, 0.0, 0.0, 0.0, 0.0)
    assert step_summary([step], busy_s=None)["engine_overhead_share"] is None
    assert step_summary([step], busy_s=0.0)["engine_overhead_share"] is None
    assert step_summary([step], busy_s=2.0)["engine_overhead_share"] == 1.0


def finished(
    rid: str, arrival: float, scheduled: float, token_times: tuple[float, ...], prompt_len: int = 4
) -> RequestOutput:
    m = RequestMetrics(
        arrival, scheduled, token_times[0], token_times, token_times[-1], 0, prompt_len, len(token_times)
    )
    return RequestOutput(rid, [7] * prompt_len, [9] * len(token_times), [], True, "length", metrics=m)


def bench(rid: str, client: str = "default") -> BenchRequest:
    return BenchRequest(
        request_id=rid, arrival_s=0.0, max_new_tokens=8, prompt_token_ids=(7,), client_id=client
    )


@pytest.mark.parametrize("text", ["ttft:0", "tpot:-0.5", "e2el:-0"])
def test_an_slo_of_zero_or_less_than_a_millisecond_below_zero_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="must be a positive number of milliseconds"):
        SLO.parse(text)
    assert SLO.parse("ttft:0.5").ttft == pytest.approx(0.0005)  # a fraction of a millisecond is an objective


def test_a_percentile_of_an_array_is_a_plain_float_as_of_a_list() -> None:
    """Rows are written as YAML and JSON: a numpy scalar in them would not be a float to every writer."""
    for values in (np.array([4.0, 1.0, 2.0]), np.arange(5), [4.0, 1.0, 2.0]):
        assert type(percentile(values, 50)) is float
    assert percentile(np.array([4.0, 1.0, 2.0]), 50) == 2.0
    assert percentile(np.arange(5), 90) == pytest.approx(3.6)


def test_the_queue_time_distribution_is_admission_less_arrival_of_each_completed_request() -> None:
    outs = [finished("a", 0.0, 0.25, (1.0, 2.0)), finished("b", 1.0, 1.75, (2.0, 3.0))]
    row = summarize("x", [bench("a"), bench("b")], outs, duration_s=3.0)
    assert row["queue_mean_s"] == pytest.approx(0.5)
    assert row["queue_p50_s"] == pytest.approx(0.5) and row["queue_p99_s"] == pytest.approx(0.25 + 0.5 * 0.99)


def test_a_client_whose_requests_never_ran_was_served_nothing_and_has_no_rate() -> None:
    refused = RequestOutput.rejected("r", [1, 2], "too long")
    clients = client_service(
        [bench("a", "x"), bench("r", "y")], [finished("a", 0.0, 0.0, (1.0, 2.0)), refused]
    )
    assert clients["y"] == {
        "requests": 1,
        "served_tokens": 0,
        "backlogged_s": 0.0,
        "tokens_per_backlogged_s": None,
    }


def test_a_clients_backlogged_time_counts_a_request_inside_another_once_and_the_ones_after_it() -> None:
    # [0, 4] holds [1, 2]; [5, 6] comes after both: 4 + 1 seconds.
    outs = [
        finished("a", 0.0, 0.0, (2.0, 4.0)),
        finished("b", 1.0, 1.0, (1.5, 2.0)),
        finished("c", 5.0, 5.0, (5.5, 6.0)),
    ]
    clients = client_service([bench(o.request_id, "x") for o in outs], outs)
    assert clients["x"]["backlogged_s"] == pytest.approx(5.0)


def test_a_busy_time_of_zero_is_not_known_and_the_steps_own_time_is_used() -> None:
    step = StepStats(1, 1, 1, 1, 0, 1, 8, 0.1, 0.1, 0.2, 0.1)  # 0.5 s, 0.2 s of it the forward
    assert step_summary([step], busy_s=0.0)["engine_overhead_share"] == pytest.approx(0.6)
    assert step_summary([step], busy_s=None)["engine_overhead_share"] == pytest.approx(0.6)


def test_the_overhead_share_is_never_negative_when_the_busy_time_is_shorter_than_the_forwards() -> None:
    step = StepStats(1, 1, 1, 1, 0, 1, 8, 0.1, 0.1, 0.2, 0.1)
    assert step_summary([step], busy_s=0.1)["engine_overhead_share"] == 0.0


def test_the_per_step_times_are_each_phases_mean_in_milliseconds() -> None:
    steps = [
        StepStats(1, 1, 1, 1, 0, 1, 8, 0.001, 0.002, 0.010, 0.003),
        StepStats(2, 1, 1, 1, 0, 1, 8, 0.003, 0.004, 0.020, 0.005),
    ]
    s = step_summary(steps, busy_s=None)
    assert s["schedule_ms_per_step"] == pytest.approx(2.0) and s["prepare_ms_per_step"] == pytest.approx(3.0)
    assert s["forward_ms_per_step"] == pytest.approx(15.0) and s["sample_ms_per_step"] == pytest.approx(4.0)


def test_the_recompute_share_is_the_tokens_prefilled_again_over_all_tokens_computed() -> None:
    # One request of a 4-token prompt, preempted once after its prefill: the steps prefilled 8 tokens, 4 again.
    m = RequestMetrics(0.0, 0.0, 1.0, (1.0, 3.0), 3.0, 1, 4, 2)
    out = RequestOutput("a", [7] * 4, [9, 9], [], True, "length", metrics=m)
    steps = [StepStats(1, 1, 4, 0, 0, 1, 8, 0, 0, 0.1, 0), StepStats(2, 1, 5, 1, 1, 1, 8, 0, 0, 0.1, 0)]
    row = summarize("x", [bench("a")], [out], duration_s=3.0, steps=steps)
    assert row["recomputed_tokens"] == 4 and row["recompute_share"] == pytest.approx(4 / 9)
    assert summarize("x", [bench("a")], [out], duration_s=3.0)["recompute_share"] is None  # no step records


def test_the_service_curves_compare_clients_and_are_left_out_for_one() -> None:
    outs = [finished("a", 0.0, 0.0, (1.0, 2.0)), finished("b", 0.0, 0.0, (1.5, 3.0))]
    one = summarize("x", [bench("a"), bench("b")], outs, duration_s=3.0)
    assert "service_curves" not in one and "service_gap_backlogged" not in one
    two = summarize("x", [bench("a", "p"), bench("b", "q")], outs, duration_s=3.0)
    assert (
        sorted(two["service_curves"]["clients"]) == ["p", "q"] and two["service_gap_backlogged"] is not None
    )


def test_a_completed_request_without_a_token_or_an_end_time_has_no_normalised_latency() -> None:
    no_token = RequestOutput(
        "n", [7] * 4, [], [], True, "stop", metrics=RequestMetrics(0.0, 0.0, None, (), 1.0, 0, 4, 0)
    )
    no_end = RequestOutput(
        "e", [7] * 4, [9], [], True, "length", metrics=RequestMetrics(0.0, 0.0, 1.0, (1.0,), None, 0, 4, 1)
    )
    outs = [finished("a", 0.0, 0.0, (1.0, 2.0)), no_token, no_end]
    row = summarize("x", [bench(o.request_id) for o in outs], outs, duration_s=2.0)
    assert row["completed"] == 3 and row["norm_latency_mean_s"] == pytest.approx(1.0)  # a's 2 s over 2 tokens


@pytest.mark.parametrize("duration", [0.0, -1.0, -0.5])
def test_a_run_that_took_no_time_or_less_is_refused(duration: float) -> None:
    with pytest.raises(ValueError, match="duration must be positive"):
        summarize("x", [bench("a")], [finished("a", 0.0, 0.0, (1.0, 2.0))], duration_s=duration)


def test_steps_that_computed_no_tokens_give_no_recompute_share() -> None:
    idle = StepStats(1, 0, 0, 0, 0, 1, 8, 0.001, 0, 0, 0)
    row = summarize("x", [bench("a")], [finished("a", 0.0, 0.0, (1.0, 2.0))], duration_s=2.0, steps=[idle])
    assert row["recomputed_tokens"] == 0 and row["recompute_share"] is None


def test_the_prefix_cache_hit_rate_is_the_prompt_tokens_found_over_those_looked_up() -> None:
    m = RequestMetrics(0.0, 0.0, 1.0, (1.0,), 1.0, 0, 8, 1, prefix_cache_queries=8, prefix_cache_hits=2)
    out = RequestOutput("a", [7] * 8, [9], [], True, "length", metrics=m)
    row = summarize("x", [bench("a")], [out], duration_s=1.0)
    assert (row["prefix_cache_queries_tokens"], row["prefix_cache_hits_tokens"]) == (8, 2)
    assert row["prefix_cache_hit_rate"] == pytest.approx(0.25)
