"""Did the engine keep up with the arrivals? Judged from the arrivals actually drawn, not the nominal rate.

An engine that keeps up has served nearly every request soon after the last
one arrived: each request leaves about one service time after it came. An
engine past capacity has a backlog that grew for as long as requests kept
coming, and drains it only after the last arrival. The rule: the service time
of a request is its time in the engine once admitted (end-to-end latency less
queue time); the engine fell behind when more than :data:`LAG_SHARE` of the
completed requests were still unfinished one p90 service time after the last
arrival. Counting completions works for any order of service (a policy that
reorders the queue changes *who* waits, not how many finish by a given time),
and the window after the last arrival absorbs the drain that a short run's
throughput would count against it.

The nominal rate is not used: the drawn arrivals differ from it by chance (5 %
faster in a 70-request run put a run whose TTFT stayed at 38 ms under a
throughput cut-off of 95 % of the nominal rate). The row carries the evidence:
the rate the arrivals were drawn at, the p90 service time, and how many
requests were unfinished then.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

from cbcore.bench.metrics import completed, percentile
from cbcore.bench.workload import BenchRequest
from cbcore.outputs import RequestOutput

#: Share of the completed requests still unfinished one p90 service time after the last arrival above which
#: the engine did not keep up (about the excess of the arrival rate over the service rate, as a share).
LAG_SHARE = 0.1
#: Fewer completed open-loop requests than this: too few to judge (no verdict).
MIN_REQUESTS = 10


def keeps_up(requests: Seq[BenchRequest], outputs: Seq[RequestOutput]) -> dict[str, Any]:
    """``keeps_up`` (True, False, or None when there is nothing to judge) and its evidence."""
    open_loop = [o for r, o in zip(requests, outputs, strict=True) if r.follows is None]
    arrivals = sorted(r.arrival_s for r in requests if r.follows is None)
    span = arrivals[-1] - arrivals[0] if arrivals else 0.0
    evidence: dict[str, Any] = {
        "keeps_up": None,
        "drawn_request_rate": (len(arrivals) - 1) / span if span > 0 else None,
    }
    if span <= 0 or len(open_loop) < len(requests):  # a burst at t=0, or a closed loop: no rate to keep up with
        return evidence
    done = [o.metrics for o in open_loop if completed(o) and o.metrics.queue_time is not None]
    if len(done) < MIN_REQUESTS:
        return evidence
    service = percentile([m.e2e - m.queue_time for m in done], 90)
    assert service is not None
    last_arrival = max(m.arrival_time for m in done)
    behind = sum(m.finish_time > last_arrival + service for m in done)
    evidence.update(
        keeps_up=behind <= LAG_SHARE * len(done),
        service_p90_s=service,
        unfinished_after_last_arrival=behind,
        unfinished_share=behind / len(done),
    )
    return evidence


def saturation_value(rows: Seq[dict[str, Any]]) -> float | str | None:
    """The first swept value at which these rows (one configuration, sweep order) stop keeping up."""
    for row in rows:
        if row.get("keeps_up") is False:
            return row["sweep_value"]
    return None
