"""The engine with its forward replaced: a cost model advances a virtual clock.

:func:`sim_engine` builds the engine's own :class:`~cbcore.engine_core.EngineCore`
(scheduler and policies from the config, the real block manager, the shared
per-step bookkeeping) around a :class:`SimExecutor`. No token is computed:
each sampling row gets a filler token, and a request ends when it reaches its
``max_new_tokens`` (the trace's output length), as EOS is never produced.
"""

from __future__ import annotations

import math
from typing import Any

from cbcore.config import EngineConfig
from cbcore.engine_core import EngineCore
from cbcore.scheduling.plan import Sampled, StepPlan
from cbcore.scheduling.policy_scheduler import build_scheduler
from cbcore.sim.profile import Profile
from cbcore.sim.shape import StepShape

#: The token every simulated step emits (no request in a trace stops on it).
FILLER_TOKEN = 0


class VirtualClock:
    """Simulated seconds; only the executor (a step's cost) and the event loop move it."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        if not seconds >= 0:
            raise ValueError(f"the clock cannot go back or stall on a non-number: {seconds}")
        self.now += seconds

    def advance_to(self, when: float) -> None:
        self.now = max(self.now, when)


class SimExecutor:
    """Prices each step with the profile instead of running it."""

    def __init__(self, profile: Profile, clock: VirtualClock, block_size: int) -> None:
        self.profile = profile
        self.clock = clock
        self.block_size = block_size
        self.busy_s = 0.0
        self.price = profile.pricer(block_size)

    @property
    def extrapolated_steps(self) -> int:
        """Steps priced beyond the profile's measured tables (by its stated extrapolation rule)."""
        return self.price.extrapolated

    def prepare(self, plan: StepPlan) -> StepShape:
        return StepShape.of(plan)

    def batch_of(self, shape: StepShape) -> None:
        return None

    def forward(self, shape: StepShape) -> None:
        cost = self.price(shape)
        self.busy_s += cost
        self.clock.advance(cost)

    def sample(self, shape: StepShape, forwarded: Any, rng_states: list) -> Sampled:
        n = shape.num_samples
        return Sampled(list(shape.sample_rows), [FILLER_TOKEN] * n, [None] * n)


def sim_num_blocks(config: EngineConfig, profile: Profile) -> int:
    """As the engine sizes its pool, with the profile's device memory where it states one.

    A measured GPU profile states its KV capacity in tokens (the GPUs' memory less the weights);
    ``kv_cache.num_blocks`` or ``kv_cache.max_memory_mb`` in the config take precedence.
    """
    kv = config.kv_cache
    if kv.num_blocks is not None:
        return kv.num_blocks
    if "max_memory_mb" not in kv.model_fields_set:
        tokens = profile.kv_capacity_tokens()
        if tokens is not None:
            return max(1, tokens // kv.block_size)
    memory_mb = kv.max_memory_mb
    if "max_memory_mb" not in kv.model_fields_set and profile.kv_memory_mb() is not None:
        memory_mb = profile.kv_memory_mb()
    per_block = kv.block_size * profile.model.kv_bytes_per_token(profile.dtype_bytes)
    return max(1, math.floor(memory_mb * 2**20 / per_block))


def sim_engine(config: EngineConfig, profile: Profile, clock: VirtualClock | None = None) -> EngineCore:
    """An engine core for ``config`` whose steps cost what ``profile`` says, on ``clock``."""
    clock = clock if clock is not None else VirtualClock()
    scheduler, names = build_scheduler(config, sim_num_blocks(config, profile), clock)
    model = profile.model
    return EngineCore(
        config,
        SimExecutor(profile, clock, config.kv_cache.block_size),
        scheduler,
        vocab_size=model.vocab_size,
        max_model_len=config.model.max_model_len or model.max_position_embeddings,
        names=names,
        clock=clock,
        deltas=False,
    )
