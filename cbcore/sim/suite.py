"""`cb simulate`'s rows: each configuration as simulated engines, in the benchmark's own suite.

A row is one configuration on fresh engines and virtual clocks, driven by the
benchmark's driver and summarised by its suite (:func:`cbcore.bench.suite.run_rows`),
so a ``cb simulate`` table reads like a ``cb bench`` table of the same
workload and can be put beside it line by line.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from functools import partial
from typing import Any

from cbcore.bench.driver import ProgressFactory, RunResult, VirtualClock, drive, no_progress
from cbcore.bench.metrics import SLO
from cbcore.bench.suite import BenchResult, Row, budget_limit, prompt_token_ids, run_rows
from cbcore.bench.workload import Workload, WorkloadError
from cbcore.config import EngineConfig
from cbcore.plugins import get_registry
from cbcore.scale.router import engine_load
from cbcore.serve.config import Settings
from cbcore.sim.executor import sim_engine
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
    ``load_interval_s`` of virtual time; the configurations are then
    :class:`~cbcore.serve.config.Settings`, which hold the router.
    """
    if replicas < 1:
        raise ValueError(f"replicas must be at least 1, got {replicas}")
    if replicas > 1 and (plain := [name for name, config in configs if not isinstance(config, Settings)]):
        raise TypeError(
            f"replicas={replicas}: rows {plain} have no router (an EngineConfig holds none); "
            "build their configs as cbcore.serve.config.Settings"
        )
    if workload.is_closed_loop:
        raise WorkloadError(
            f"workload {workload.name!r} is closed-loop (requests follow others' answers); "
            "the simulator replays open-loop workloads only"
        )
    simulate = partial(_simulate, profile, workload, token_ids, progress, replicas, load_interval_s)
    rows = [Row(name, "simulated", partial(simulate, name, config)) for name, config in configs]
    result = run_rows(workload, rows, slo=slo)
    result.workload["profile"] = profile.describe()
    return result


def simulate_workload(
    profile: Profile,
    workload: Workload,
    configs: Seq[tuple[str, EngineConfig]],
    tokenizer: Any | None = None,
    **options: Any,
) -> BenchResult:
    """:func:`simulate_suite` with the prompts' token ids (text ones by ``tokenizer``): `cb simulate`'s
    suite, also in the worker process of a sweep's point."""
    prompts = prompt_token_ids(workload, tokenizer, lazy=True)
    return simulate_suite(profile, workload, prompts, configs, **options)


def _simulate(
    profile: Profile,
    workload: Workload,
    token_ids: Seq[Seq[int]],
    progress: ProgressFactory,
    replicas: int,
    load_interval_s: float,
    name: str,
    config: EngineConfig,
) -> RunResult:
    engines = [sim_engine(config, profile, VirtualClock()) for _ in range(replicas)]
    placement = None
    if replicas > 1:
        assert isinstance(config, Settings)  # simulate_suite checked every row
        registry = get_registry(tuple(config.plugins))
        router = registry.create("router", config.router.name, config.router.params, "router")
        placement = RouterPlacement(router, replicas, load_interval_s)
    run = drive(engines, name, workload, token_ids, placement=placement, progress=progress)
    run.info = {
        "scheduler": config.scheduler.model_dump(exclude_defaults=True) or "default",
        "max_num_seqs": budget_limit(config, "max_num_seqs"),
        "kv_blocks": engine_load(engines[0]).kv_blocks_total,
        "extrapolated_steps": (wide := sum(e.executor.extrapolated_steps for e in engines)),
    }
    if wide:
        run.info["notes"] = [
            f"{wide} of {len(run.steps)} steps were wider than the profile's measured tables "
            f"({profile.describe().get('exact_up_to_tokens')} tokens) and were priced in proportion to their tokens"
        ]
    if placement is not None:
        run.info |= {
            "replicas": replicas,
            "router": config.router.model_dump(),
            "placed_min_max": [min(placement.placed), max(placement.placed)],
        }
    return run
