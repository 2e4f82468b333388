"""The benchmark's metrics at their edges: the TPOT objective, mismatched inputs, a run that took no time."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from cbcore.bench.metrics import SLO, client_service, step_summary
from cbcore.outputs import RequestMetrics, StepStats


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
