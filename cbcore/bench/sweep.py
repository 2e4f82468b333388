"""Load sweeps: one workload key over several values, every configuration at every value.

``--sweep rate=2,3,4,5`` turns one generator or trace spec into one spec per
value (the key replaced, or added when the spec did not name it); each point runs every
configuration as an ordinary benchmark or simulation (``--jobs N`` runs
simulated points in N processes), and the rows of all points make one
:class:`~cbcore.bench.suite.BenchResult`. Each row records its
configuration, the swept key and value, and whether the engine kept up with
the arrivals (:mod:`cbcore.bench.saturation`): a policy's finding is usually
where that stops (past capacity), and what each policy does to its deadlines
there.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from collections.abc import Sequence as Seq
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from cbcore.bench.generator import GENERATORS, GeneratorSpec, parse_spec
from cbcore.bench.suite import BenchResult
from cbcore.bench.traces import NAMED_TRACES, TRACE_KEYS, is_trace, parse_trace_spec
from cbcore.bench.workload import Workload, WorkloadError
from cbcore.cli.config_files import format_validation_error
from cbcore.config import EngineConfig
from cbcore.log import get_logger

log = get_logger(__name__)


class Sweep(BaseModel):
    """``KEY=V1,V2,...``: a generator or trace key and the values it takes, in order."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    key: str = Field(min_length=1)
    values: tuple[str, ...] = Field(min_length=1)

    @field_validator("key")
    @classmethod
    def _known_key(cls, key: str) -> str:
        from cbcore.plugins import did_you_mean

        known = sorted({*GeneratorSpec.model_fields, *TRACE_KEYS} - {"path"})
        if key not in known:
            raise ValueError(f"unknown workload key {key!r}{did_you_mean(key, known)}; known: {', '.join(known)}")
        return key

    @field_validator("values")
    @classmethod
    def _distinct(cls, values: tuple[str, ...]) -> tuple[str, ...]:
        if any(not v for v in values):
            raise ValueError("empty value in the list")
        if len(set(values)) != len(values):
            raise ValueError(f"a value appears twice: {', '.join(values)}")
        return values

    @classmethod
    def parse(cls, text: str) -> Sweep:
        key, sep, values = text.partition("=")
        if not sep:
            raise WorkloadError(f"--sweep {text!r}: expected KEY=V1,V2,... (e.g. rate=2,3,4,5)")
        try:
            return cls(key=key.strip(), values=tuple(v.strip() for v in values.split(",")))
        except ValidationError as exc:
            raise WorkloadError(f"--sweep {text!r}: {format_validation_error(exc)}") from None

    def points(self, spec: str) -> list[str]:
        """The workload spec at every value; each is validated now, before anything runs."""
        if is_trace(spec):
            if self.key not in TRACE_KEYS or self.key == "path":
                raise WorkloadError(f"--sweep {self.key}: not a key of a trace workload; known: {', '.join(TRACE_KEYS[1:])}")
            points = [with_key(spec, self.key, value) for value in self.values]
            for point in points:
                parse_trace_spec(point)
            return points
        if spec.split(":", 1)[0] not in GENERATORS:
            raise WorkloadError(
                f"--sweep needs a generator or trace workload ({', '.join(f'{g}:...' for g in GENERATORS)}, "
                f"trace:path=FILE,..., {', '.join(NAMED_TRACES)}), got {spec!r}: a file or 'seed' has no keys to vary"
            )
        if self.key not in GeneratorSpec.model_fields:
            raise WorkloadError(f"--sweep {self.key}: not a key of a generator workload; known: {', '.join(GeneratorSpec.model_fields)}")
        points = [with_key(spec, self.key, value) for value in self.values]
        for point in points:
            parse_spec(point)
        return points


def with_key(spec: str, key: str, value: str) -> str:
    """``spec`` with ``key=value`` in place of its own value of ``key`` (appended when absent)."""
    kind, _, body = spec.partition(":")
    items = [p.strip() for p in body.split(",") if p.strip()]
    replaced = [f"{key}={value}" if p.partition("=")[0].strip() == key else p for p in items]
    if not any(p.partition("=")[0].strip() == key for p in items):
        replaced.append(f"{key}={value}")
    return f"{kind}:{','.join(replaced)}"


def sweep_value(text: str) -> float | str:
    """A number when the value reads as one (the plots' x axis), else the text."""
    try:
        return float(text)
    except ValueError:
        return text


def offered_rate(workload: Workload) -> float | None:
    """Requests per second the workload sends (None when all arrive at once)."""
    span = workload.span_s
    return len(workload) / span if span > 0 else None


@dataclass(frozen=True)
class Point:
    """One value of the sweep: its spec and the workload drawn from it."""

    value: str
    spec: str
    workload: Workload


def draw_points(sweep: Sweep, spec: str, draw: Callable[[str], Workload]) -> list[Point]:
    """Every value's workload, drawn by ``draw`` as ``--workload`` would draw it (same seed: same prompts)."""
    specs = sweep.points(spec)
    return [Point(value, point, draw(point)) for value, point in zip(sweep.values, specs, strict=True)]


def annotate(row: dict[str, Any], sweep: Sweep, point: Point) -> dict[str, Any]:
    """A row of one point, renamed ``NAME KEY=VALUE`` and carrying what the sweep plots read."""
    new = {
        **row,
        "name": f"{row['name']} {sweep.key}={point.value}",
        "config": row["name"],
        "sweep_key": sweep.key,
        "sweep_value": sweep_value(point.value),
        "workload": point.spec,
    }
    if point.workload.trace is not None:  # a swept max_input or window changes what the length rule did
        rule = point.workload.trace["length_rule"]
        new["trace_dropped"], new["trace_clipped"] = rule["dropped"], rule["clipped"]
    if "error" in row:
        return new
    new["offered_request_rate"] = offered_rate(point.workload)
    return new


Configs = Seq[tuple[str, EngineConfig]]


def run_sweep(
    sweep: Sweep,
    points: Seq[Point],
    configs: Configs,
    run: Callable[[Workload, Configs], BenchResult],
    *,
    jobs: int = 1,
    draw: Callable[[str], Workload] | None = None,
) -> BenchResult:
    """Every configuration at every point through ``run``; the rows of all points in one result."""
    specs = [p.spec for p in points]
    return merge(sweep, points, run_specs(specs, configs, run, jobs=jobs, draw=draw, workloads=[p.workload for p in points]))


def run_specs(
    specs: Seq[str],
    configs: Configs,
    run: Callable[[Workload, Configs], BenchResult],
    *,
    jobs: int = 1,
    draw: Callable[[str], Workload] | None = None,
    workloads: Seq[Workload | None] | None = None,
) -> list[BenchResult]:
    """Every configuration on the workload of every spec; one result per spec, its rows in configuration order.

    ``workloads`` (when given) are the specs' workloads already drawn; the
    others are drawn with ``draw``. With ``jobs`` > 1 each (spec,
    configuration) pair runs in a worker process (simulated rows: each is
    independent, on its own virtual clock, so the rows are exactly a serial
    run's). A worker draws its workload again from its spec with ``draw`` (the
    generator is deterministic), which costs less than shipping thousands of
    requests; ``run`` and ``draw`` must pickle.
    """
    if jobs < 1:
        raise ValueError(f"jobs must be at least 1, got {jobs}")
    given = list(workloads) if workloads is not None else [None] * len(specs)
    if jobs == 1 or len(specs) * len(configs) == 1:
        results = []
        for spec, workload in zip(specs, given, strict=True):
            if workload is None:
                if draw is None:
                    raise ValueError(f"no workload and no draw for {spec!r}")
                workload = draw(spec)
            results.append(run(workload, configs))
        return results
    if draw is None:
        raise ValueError("runs in worker processes need draw, to draw their workloads there")
    tasks = [(i, j) for i in range(len(specs)) for j in range(len(configs))]
    log.info("running in parallel", tasks=len(tasks), jobs=jobs)
    # spawn: a fresh interpreter per worker, so no lock or thread pool of this process is inherited half-held.
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=min(jobs, len(tasks)), mp_context=spawn) as pool:
        futures = {(i, j): pool.submit(_run_one, run, draw, specs[i], configs[j]) for i, j in tasks}
        parts = {key: f.result() for key, f in futures.items()}
    results = []
    for i in range(len(specs)):
        per_config = [parts[(i, j)] for j in range(len(configs))]
        rows = [r for part in per_config for r in part.rows]
        samples = {k: v for part in per_config for k, v in part.samples.items()}
        results.append(BenchResult(workload=per_config[0].workload, rows=rows, samples=samples))
    return results


def _run_one(
    run: Callable[[Workload, Configs], BenchResult],
    draw: Callable[[str], Workload],
    spec: str,
    config: tuple[str, EngineConfig],
) -> BenchResult:
    """A worker's task: one configuration on the workload drawn from ``spec``."""
    return run(draw(spec), [config])


def merge(sweep: Sweep, points: Seq[Point], results: Seq[BenchResult]) -> BenchResult:
    """One result: per point (in sweep order) its rows, annotated; samples under the rows' new names."""
    rows: list[dict[str, Any]] = []
    samples: dict[str, dict[str, list[float]]] = {}
    for point, result in zip(points, results, strict=True):
        for row in result.rows:
            new = annotate(row, sweep, point)
            rows.append(new)
            if row["name"] in result.samples:
                samples[new["name"]] = result.samples[row["name"]]
    first = results[0].workload
    kind, _, body = points[0].spec.partition(":")
    rest = [p for p in body.split(",") if p.partition("=")[0].strip() != sweep.key]
    workload = {
        **first,
        "name": f"{kind}:{','.join(rest)} at {sweep.key}={'/'.join(sweep.values)}",
        "num_requests": max(len(p.workload) for p in points),
        "arrival_span_s": max(p.workload.span_s for p in points),
        "sweep": {"key": sweep.key, "values": [sweep_value(v) for v in sweep.values],
                  "specs": [p.spec for p in points]},
    }  # fmt: skip
    return BenchResult(workload=workload, rows=rows, samples=samples)


def by_config(rows: Seq[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Rows grouped per configuration, each in sweep order (failed points left out)."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        if "error" not in row:
            groups.setdefault(row["config"], []).append(row)
    return groups
