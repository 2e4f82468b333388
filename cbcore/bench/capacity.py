"""Capacity search: the highest arrival rate at which a row still meets a service-level objective.

Capacity is searched, not read off a plot. For each row (and each replicate's
workload) the search runs the workload spec at a rate, checks the row against
the objective, and moves the rate: doubling (or halving) from ``start`` until
one rate meets the objective and another misses it, then bisecting between
them until the gap is at most ``tol`` of the lower rate. The capacity is the
highest rate that met the objective; the true threshold lies below the lowest
rate that missed it, within the tolerance. This assumes the objective, once
missed, stays missed at higher rates (true of latency objectives in a stable
engine; replicates show when noise breaks it).

Two objectives are built in (latencies in milliseconds, as ``--slo``):

* ``sarathi:tbt=MS[,delay=MS]`` -- Sarathi-Serve's (Agrawal et al., OSDI 2024):
  the P99 time between tokens (``itl_p99_s``: every gap between consecutive
  tokens of every request, preemption stalls included) at most ``tbt``, and
  the median scheduling delay (``queue_p50_s``: arrival to first scheduled)
  at most ``delay`` (2,000 ms by default).
* ``attainment:p=PCT,ttft=MS,tpot=MS`` -- at least ``p`` % of the requests
  (failed ones count as missing) meet both their TTFT and TPOT objectives.

Search keys, in the same spec: ``start`` (first rate; default the workload's
``rate=``, else 1), ``tol`` (relative, default 0.05), ``min_rate`` and
``max_rate`` (where the search gives up: the capacity is reported as below or
above them), ``max_runs`` (per search, default 24).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from cbcore.bench.metrics import SLO
from cbcore.bench.suite import BenchResult
from cbcore.bench.sweep import with_key
from cbcore.bench.workload import Workload, WorkloadError
from cbcore.cli.config_files import format_validation_error

#: Per objective: (row key, limit field, scale to the row's unit, label) of each bound it checks.
BOUNDS = {
    "sarathi": (("itl_p99_s", "tbt", 1e-3, "TBT p99"), ("queue_p50_s", "delay", 1e-3, "scheduling delay p50")),
    "attainment": (("slo_attainment", "p", 1e-2, "requests meeting TTFT and TPOT"),),
}


class Objective(BaseModel):
    """A parsed ``--capacity`` spec: the objective and how the search runs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["sarathi", "attainment"]
    tbt: float | None = Field(None, gt=0, description="sarathi: P99 time between tokens, ms.")
    delay: float = Field(2000.0, gt=0, description="sarathi: median scheduling delay, ms.")
    p: float | None = Field(None, gt=0, le=100, description="attainment: share of requests, %.")
    ttft: float | None = Field(None, gt=0, description="attainment: TTFT objective, ms.")
    tpot: float | None = Field(None, gt=0, description="attainment: TPOT objective, ms.")
    start: float | None = Field(None, gt=0, allow_inf_nan=False)
    tol: float = Field(0.05, gt=0, lt=1)
    min_rate: float = Field(1e-3, gt=0, allow_inf_nan=False)
    max_rate: float = Field(1e4, gt=0, allow_inf_nan=False)
    max_runs: int = Field(24, ge=2)

    @model_validator(mode="after")
    def _complete(self) -> Objective:
        if self.kind == "sarathi" and self.tbt is None:
            raise ValueError("sarathi needs tbt=MS (the P99 time-between-tokens objective)")
        if self.kind == "attainment" and (self.p is None or self.ttft is None or self.tpot is None):
            raise ValueError("attainment needs p=PCT, ttft=MS and tpot=MS")
        if self.min_rate >= self.max_rate:
            raise ValueError("min_rate must be below max_rate")
        return self

    @classmethod
    def parse(cls, text: str) -> Objective:
        kind, _, body = text.partition(":")
        data: dict[str, Any] = {"kind": kind.strip()}
        for item in filter(None, (p.strip() for p in body.split(","))):
            key, eq, value = item.partition("=")
            if not eq:
                raise WorkloadError(f"--capacity {text!r}: expected KEY=VALUE, got {item!r}")
            data[key.strip()] = value.strip()
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise WorkloadError(f"--capacity {text!r}: {format_validation_error(exc)}") from None

    def slo(self) -> SLO | None:
        """The per-request objectives the suite must score (attainment), else None."""
        if self.kind != "attainment":
            return None
        assert self.ttft is not None and self.tpot is not None
        return SLO(ttft=self.ttft / 1000, tpot=self.tpot / 1000)

    def describe(self) -> str:
        if self.kind == "sarathi":
            return f"P99 time between tokens <= {self.tbt:g} ms and median scheduling delay <= {self.delay:g} ms"
        return f">= {self.p:g} % of requests with TTFT <= {self.ttft:g} ms and TPOT <= {self.tpot:g} ms"

    def check(self, row: dict[str, Any]) -> tuple[bool, dict[str, Any]]:
        """Whether ``row`` meets the objective, and the values it was judged on."""
        measured: dict[str, Any] = {}
        ok = True
        for key, field, scale, _ in BOUNDS[self.kind]:
            value, limit = row.get(key), getattr(self, field) * scale
            measured[key] = value
            if self.kind == "attainment":
                ok &= value is not None and value >= limit
            else:
                ok &= value is not None and value <= limit
        for key in ("request_throughput", "failed", "keeps_up", "preemptions"):
            measured[key] = row.get(key)
        return ok, measured


def rate_spec(spec: str, rate: float) -> str:
    """``spec`` at ``rate`` requests per second (the ``rate=`` key replaced or added)."""
    return with_key(spec, "rate", f"{rate:.6g}")


def start_rate(spec: str, objective: Objective) -> float:
    if objective.start is not None:
        return objective.start
    from cbcore.bench.replicates import spec_value

    given = spec_value(spec, "rate")
    try:
        rate = float(given) if given is not None else 1.0
    except ValueError:
        rate = 1.0
    return rate if 0 < rate < math.inf else 1.0


def search(evaluate: Callable[[float], tuple[bool, dict[str, Any]]], objective: Objective, start: float) -> dict[str, Any]:
    """Bracket and bisect the rate at which ``evaluate`` stops meeting the objective.

    Returns ``capacity`` (the highest rate that met it; 0.0 when even
    ``min_rate`` missed), ``upper`` (the lowest rate that missed it; None when
    even ``max_rate`` met it), ``censored`` ("below min_rate" / "above
    max_rate" / None), ``tolerance`` and every ``visited`` point in order.
    """
    visited: list[dict[str, Any]] = []

    def probe(rate: float) -> bool:
        ok, measured = evaluate(rate)
        visited.append({"rate": rate, "meets": ok, **measured})
        return ok

    lo: float | None = None
    hi: float | None = None
    rate = min(max(start, objective.min_rate), objective.max_rate)
    censored = None
    while lo is None or hi is None:
        if len(visited) >= objective.max_runs:
            break
        if probe(rate):
            lo = rate
            if hi is None:
                if rate >= objective.max_rate:
                    censored = "above max_rate"
                    break
                rate = min(rate * 2, objective.max_rate)
        else:
            hi = rate
            if lo is None:
                if rate <= objective.min_rate:
                    censored = "below min_rate"
                    break
                rate = max(rate / 2, objective.min_rate)
    while lo is not None and hi is not None and hi - lo > objective.tol * lo and len(visited) < objective.max_runs:
        mid = (lo + hi) / 2
        if probe(mid):
            lo = mid
        else:
            hi = mid
    converged = lo is not None and hi is not None and hi - lo <= objective.tol * lo
    return {
        "capacity": lo if lo is not None else 0.0,
        "upper": hi,
        "censored": censored,
        "converged": converged or censored is not None,
        "tolerance": objective.tol,
        "visited": visited,
    }


Suite = Callable[[Workload, list[tuple[str, Any]]], BenchResult]


def search_row(
    suite: Suite, draw: Callable[[str], Workload], spec: str, config: tuple[str, Any], objective: Objective
) -> dict[str, Any]:
    """One row's search on one replicate's spec (a worker's task with ``--jobs``)."""
    last_error: list[str] = []

    def evaluate(rate: float) -> tuple[bool, dict[str, Any]]:
        result = suite(draw(rate_spec(spec, rate)), [config])
        row = result.rows[0]
        if "error" in row:
            last_error.append(row["error"])
            raise _RowFailed(row["error"])
        return objective.check(row)

    try:
        found = search(evaluate, objective, start_rate(spec, objective))
    except _RowFailed as exc:
        return {"error": str(exc)}
    return {**found, "spec": spec}


class _RowFailed(Exception):
    pass


def summarize_search(name: str, kind: str, searches: Seq[dict[str, Any]], objective: Objective) -> dict[str, Any]:
    """A row of the capacity table: capacity mean and interval over replicates, and every search."""
    from cbcore.bench.stats import mean_interval

    failed = [s for s in searches if "error" in s]
    if failed:
        return {"name": name, "kind": kind, "error": failed[0]["error"]}
    values = [s["capacity"] for s in searches]
    interval = mean_interval(values)
    at = []
    for s in searches:
        met = [v for v in s["visited"] if v["meets"] and v["rate"] == s["capacity"]]
        at.append(met[-1] if met else {})
    row: dict[str, Any] = {
        "name": name,
        "kind": kind,
        "objective": objective.describe(),
        "capacity_req_s": interval.mean,
        "ci95": {"capacity_req_s": interval.half_width},
        "replicate_values": {"capacity_req_s": values},
        "tolerance": objective.tol,
        "censored": sorted({s["censored"] for s in searches if s["censored"]}),
        "converged": all(s["converged"] for s in searches),
        "runs": sum(len(s["visited"]) for s in searches),
        "searches": list(searches),
    }
    for key, _, _, _ in BOUNDS[objective.kind]:
        present = [a[key] for a in at if a.get(key) is not None]
        row[f"{key}_at_capacity"] = sum(present) / len(present) if present else None
    row["failed_at_capacity"] = sum(a.get("failed") or 0 for a in at) / len(at) if at else None
    return row


def run_capacity(
    specs: Seq[str],
    configs: Seq[tuple[str, Any]],
    suite: Suite,
    draw: Callable[[str], Workload],
    objectives: Seq[Objective],
    *,
    kind: str,
    jobs: int = 1,
) -> BenchResult:
    """Every row's search under every objective on every replicate's spec; one capacity row per
    (objective, configuration), grouped by objective.

    With ``jobs`` > 1 the searches run in worker processes, each search's runs
    one after another; ``suite`` and ``draw`` must pickle.
    """
    tasks = [(k, j, i) for k in range(len(objectives)) for j in range(len(configs)) for i in range(len(specs))]

    def task(k: int, j: int, i: int) -> tuple[Any, ...]:
        return (suite, draw, specs[i], configs[j], objectives[k])

    if jobs > 1 and len(tasks) > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        spawn = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=min(jobs, len(tasks)), mp_context=spawn) as pool:
            futures = {t: pool.submit(search_row, *task(*t)) for t in tasks}
            found = {t: f.result() for t, f in futures.items()}
    else:
        found = {t: search_row(*task(*t)) for t in tasks}
    rows = []
    for k, objective in enumerate(objectives):
        for j, (name, _) in enumerate(configs):
            row = summarize_search(name, kind, [found[(k, j, i)] for i in range(len(specs))], objective)
            rows.append({**row, "objective_index": k})
    workload = {
        "name": specs[0],
        "num_requests": None,
        "arrival_span_s": None,
        "capacity": {
            "objectives": [o.describe() for o in objectives],
            "specs_objective": [o.model_dump(exclude_defaults=True) for o in objectives],
            "tolerances": [o.tol for o in objectives],
            "replicates": len(specs),
            "specs": list(specs),
        },
    }
    return BenchResult(workload=workload, rows=rows)
