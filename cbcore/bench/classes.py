"""Results per class of request: per priority, per client, per attribute the workload sets.

A policy that favours one class is judged by what each class got, not by the
average. A dimension is reported when the workload holds more than one value
of it (one priority everywhere says nothing). Per class: requests, completed,
failed, evictions (preemptions of its requests), TTFT and TPOT percentiles,
SLO attainment (when SLOs are given), deadline attainment (the share of
requests with a ``deadline_s`` that finished within it; a request that failed
missed it) and how late the missed deadlines were (end-to-end latency minus
the deadline, over the requests that completed late; the failed ones are
counted apart, as they have no finish time to be late by).
"""

from __future__ import annotations

import json
from collections.abc import Sequence as Seq
from typing import Any

from cbcore.bench.metrics import SLO, completed, percentile
from cbcore.bench.workload import BenchRequest
from cbcore.outputs import RequestOutput


def class_keys(requests: Seq[BenchRequest]) -> dict[str, list[str]]:
    """Per dimension (``priority``, ``client_id``, ``attrs.NAME``), each request's class label."""
    dims: dict[str, list[str]] = {
        "priority": [str(r.priority) for r in requests],
        "client_id": [r.client_id for r in requests],
    }
    names = sorted({k for r in requests for k in r.attrs})
    for name in names:
        dims[f"attrs.{name}"] = [_label(r.attrs.get(name)) for r in requests]
    return {dim: labels for dim, labels in dims.items() if len(set(labels)) > 1}


def _label(value: Any) -> str:
    if value is None:
        return "-"
    return value if isinstance(value, str) else json.dumps(value, default=list)


def deadline_met(deadline_s: float | None, out: RequestOutput) -> bool | None:
    """Whether a request met its deadline: it completed with end-to-end latency <= ``deadline_s``.

    None when it has no deadline. A request that failed or was aborted missed it. The benchmark,
    the simulator and the server's ``/metrics`` all count with this one definition.
    """
    if deadline_s is None:
        return None
    e2e = out.metrics.e2e if out.metrics is not None else None
    return completed(out) and e2e is not None and e2e <= deadline_s


def met_deadline(req: BenchRequest, out: RequestOutput) -> bool | None:
    """None when the request has no deadline."""
    return deadline_met(req.deadline_s, out)


def class_stats(requests: Seq[BenchRequest], outputs: Seq[RequestOutput], slo: SLO | None) -> dict[str, Any]:
    """Stats of one group of requests."""
    done = [o for o in outputs if completed(o)]
    ttft = [o.metrics.ttft for o in done if o.metrics.ttft is not None]
    tpot = [o.metrics.tpot for o in done if o.metrics.tpot is not None]
    stats: dict[str, Any] = {
        "requests": len(outputs),
        "completed": len(done),
        "failed": len(outputs) - len(done),
        "preemptions": sum(o.metrics.num_preemptions for o in outputs if o.metrics is not None),
    }
    for name, values in (("ttft", ttft), ("tpot", tpot)):
        for q in (50, 90, 99):
            stats[f"{name}_p{q}_s"] = percentile(values, q)
    if slo is not None:
        stats["slo_attainment"] = sum(slo.met(o.metrics) for o in done) / len(outputs) if outputs else None
    stats.update(deadline_stats(requests, outputs))
    return stats


def deadline_stats(requests: Seq[BenchRequest], outputs: Seq[RequestOutput]) -> dict[str, Any]:
    """Deadline attainment, and how late the misses were (None where nothing completed late)."""
    met = [m for m in map(met_deadline, requests, outputs) if m is not None]
    if not met:
        return {}
    late = [
        o.metrics.e2e - r.deadline_s
        for r, o in zip(requests, outputs, strict=True)
        if r.deadline_s is not None and completed(o) and o.metrics.e2e is not None and o.metrics.e2e > r.deadline_s
    ]
    return {
        "with_deadline": len(met),
        "deadline_attainment": sum(met) / len(met),
        "deadline_missed": len(met) - sum(met),
        "deadline_missed_failed": sum(r.deadline_s is not None and not completed(o) for r, o in zip(requests, outputs, strict=True)),
        "lateness_p50_s": percentile(late, 50),
        "lateness_p99_s": percentile(late, 99),
        "lateness_max_s": max(late) if late else None,
    }


def per_class(
    requests: Seq[BenchRequest], outputs: Seq[RequestOutput], slo: SLO | None
) -> dict[str, dict[str, dict[str, Any]]]:
    """``{dimension: {class label: stats}}`` for every dimension the workload varies."""
    result: dict[str, dict[str, dict[str, Any]]] = {}
    for dim, labels in class_keys(requests).items():
        groups: dict[str, list[int]] = {}
        for i, label in enumerate(labels):
            groups.setdefault(label, []).append(i)
        result[dim] = {
            label: class_stats([requests[i] for i in idx], [outputs[i] for i in idx], slo)
            for label, idx in sorted(groups.items(), key=lambda kv: sort_label(kv[0]))
        }
    return result


def sort_label(label: str) -> tuple[int, float, str]:
    """Numeric class labels (priorities) in numeric order, before the others."""
    try:
        return (0, float(label), label)
    except ValueError:
        return (1, 0.0, label)


def class_lines(rows: Seq[dict[str, Any]]) -> list[str]:
    """The per-class part of the terminal table: one line per row, dimension and class."""
    lines: list[str] = []
    for row in rows:
        for dim, classes in (row.get("classes") or {}).items():
            if not lines:
                lines.append("per class (ms; SLO and deadline: share of the class's requests that met them)")
            for label, s in classes.items():
                ci = s.get("ci95") or {}

                def v(key: str, scale: float = 1000.0, s: dict[str, Any] = s, ci: dict[str, Any] = ci) -> str:
                    return _num(s.get(key), ci.get(key), scale)

                parts = [
                    f"{row['name']}  {dim}={label}:",
                    f"n={v('requests', 1)}",
                    f"done={v('completed', 1)}",
                    f"failed={v('failed', 1)}",
                    f"evicted={v('preemptions', 1)}",
                    f"TTFT p50/p99 {v('ttft_p50_s')}/{v('ttft_p99_s')}",
                    f"TPOT p50/p99 {v('tpot_p50_s')}/{v('tpot_p99_s')}",
                ]
                if s.get("slo_attainment") is not None:
                    parts.append(f"SLO {v('slo_attainment', 100)}%")
                if s.get("deadline_attainment") is not None:
                    parts.append(f"deadline {v('deadline_attainment', 100)}% of {v('with_deadline', 1)}")
                if s.get("deadline_missed"):
                    parts.append(f"late p50/max {v('lateness_p50_s')}/{v('lateness_max_s')}")
                lines.append("  ".join(parts))
    return lines


def _num(value: float | None, half: float | None, scale: float) -> str:
    """A value (scaled), with ``± half-width`` when it is a mean over replicates."""
    if value is None:
        return "-"
    x = value * scale
    digits = 0 if scale != 1 or float(x).is_integer() else 1
    return f"{x:.{digits}f}" if not half else f"{x:.{digits}f} ± {half * scale:.{digits}f}"
