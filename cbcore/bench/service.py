"""Service per client over time: what a fair scheduler equalises, and how far apart clients drift.

A client's service is counted in weighted tokens as the Virtual Token Counter
paper does (Sheng et al., OSDI 2024): each prompt token costs ``INPUT_WEIGHT``
when its prefill completes (at the request's first token), each output token
``OUTPUT_WEIGHT`` when it is produced. ``W_c(t)`` is client ``c``'s
accumulated service up to ``t``.

A client is *backlogged* while it has a request that arrived and has not
finished. VTC's guarantee concerns two clients that are both backlogged over
an interval ``[t1, t2]``: their service over it, ``W_f(t1, t2) - W_g(t1, t2)``,
differs by at most ``2U`` (``U = max(w_p * L_input, w_q * M)``, ``L_input`` the
longest prompt, ``M`` the tokens the KV cache holds). The largest such
difference in a run is the spread (max minus min) of ``W_f(t) - W_g(t)``
within a stretch of time where both are backlogged, over all stretches and
pairs: :func:`backlogged_gap`.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence as Seq
from typing import Any

from cbcore.bench.workload import BenchRequest
from cbcore.outputs import RequestOutput

#: VTC's default costs: a prompt token 1, an output token 2 (its paper's w_p and w_q).
INPUT_WEIGHT = 1.0
OUTPUT_WEIGHT = 2.0
#: Points kept per client curve in a row (the curves go into JSON and the plots).
CURVE_POINTS = 120


def service_events(requests: Seq[BenchRequest], outputs: Seq[RequestOutput]) -> dict[str, list[tuple[float, float]]]:
    """Per client, (time, weighted tokens served then), in time order."""
    events: dict[str, list[tuple[float, float]]] = {}
    for req, out in zip(requests, outputs, strict=True):
        m = out.metrics
        if m is None or m.first_token_time is None:
            continue
        got = events.setdefault(req.client_id, [])
        got.append((m.first_token_time, INPUT_WEIGHT * m.prompt_len))
        got.extend((t, OUTPUT_WEIGHT) for t in m.token_times)
    return {c: sorted(e) for c, e in events.items()}


def backlog_spans(requests: Seq[BenchRequest], outputs: Seq[RequestOutput]) -> dict[str, list[tuple[float, float]]]:
    """Per client, the maximal time intervals during which it had a request in the system."""
    spans: dict[str, list[tuple[float, float]]] = {}
    for req, out in zip(requests, outputs, strict=True):
        m = out.metrics
        if m is not None and m.finish_time is not None:
            spans.setdefault(req.client_id, []).append((m.arrival_time, m.finish_time))
    merged: dict[str, list[tuple[float, float]]] = {}
    for client, intervals in spans.items():
        out_spans: list[tuple[float, float]] = []
        for a, b in sorted(intervals):
            if out_spans and a <= out_spans[-1][1]:
                out_spans[-1] = (out_spans[-1][0], max(out_spans[-1][1], b))
            else:
                out_spans.append((a, b))
        merged[client] = out_spans
    return merged


def _accumulated(events: Seq[tuple[float, float]]) -> tuple[list[float], list[float]]:
    times, totals, total = [], [], 0.0
    for t, w in events:
        total += w
        times.append(t)
        totals.append(total)
    return times, totals


def _at(times: Seq[float], totals: Seq[float], t: float) -> float:
    i = bisect.bisect_right(times, t)
    return totals[i - 1] if i else 0.0


def _overlaps(a: Seq[tuple[float, float]], b: Seq[tuple[float, float]]) -> list[tuple[float, float]]:
    """The intervals where a span of ``a`` and a span of ``b`` overlap (both sorted, disjoint within each)."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def backlogged_gap(requests: Seq[BenchRequest], outputs: Seq[RequestOutput]) -> float | None:
    """The largest difference in service between two clients over an interval where both were backlogged."""
    events = service_events(requests, outputs)
    spans = backlog_spans(requests, outputs)
    curves = {c: _accumulated(e) for c, e in events.items()}
    worst: float | None = None
    for f, g in itertools.combinations(sorted(curves), 2):
        for lo, hi in _overlaps(spans.get(f, []), spans.get(g, [])):
            stamps = [lo, hi]
            for c in (f, g):
                times = curves[c][0]
                stamps += times[bisect.bisect_left(times, lo) : bisect.bisect_right(times, hi)]
            diff = [_at(*curves[f], t) - _at(*curves[g], t) for t in stamps]
            gap = max(diff) - min(diff)
            worst = gap if worst is None else max(worst, gap)
    return worst


def service_curves(requests: Seq[BenchRequest], outputs: Seq[RequestOutput]) -> dict[str, Any] | None:
    """Each client's accumulated service at ``CURVE_POINTS`` times from the first arrival; None for one client."""
    events = service_events(requests, outputs)
    if len(events) < 2:
        return None
    starts = [o.metrics.arrival_time for o in outputs if o.metrics is not None]
    ends = [t for e in events.values() for t, _ in e[-1:]]
    t0, t1 = min(starts), max(ends)
    grid = [t0 + (t1 - t0) * i / (CURVE_POINTS - 1) for i in range(CURVE_POINTS)]
    curves = {c: _accumulated(e) for c, e in events.items()}
    return {
        "t_s": [t - t0 for t in grid],
        "clients": {c: [_at(*curves[c], t) for t in grid] for c in sorted(curves)},
        "weights": {"input": INPUT_WEIGHT, "output": OUTPUT_WEIGHT},
    }
