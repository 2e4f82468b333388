"""`cb profile`: time real engine steps over a grid of step shapes and fit a step-time model.

The steps are the engine's own (scheduler, packing, forward, sampling and
bookkeeping), timed the one way cbcore times a step
(:func:`cbcore.bench.stepcost.timed_steps`), driven with request
groups chosen to cover the shapes a workload produces: decode batches of every
width in the grid at short and long contexts (attention work), whole and
chunked prefills of several sizes, and prefills joining running decodes
(mixed steps). The widths are dense where a CPU BLAS changes regime (1-4, 6,
8, 12, ...), since step cost is not monotone there.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

import torch

from cbcore.bench.stepcost import random_prompt, timed_steps
from cbcore.config import EngineConfig
from cbcore.engine import Engine
from cbcore.kernels.native import hardware_name
from cbcore.log import get_logger
from cbcore.scheduling.sampling_params import SamplingParams
from cbcore.sim.fitted import fit_cost
from cbcore.sim.model_shape import ModelShape
from cbcore.sim.profile import Identity, Profile
from cbcore.sim.shape import StepShape

log = get_logger(__name__)


@dataclass(frozen=True)
class Grid:
    widths: tuple[int, ...]  # decode batch widths
    group_tokens: int  # prompt tokens per decode group (long context = group_tokens // width)
    short_context: int
    prefills: tuple[int, ...]  # single-prompt prefill sizes
    mixed: tuple[tuple[int, int], ...]  # (decodes running, prompt joining)
    decode_steps: int
    chunk: int  # chunked-prefill chunk, and the largest prefill piece of one sequence

    @property
    def knots(self) -> list[int]:
        top = max(self.widths) + self.chunk * 2
        extra = [k for k in (16, 32, 64, 128, 256, 512, 1024, 2048, 4096) if k <= top]
        return sorted({*self.widths, *extra, top})


FULL = Grid(
    widths=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64),
    group_tokens=2048,
    short_context=16,
    prefills=(16, 32, 64, 128, 256, 512, 1024),
    mixed=((4, 64), (4, 512), (16, 128), (16, 512), (32, 256), (32, 512)),
    decode_steps=8,
    chunk=512,
)
QUICK = Grid(
    widths=(1, 2, 3, 4, 8, 16),
    group_tokens=256,
    short_context=8,
    prefills=(16, 64, 256),
    mixed=((4, 64), (8, 128)),
    decode_steps=4,
    chunk=128,
)


def profile_config(config: EngineConfig, grid: Grid) -> EngineConfig:
    """The user's config (backend, KV layout, model) with a budget wide enough for every grid shape, of the
    user's config class (a ``Settings`` keeps its application sections)."""
    data = config.model_dump()
    data["scheduler"] = {
        "queue": {"name": "fcfs"},
        "budget": {
            "name": "token-budget",
            "max_num_seqs": max(grid.widths) + 1,
            "max_num_batched_tokens": 4 * grid.chunk,
        },
        "prefill": {"name": "chunked-prefill", "chunk_size": grid.chunk},
        "preemption": {"name": "recompute"},
    }
    return type(config).model_validate(data)


def measure(
    engine: Engine, grid: Grid, seed: int = 0, progress: Callable[[str], None] | None = None
) -> tuple[list[StepShape], list[float]]:
    """Run the grid's request groups through ``engine``; every non-empty step's shape and seconds."""
    rng = random.Random(seed)

    def prompt(n: int) -> list[int]:
        return random_prompt(rng, engine.vocab_size, n)

    def params(n: int) -> SamplingParams:
        return SamplingParams(max_new_tokens=n, ignore_eos=True)

    def drain() -> None:
        while engine.has_unfinished():
            engine.step()

    engine.generate([prompt(8)], params(3))  # first-call costs, not recorded
    with timed_steps(engine) as steps:
        for width in grid.widths:
            for context in sorted({grid.short_context, max(grid.short_context, grid.group_tokens // width)}):
                if progress:
                    progress(f"decode width {width}, context {context}")
                for _ in range(width):
                    engine.add_request(prompt(context), params(grid.decode_steps + 1))
                drain()
        for size in grid.prefills:
            if progress:
                progress(f"prefill {size}")
            engine.add_request(prompt(size), params(1))
            drain()
        for decodes, joining in grid.mixed:
            if progress:
                progress(f"{decodes} decodes + prefill {joining}")
            for _ in range(decodes):
                engine.add_request(prompt(grid.short_context), params(grid.decode_steps + 4))
            engine.step()
            engine.step()
            engine.add_request(prompt(joining), params(2))
            drain()
    return [s.shape for s in steps], [s.stats.total_s for s in steps]


def make_profile(engine: Engine, model_name: str, grid: Grid = FULL, seed: int = 0, progress=None) -> Profile:
    """Measure ``engine`` on ``grid`` and fit; the profile names what it was measured on."""
    started = time.perf_counter()
    shapes, times = measure(engine, grid, seed, progress)
    cost = fit_cost(shapes, times, grid.knots)
    log.info(
        "profile fitted", steps=len(times), seconds=time.perf_counter() - started, **cost.fit.model_dump()
    )
    param = next(engine.model.parameters())
    identity = Identity(
        hardware=hardware_name(param.device),
        model=model_name,
        dtype=str(param.dtype).removeprefix("torch."),
        backend=engine.config.backend.name,
        backend_variant=engine.runner.backend.variant,
        threads=torch.get_num_threads(),
        source="measured",
        created=datetime.now(UTC).isoformat(timespec="seconds"),
        torch=torch.__version__,
        linear=engine.runner.linear,
        forward=engine.runner.model_forward,
    )
    return Profile(identity=identity, model=ModelShape.of(model_name, engine.model.config), cost=cost)
