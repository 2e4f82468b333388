"""Service per client over time and the largest gap between two clients while both are backlogged."""

from __future__ import annotations

from cbcore.bench.service import backlog_spans, backlogged_gap, service_curves
from cbcore.bench.workload import BenchRequest
from cbcore.outputs import RequestMetrics, RequestOutput


def request(rid: str, client: str, arrival: float, prompt: int, tokens: tuple[float, ...]):
    req = BenchRequest(request_id=rid, arrival_s=arrival, max_new_tokens=len(tokens),
                       prompt_token_ids=(1,) * prompt, client_id=client)  # fmt: skip
    m = RequestMetrics(arrival, arrival, tokens[0], tokens, tokens[-1], 0, prompt, len(tokens))
    return req, RequestOutput(rid, [1] * prompt, [0] * len(tokens), [], True, "length", metrics=m)


def test_the_gap_is_the_spread_of_the_service_difference_inside_the_overlap_of_backlogs() -> None:
    # a: prompt 10 served at t=1, outputs at 1, 2, 3 (weight 2 each); b: prompt 4 at t=2, one output at 2.
    # Both are backlogged over [0, 2]: W_a - W_b is 0 at 0, 12 at 1, 14 - 6 = 8 at 2: the gap is 12.
    # After t=2 only a is backlogged, so its later service (t=3) does not count.
    pairs = [request("a1", "a", 0.0, 10, (1.0, 2.0, 3.0)), request("b1", "b", 0.0, 4, (2.0,))]
    reqs, outs = zip(*pairs, strict=True)
    assert backlog_spans(reqs, outs) == {"a": [(0.0, 3.0)], "b": [(0.0, 2.0)]}
    assert backlogged_gap(reqs, outs) == 12.0
    curves = service_curves(reqs, outs)
    assert curves["clients"]["a"][-1] == 16.0 and curves["clients"]["b"][-1] == 6.0 and curves["t_s"][0] == 0.0


def test_separate_backlogs_merge_per_client_and_one_client_has_no_curves() -> None:
    pairs = [request("a1", "a", 0.0, 2, (1.0,)), request("a2", "a", 0.5, 2, (2.0,)), request("a3", "a", 5.0, 2, (6.0,)),
             request("b1", "b", 5.5, 2, (7.0,))]  # fmt: skip
    reqs, outs = zip(*pairs, strict=True)
    assert backlog_spans(reqs, outs)["a"] == [(0.0, 2.0), (5.0, 6.0)]
    assert backlogged_gap(reqs, outs) == 4.0  # over [5.5, 6]: a gets its prompt and token at 6, b nothing yet
    assert service_curves(reqs[:3], outs[:3]) is None
