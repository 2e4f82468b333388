"""One workload through several configurations, simulated; the result is the benchmark's.

Rows, metrics and reports are :mod:`cbcore.bench`'s own, so a ``cb simulate``
table reads like a ``cb bench`` table of the same workload and can be put
beside it line by line.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

from cbcore.bench.driver import ProgressFactory, no_progress
from cbcore.bench.metrics import SLO, latency_samples
from cbcore.bench.suite import BenchResult, budget_limit, summarize_runs
from cbcore.bench.workload import Workload
from cbcore.config import EngineConfig
from cbcore.plugins import get_registry
from cbcore.sim.executor import VirtualClock, sim_engine
from cbcore.sim.loop import Replica, simulate_run
from cbcore.sim.profile import Profile
from cbcore.sim.routing import RouterPlacement


def simulate_suite(
    profile: Profile,
    workload: Workload,
    token_ids: Seq[Seq[int]],
    configs: Seq[tuple[str, EngineConfig]],
    *,
    slo: SLO | None = None,
    progress: ProgressFactory = no_progress,
    replicas: int = 1,
    load_interval_s: float = 0.5,
) -> BenchResult:
    """Every configuration on ``workload``, each on fresh engines and clocks; one row each.

    With ``replicas`` > 1, each row is that many engines of its configuration
    behind its ``router`` plugin, which reads their load every
    ``load_interval_s`` of virtual time.
    """
    if replicas < 1:
        raise ValueError(f"replicas must be at least 1, got {replicas}")
    names = [n for n, _ in configs]
    if len(set(names)) != len(names):
        raise ValueError(f"two rows share a name: {names}")
    rows = []
    samples = {}
    for name, config in configs:
        engines = []
        for _ in range(replicas):
            clock = VirtualClock()
            engines.append(Replica(sim_engine(config, profile, clock), clock))
        placement = None
        if replicas > 1:
            placement = RouterPlacement(
                get_registry(tuple(config.plugins)).create(
                    "router", config.router.name, config.router.params, "router"
                ),
                replicas,
                {r.request_id: ids for r, ids in zip(workload.requests, token_ids, strict=True)},
                load_interval_s,
            )
        run = simulate_run(engines, name, workload, token_ids, placement=placement, progress=progress)
        run.info = {
            "scheduler": config.scheduler.model_dump(exclude_defaults=True) or "default",
            "max_num_seqs": budget_limit(config, "max_num_seqs"),
            "kv_blocks": engines[0].engine.load().kv_blocks_total,
            "extrapolated_steps": sum(r.engine.executor.extrapolated_steps for r in engines),
        }
        if placement is not None:
            run.info |= {
                "replicas": replicas,
                "router": config.router.model_dump(),
                "placed_min_max": [min(placement.placed), max(placement.placed)],
            }
        rows.append(summarize_runs(None, workload, [run], None, slo))
        samples[name] = latency_samples(run.outputs)
    described: dict[str, Any] = {**workload.describe(), "profile": profile.describe()}
    return BenchResult(workload=described, rows=rows, samples=samples)
