"""Metric definitions on hand-made timelines (no model, no clock)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from cbcore.bench.metrics import (
    SLO,
    client_service,
    fairness_spread,
    percentile,
    step_summary,
    summarize,
)
from cbcore.bench.report import ratios, table
from cbcore.bench.suite import BenchResult
from cbcore.bench.workload import BenchRequest
from cbcore.outputs import RequestMetrics, RequestOutput, StepStats


def output(
    rid: str, arrival: float, token_times: list[float], *, prompt_len: int = 4, scheduled=None, preempt=0
):
    metrics = RequestMetrics(
        arrival_time=arrival,
        first_scheduled_time=scheduled if scheduled is not None else arrival,
        first_token_time=token_times[0] if token_times else None,
        token_times=tuple(token_times),
        finish_time=token_times[-1] if token_times else None,
        num_preemptions=preempt,
        prompt_len=prompt_len,
        output_len=len(token_times),
    )
    return RequestOutput(
        request_id=rid,
        prompt_token_ids=[7] * prompt_len,
        output_token_ids=[9] * len(token_times),
        new_token_ids=[],
        finished=True,
        finish_reason="length",
        metrics=metrics,
    )


def request(rid: str, client: str = "default", arrival: float = 0.0) -> BenchRequest:
    return BenchRequest(
        request_id=rid, arrival_s=arrival, max_new_tokens=8, prompt_token_ids=(7,), client_id=client
    )


def test_request_metrics_follow_the_definitions() -> None:
    m = output("a", 10.0, [11.0, 11.5, 12.5], scheduled=10.25).metrics
    assert m.queue_time == pytest.approx(0.25)
    assert m.ttft == pytest.approx(1.0)
    assert m.itl == pytest.approx([0.5, 1.0])
    assert m.e2e == pytest.approx(2.5)
    assert m.tpot == pytest.approx((2.5 - 1.0) / 2)  # (e2e - TTFT) / (n - 1)
    assert output("b", 0.0, [3.0]).metrics.tpot is None  # one token: no TPOT


def test_summarize_two_requests() -> None:
    # a: arrives 0, tokens at 1, 2, 3 -> TTFT 1, TPOT 1, e2e 3
    # b: arrives 1, tokens at 1.5, 2.0 -> TTFT 0.5, TPOT 0.5, e2e 1
    outs = [output("a", 0.0, [1.0, 2.0, 3.0]), output("b", 1.0, [1.5, 2.0], prompt_len=6, preempt=2)]
    row = summarize("x", [request("a"), request("b")], outs, duration_s=4.0)
    assert row["completed"] == 2 and row["failed"] == 0
    assert row["total_output_tokens"] == 5 and row["total_input_tokens"] == 10
    assert row["output_tokens_per_s"] == pytest.approx(5 / 4)
    assert row["total_tokens_per_s"] == pytest.approx(15 / 4)
    assert row["request_throughput"] == pytest.approx(0.5)
    assert row["ttft_mean_s"] == pytest.approx(0.75)
    assert row["ttft_p50_s"] == pytest.approx(0.75)
    assert row["ttft_p99_s"] == pytest.approx(0.5 + 0.5 * 0.99)
    assert row["tpot_p50_s"] == pytest.approx(0.75)
    assert row["itl_mean_s"] == pytest.approx((1 + 1 + 0.5) / 3)  # gaps pooled over requests
    assert row["itl_p50_s"] == pytest.approx(1.0)
    assert row["e2e_p99_s"] == pytest.approx(1.0 + 2.0 * 0.99)
    assert row["preemptions"] == 2
    assert row["steps"] == 0 and row["engine_overhead_share"] is None


def test_goodput_counts_requests_meeting_every_slo() -> None:
    outs = [
        output("fast", 0.0, [0.1, 0.2, 0.3]),  # TTFT 100 ms, TPOT 100 ms
        output("slow-first", 0.0, [0.9, 1.0]),  # TTFT 900 ms
        output("slow-decode", 0.0, [0.1, 0.6]),  # TPOT 500 ms
        output("one-token", 0.0, [0.2]),  # TPOT counts as 0
    ]
    reqs = [request(o.request_id) for o in outs]
    row = summarize("x", reqs, outs, duration_s=2.0, slo=SLO.parse("ttft:500,tpot:200"))
    assert row["goodput"] == pytest.approx(2 / 2.0)  # fast and one-token
    assert row["slo_attainment"] == pytest.approx(0.5)
    assert row["slo_ms"] == {"ttft": 500.0, "tpot": 200.0}
    row = summarize("x", reqs, outs, duration_s=2.0, slo=SLO.parse("e2el:400"))
    assert row["goodput"] == pytest.approx(2 / 2.0)  # fast (300 ms) and one-token (200 ms)


def test_failed_requests_are_not_completed() -> None:
    bad = RequestOutput.rejected("bad", [1, 2], "too long")
    row = summarize("x", [request("a"), request("bad")], [output("a", 0, [1.0]), bad], duration_s=1.0)
    assert row["completed"] == 1 and row["failed"] == 1
    assert row["request_throughput"] == 1.0
    assert row["total_output_tokens"] == 1


@pytest.mark.parametrize("text", ["ttft", "ttft:abc", "latency:5", "ttft:-3", "", "tpot:inf"])
def test_bad_slo_is_rejected(text: str) -> None:
    with pytest.raises(ValueError, match="--slo"):
        SLO.parse(text)


def test_percentile_matches_numpy_linear() -> None:
    rng = random.Random(0)
    data = [rng.expovariate(1.0) for _ in range(101)]
    for q in (0, 1, 50, 90, 99, 100):
        assert percentile(data, q) == pytest.approx(float(np.percentile(data, q)))
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0


def test_fairness_is_served_tokens_per_backlogged_second() -> None:
    # Client a: two overlapping requests in [0, 4] -> backlogged 4 s, 2*(4+4)=16 tokens -> 4 tok/s.
    # Client b: one request in [1, 2] -> 1 s, 4+2=6 tokens -> 6 tok/s.
    outs = [
        output("a1", 0.0, [1, 2, 3, 4]),
        output("a2", 1.0, [2, 3, 3.5, 4]),
        output("b1", 1.0, [1.5, 2.0], prompt_len=4),
    ]
    reqs = [request("a1", "a"), request("a2", "a", 1.0), request("b1", "b", 1.0)]
    clients = client_service(reqs, outs)
    assert clients["a"]["backlogged_s"] == pytest.approx(4.0)
    assert clients["a"]["tokens_per_backlogged_s"] == pytest.approx(16 / 4)
    assert clients["b"]["tokens_per_backlogged_s"] == pytest.approx(6 / 1)
    assert fairness_spread(clients) == pytest.approx(6 / 4)
    assert fairness_spread({"a": clients["a"]}) is None


def _step(num_seqs: int, forward: float, other: float, used: int = 10) -> StepStats:
    return StepStats(
        step=1,
        num_seqs=num_seqs,
        num_tokens=num_seqs,
        num_decode_tokens=num_seqs,
        num_preempted=0,
        kv_blocks_used=used,
        kv_blocks_total=100,
        schedule_s=other / 2,
        prepare_s=other / 4,
        forward_s=forward,
        sample_s=other / 4,
    )


def test_step_summary_splits_overhead_from_the_forward() -> None:
    steps = [_step(2, 0.10, 0.10, used=10), _step(8, 0.09, 0.01, used=30), _step(12, 0.18, 0.02, used=20)]
    s = step_summary(steps, busy_s=0.5)
    assert s["steps"] == 3
    assert s["engine_overhead_share"] == pytest.approx(1 - 0.37 / 0.5)  # includes time outside steps
    assert s["engine_overhead_share_8plus"] == pytest.approx(0.03 / 0.30)  # steps with >= 8 sequences
    assert s["steps_8plus"] == 2
    assert s["kv_util_max"] == pytest.approx(0.3)
    assert s["kv_util_mean"] == pytest.approx(0.2)
    assert s["mean_seqs_per_step"] == pytest.approx(22 / 3)
    assert s["schedule_ms_per_step"] == pytest.approx(1000 * (0.05 + 0.005 + 0.01) / 3)


def test_ratios_and_table() -> None:
    rows = [
        {"name": "fcfs", "kind": "cbcore", "output_tokens_per_s": 30.0, "identical_to_reference": True},
        {"name": "chunked", "kind": "cbcore", "output_tokens_per_s": 40.0, "identical_to_reference": False},
        {
            "name": "hf-static",
            "kind": "baseline",
            "output_tokens_per_s": 10.0,
            "identical_to_reference": None,
        },
    ]
    assert ratios(rows) == {"hf-static": pytest.approx(4.0)}
    text = table(BenchResult({"name": "w", "num_requests": 3, "arrival_span_s": 0.0}, rows))
    assert "chunked vs hf-static: 4.00x output tokens/s" in text
    lines = text.splitlines()
    assert lines[3].split()[:3] == ["fcfs", "30.0", "yes"]
    assert lines[4].split()[:3] == ["chunked", "40.0", "NO"]


def test_pooled_itl_gaps_never_span_two_requests_and_summarise_like_the_list() -> None:
    """The numpy path joins every request's token times: a gap across a boundary would be a bogus ITL."""
    from cbcore.bench.metrics import distribution, itl_gaps, latency_samples

    rng = random.Random(3)
    outs = []
    for i in range(40):
        start = rng.uniform(0, 50)
        times = [start + sum(rng.uniform(0.01, 0.2) for _ in range(k + 1)) for k in range(rng.randint(1, 12))]
        outs.append(output(f"r{i}", start, times))
    by_hand = [b - a for o in outs for a, b in zip(o.metrics.token_times, o.metrics.token_times[1:], strict=False)]
    gaps = itl_gaps([o.metrics for o in outs])
    assert gaps.tolist() == pytest.approx(by_hand)
    assert distribution("itl", gaps) == pytest.approx(distribution("itl", by_hand))
    norm = latency_samples(outs)["norm_latency"]
    assert norm == pytest.approx([o.metrics.e2e / o.metrics.output_len for o in outs])
    row = summarize("x", [request(f"r{i}") for i in range(40)], outs, duration_s=60.0)
    assert row["norm_latency_p50_s"] == pytest.approx(percentile(norm, 50))
