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
from cbcore.sim.executor import VirtualClock, sim_engine
from cbcore.sim.loop import Replica, simulate_run
from cbcore.sim.profile import Profile


def simulate_suite(
    profile: Profile,
    workload: Workload,
    token_ids: Seq[Seq[int]],
    configs: Seq[tuple[str, EngineConfig]],
    *,
    slo: SLO | None = None,
    progress: ProgressFactory = no_progress,
) -> BenchResult:
    """Every configuration on ``workload``, each on a fresh engine and clock; one row each."""
    names = [n for n, _ in configs]
    if len(set(names)) != len(names):
        raise ValueError(f"two rows share a name: {names}")
    rows = []
    samples = {}
    for name, config in configs:
        clock = VirtualClock()
        engine = sim_engine(config, profile, clock)
        run = simulate_run([Replica(engine, clock)], name, workload, token_ids, progress=progress)
        run.info = {
            "scheduler": config.scheduler.model_dump(exclude_defaults=True) or "default",
            "max_num_seqs": budget_limit(config, "max_num_seqs"),
            "kv_blocks": engine.scheduler.blocks.num_blocks,
        }
        rows.append(summarize_runs(None, workload, [run], None, slo))
        samples[name] = latency_samples(run.outputs)
    described: dict[str, Any] = {**workload.describe(), "profile": profile.describe()}
    return BenchResult(workload=described, rows=rows, samples=samples)
