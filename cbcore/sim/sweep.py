"""Simulated load sweeps, optionally in parallel processes.

Each (value, configuration) pair is an independent simulation on its own
virtual clock, so the points may run in any order and in separate processes
(``--jobs N``) and still give exactly the rows a serial run gives. A worker
draws its workload again from the point's spec (the generator is
deterministic), which costs less than shipping thousands of requests.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Sequence as Seq
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from cbcore.bench.driver import ProgressFactory, no_progress
from cbcore.bench.metrics import SLO
from cbcore.bench.sources import load_workload
from cbcore.bench.suite import BenchResult
from cbcore.bench.sweep import Point, Sweep, merge
from cbcore.bench.workload import Workload
from cbcore.config import EngineConfig
from cbcore.log import get_logger
from cbcore.sim.profile import Profile
from cbcore.sim.suite import simulate_suite

log = get_logger(__name__)


@dataclass(frozen=True)
class SimOptions:
    """What every simulated point shares besides its workload and configuration."""

    slo: SLO | None = None
    replicas: int = 1
    load_interval_s: float = 0.5


def simulate_sweep(
    profile: Profile,
    sweep: Sweep,
    points: Seq[Point],
    configs: Seq[tuple[str, EngineConfig]],
    options: SimOptions,
    *,
    jobs: int = 1,
    progress: ProgressFactory = no_progress,
) -> BenchResult:
    """Every configuration at every point; with ``jobs`` > 1, that many worker processes."""
    if jobs < 1:
        raise ValueError(f"jobs must be at least 1, got {jobs}")
    if jobs == 1:
        results = [_simulate(profile, p.workload, configs, options, progress) for p in points]
        return merge(sweep, points, results)
    tasks = [(i, j) for i in range(len(points)) for j in range(len(configs))]
    log.info("simulating sweep points in parallel", points=len(tasks), jobs=jobs)
    # spawn: a fresh interpreter per worker, so no lock or thread pool of this process is inherited half-held.
    with ProcessPoolExecutor(max_workers=min(jobs, len(tasks)), mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {
            (i, j): pool.submit(_simulate_spec, profile, points[i].spec, configs[j], options) for i, j in tasks
        }
        parts = {key: f.result() for key, f in futures.items()}
    results = []
    for i in range(len(points)):
        per_config = [parts[(i, j)] for j in range(len(configs))]
        results.append(
            BenchResult(
                workload=per_config[0].workload,
                rows=[r for part in per_config for r in part.rows],
                samples={k: v for part in per_config for k, v in part.samples.items()},
            )
        )
    return merge(sweep, points, results)


def _simulate(
    profile: Profile,
    workload: Workload,
    configs: Seq[tuple[str, EngineConfig]],
    options: SimOptions,
    progress: ProgressFactory = no_progress,
) -> BenchResult:
    ids = [list(r.prompt_token_ids or ()) for r in workload.requests]
    return simulate_suite(
        profile,
        workload,
        ids,
        configs,
        slo=options.slo,
        progress=progress,
        replicas=options.replicas,
        load_interval_s=options.load_interval_s,
    )


def _simulate_spec(
    profile: Profile, spec: str, config: tuple[str, EngineConfig], options: SimOptions
) -> BenchResult:
    """A worker's task: one configuration on the workload drawn from ``spec``."""
    return _simulate(profile, load_workload(spec, profile.model.vocab_size), [config], options)
