"""Replicates: every row on N independently drawn workloads; each metric as its mean and a 95 % interval.

Replication is done on the workload *spec* (the ``--workload`` string), so it
works for any source that has keys:

* a generator (``poisson:...``, ``gamma:...``) redraws arrivals, lengths and
  prompts: replicate ``i`` runs with ``seed`` + ``i``;
* a trace window (``trace:path=FILE,...,duration_s=D`` or a named trace with
  ``duration_s``) replays disjoint windows: replicate ``i`` starts ``i * D``
  seconds later (``start_s`` + ``i * D``). A bootstrap over the requests of one
  window would break the arrival structure (bursts, diurnal drift) that a
  trace is replayed for, so windows are used instead, and the report says so.

A file replayed exactly (``seed``, ``FILE.jsonl``) has nothing to redraw and is
refused. Every row runs on the same N workloads (common random numbers), so
two rows are compared replicate by replicate (:func:`differences`).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from pathlib import Path
from typing import Any

from cbcore.bench.generator import GENERATORS
from cbcore.bench.stats import LEVEL, mean_interval, paired_difference
from cbcore.bench.suite import BenchResult
from cbcore.bench.sweep import with_key
from cbcore.bench.workload import WorkloadError

#: Nested row values whose numbers are averaged like the row's own (per class, per client).
NESTED = ("classes", "clients")
#: The metrics compared pair by pair (lower is better unless named in HIGHER_IS_BETTER).
COMPARED = (
    "output_tokens_per_s", "request_throughput", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s",
    "itl_p99_s", "e2e_p50_s", "e2e_p99_s", "queue_p50_s", "goodput", "slo_attainment", "deadline_attainment",
    "preemptions", "recomputed_tokens", "failed",
)  # fmt: skip


def spec_value(spec: str, key: str) -> str | None:
    """The value ``key`` has in ``spec`` (``kind:key=value,...``), or None."""
    _, _, body = spec.partition(":")
    for item in body.split(","):
        name, sep, value = item.partition("=")
        if sep and name.strip() == key:
            return value.strip()
    return None


def _is_file(spec: str) -> bool:
    return spec == "seed" or spec.endswith(".jsonl") or Path(spec).exists()


def replicate_spec(spec: str, i: int) -> str:
    """The workload of replicate ``i`` (0 is ``spec`` itself): the next seed, or the next trace window."""
    spec = spec.strip()
    if _is_file(spec):
        raise WorkloadError(
            f"--replicates: workload {spec!r} replays the same requests every time; replicates need a "
            "generator (poisson:...,seed=S redraws with S+i) or a trace window (trace:path=FILE,duration_s=D "
            "replays the next D seconds)"
        )
    kind = spec.partition(":")[0]
    if kind in GENERATORS:
        seed = spec_value(spec, "seed") or "0"
        try:
            base = int(seed)
        except ValueError:
            raise WorkloadError(f"--replicates: workload {spec!r}: seed {seed!r} is not an integer") from None
        return spec if i == 0 else with_key(spec, "seed", str(base + i))
    duration = spec_value(spec, "duration_s")
    if duration is None:
        raise WorkloadError(
            f"--replicates: trace workload {spec!r} needs duration_s=D: replicate i replays the window "
            "starting i*D seconds after start_s (disjoint windows of the trace)"
        )
    try:
        start, length = float(spec_value(spec, "start_s") or 0.0), float(duration)
    except ValueError:
        raise WorkloadError(f"--replicates: workload {spec!r}: start_s and duration_s must be numbers") from None
    if not length > 0:
        raise WorkloadError(f"--replicates: workload {spec!r}: duration_s must be positive")
    return spec if i == 0 else with_key(spec, "start_s", f"{start + i * length:g}")


def replicate_specs(spec: str, n: int) -> list[str]:
    """The workloads of ``n`` replicates; one replicate is ``spec`` itself, whatever it is."""
    if n < 1:
        raise WorkloadError(f"--replicates must be at least 1, got {n}")
    return [spec] if n == 1 else [replicate_spec(spec, i) for i in range(n)]


def method(spec: str, n: int) -> str:
    """How the replicates were drawn, for the report."""
    if spec.partition(":")[0] in GENERATORS:
        seed = int(spec_value(spec, "seed") or 0)
        return f"{n} replicates: the generator redrew arrivals, lengths and prompts with seeds {seed}..{seed + n - 1}"
    start, length = float(spec_value(spec, "start_s") or 0.0), float(spec_value(spec, "duration_s") or 0.0)
    return (
        f"{n} replicates: disjoint {length:g} s windows of the trace starting at "
        f"{', '.join(f'{start + i * length:g}' for i in range(n))} s (windows, not a bootstrap over requests, "
        "keep the trace's arrival structure)"
    )


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def aggregate(dicts: Seq[dict[str, Any]], nested: Seq[str] = NESTED) -> dict[str, Any]:
    """One dict from the replicates' dicts: numbers averaged, with ``ci95`` half-widths and ``replicate_values``.

    Numbers missing (None) in some replicates are averaged over those that have
    them; flags are true only when true in every replicate; dicts named in
    ``nested`` are aggregated the same way; anything else is the first replicate's.
    """
    out: dict[str, Any] = {}
    half: dict[str, float | None] = {}
    values: dict[str, list[Any]] = {}
    keys = list(dict.fromkeys(k for d in dicts for k in d))
    for key in keys:
        vals = [d.get(key) for d in dicts]
        present = [v for v in vals if v is not None]
        if present and all(_number(v) for v in present):
            interval = mean_interval(present)
            out[key], half[key], values[key] = interval.mean, interval.half_width, vals
        elif present and all(isinstance(v, bool) for v in present):
            out[key] = all(present)
        elif key in nested and present and all(isinstance(v, dict) for v in present):
            labels = list(dict.fromkeys(k for v in present for k in v))
            out[key] = {label: _nested(label, [v.get(label) for v in present]) for label in labels}
        else:
            out[key] = present[0] if present else None
    out["ci95"] = half
    out["replicate_values"] = values
    return out


def _nested(label: str, parts: list[Any]) -> Any:
    parts = [p for p in parts if p is not None]
    if all(isinstance(p, dict) and any(isinstance(v, dict) for v in p.values()) for p in parts):
        keys = list(dict.fromkeys(k for p in parts for k in p))
        return {k: _nested(k, [p.get(k) for p in parts]) for k in keys}  # one level more: dimension -> class
    return aggregate(parts, nested=())


def combine(results: Seq[BenchResult], specs: Seq[str]) -> BenchResult:
    """The replicates' results as one: a row per name, aggregated; samples pooled (and kept per replicate)."""
    if len(results) != len(specs) or not results:
        raise ValueError(f"{len(results)} results for {len(specs)} replicate workloads")
    rows = []
    samples: dict[str, dict[str, list[float]]] = {}
    per_replicate: dict[str, list[dict[str, list[float]]]] = {}
    names = list(dict.fromkeys(r["name"] for result in results for r in result.rows))
    for name in names:
        runs = [next((r for r in result.rows if r["name"] == name), None) for result in results]
        failed = [(i, r) for i, r in enumerate(runs) if r is None or "error" in r]
        if failed:
            i, row = failed[0]
            why = "did not run" if row is None else row["error"]
            first = next(r for r in runs if r is not None)
            rows.append({"name": name, "kind": first["kind"], "error": f"replicate {i} ({specs[i]}): {why}"})
            continue
        row = aggregate(runs)  # type: ignore[arg-type]
        row["replicates"] = len(runs)
        row["failures"] = merge_failures([r.get("failures") or [] for r in runs])  # type: ignore[union-attr]
        for flag in ("keeps_up",):
            if flag in row:
                row[f"{flag}_replicates"] = sum(bool(r.get(flag)) for r in runs)  # type: ignore[union-attr]
        rows.append(row)
        kept = [result.samples[name] for result in results if name in result.samples]
        per_replicate[name] = kept
        samples[name] = {k: [x for s in kept for x in s.get(k, [])] for k in (kept[0] if kept else {})}
    workload = dict(results[0].workload)
    workload["replicates"] = {
        "n": len(results),
        "specs": list(specs),
        "method": method(specs[0], len(results)),
        "level": LEVEL,
        "num_requests": [r.workload.get("num_requests") for r in results],
        "differences": differences(rows),
    }
    out = BenchResult(workload=workload, rows=rows, samples=samples)
    out.replicate_samples = per_replicate
    return out


def merge_failures(lists: Seq[Seq[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Failure reasons over replicates: counts added per reason, a few request ids kept."""
    merged: dict[str, dict[str, Any]] = {}
    for i, failures in enumerate(lists):
        for f in failures:
            entry = merged.setdefault(f["reason"], {**f, "count": 0, "requests": []})
            entry["count"] += f["count"]
            entry["requests"] = (entry["requests"] + [f"{rid} (replicate {i})" for rid in f["requests"]])[:10]
    return list(merged.values())


def differences(rows: Seq[dict[str, Any]], metrics: Seq[str] = COMPARED) -> dict[str, Any]:
    """Pairs of rows (at the same sweep value) whose paired 95 % interval of a metric's difference excludes 0.

    Returns ``{"pairs": number of pairs compared, "differ": [{a, b, metric, mean, half_width}, ...]}``
    with ``mean`` = a - b averaged over the replicates.
    """
    ok = [r for r in rows if "error" not in r and r.get("replicate_values")]
    groups: dict[Any, list[dict[str, Any]]] = {}
    for row in ok:
        groups.setdefault(row.get("sweep_value"), []).append(row)
    found: list[dict[str, Any]] = []
    pairs = 0
    for group in groups.values():
        for i, a in enumerate(group):
            for b in group[i + 1 :]:
                pairs += 1
                for key in metrics:
                    va, vb = a["replicate_values"].get(key), b["replicate_values"].get(key)
                    if not va or not vb or None in va or None in vb or len(va) != len(vb) or len(va) < 2:
                        continue
                    diff = paired_difference(va, vb)
                    if diff.excludes(0.0):
                        found.append(
                            {"a": a["name"], "b": b["name"], "metric": key, "mean": diff.mean,
                             "half_width": diff.half_width}
                        )  # fmt: skip
    return {"pairs": pairs, "differ": found}
