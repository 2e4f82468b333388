"""Deadline and SLO attainment count only completed requests as met: a failed, refused or aborted one missed.

One definition serves the benchmark's rows, its per-class tables, the
simulator (which reuses them) and the server's ``/metrics``; each is
checked here on hand-made outputs whose failed requests would have met the
deadline by their timings alone (they ended fast).
"""

from __future__ import annotations

import pytest

from cbcore.bench.classes import deadline_met, deadline_stats, per_class
from cbcore.bench.metrics import SLO, summarize
from cbcore.bench.workload import BenchRequest
from cbcore.outputs import RequestMetrics, RequestOutput
from cbcore.serve.metrics import ServerMetrics


def output(rid: str, finish_reason: str, e2e: float | None, tokens: int = 2) -> RequestOutput:
    """A finished request that arrived at 0 and ended after ``e2e`` seconds (None: refused, no timings)."""
    metrics = None
    if e2e is not None:
        times = tuple(e2e * (i + 1) / tokens for i in range(tokens))
        metrics = RequestMetrics(
            arrival_time=0.0,
            first_scheduled_time=0.0,
            first_token_time=times[0] if times else None,
            token_times=times,
            finish_time=e2e,
            num_preemptions=0,
            prompt_len=3,
            output_len=tokens,
        )
    return RequestOutput(
        request_id=rid,
        prompt_token_ids=[7, 7, 7],
        output_token_ids=[9] * tokens,
        new_token_ids=[],
        finished=True,
        finish_reason=finish_reason,
        error="failed" if finish_reason == "error" else None,
        metrics=metrics,
    )


# (request, priority, deadline_s, output): two completed in time (one exactly at it), one completed
# late, and three that ended fast without completing; one request has no deadline.
CASES = [
    ("in-time", 0, 1.0, output("in-time", "length", 0.5)),
    ("at-deadline", 0, 1.0, output("at-deadline", "stop", 1.0)),
    ("late", 1, 1.0, output("late", "length", 1.5)),
    ("failed", 1, 1.0, output("failed", "error", 0.01, tokens=1)),
    ("aborted", 1, 1.0, output("aborted", "abort", 0.02)),
    ("refused", 0, 1.0, output("refused", "error", None, tokens=0)),
    ("no-deadline", 0, None, output("no-deadline", "length", 9.0)),
]


def requests() -> list[BenchRequest]:
    return [
        BenchRequest(
            request_id=rid,
            arrival_s=0.0,
            max_new_tokens=2,
            prompt_token_ids=(7, 7, 7),
            priority=p,
            deadline_s=d,
        )
        for rid, p, d, _ in CASES
    ]


def outputs() -> list[RequestOutput]:
    return [out for *_, out in CASES]


def test_a_request_meets_its_deadline_only_by_completing_within_it():
    met = {rid: deadline_met(deadline, out) for rid, _, deadline, out in CASES}
    assert met == {
        "in-time": True,
        "at-deadline": True,
        "late": False,
        "failed": False,
        "aborted": False,
        "refused": False,
        "no-deadline": None,
    }


def test_deadline_attainment_is_completed_in_time_over_every_request_with_a_deadline():
    stats = deadline_stats(requests(), outputs())
    assert stats["with_deadline"] == 6 and stats["deadline_attainment"] == pytest.approx(2 / 6)
    # late completed, failed, aborted and refused missed it; only "late" has a finish time to be late by
    assert (stats["deadline_missed"], stats["deadline_missed_failed"]) == (4, 3)
    assert stats["lateness_max_s"] == stats["lateness_p50_s"] == pytest.approx(0.5)  # e2e 1.5 s, deadline 1 s
    by_priority = per_class(requests(), outputs(), None)["priority"]
    assert by_priority["0"]["deadline_attainment"] == pytest.approx(
        2 / 3
    )  # in-time, at-deadline; refused missed
    assert by_priority["1"]["deadline_attainment"] == 0.0  # late, failed, aborted


def test_slo_attainment_counts_failed_requests_as_missed():
    slo = SLO(e2el=1.0)
    row = summarize("x", requests(), outputs(), duration_s=10.0, slo=slo)
    assert row["slo_attainment"] == pytest.approx(2 / 7)  # in-time and at-deadline of all seven
    assert row["goodput"] == pytest.approx(2 / 10.0)
    assert per_class(requests(), outputs(), slo)["priority"]["1"]["slo_attainment"] == 0.0


def test_the_servers_deadline_attainment_counts_a_failed_request_as_missed():
    metrics = ServerMetrics("tiny", "fcfs")
    for _, _, deadline, out in CASES:
        metrics.observe_class(out, "0", "alice", deadline)
    text = metrics.render().decode()
    line = next(x for x in text.splitlines() if x.startswith("cbcore:deadline_attainment{"))
    assert float(line.rsplit(" ", 1)[1]) == pytest.approx(2 / 6)
