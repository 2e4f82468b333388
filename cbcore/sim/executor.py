"""The engine with its forward replaced: a cost model advances a virtual clock.

:func:`sim_engine` builds the engine's own :class:`~cbcore.engine_core.EngineCore`
(scheduler and policies from the config, the real block manager, the shared
per-step bookkeeping) around a :class:`SimExecutor`. No token is computed:
each sampling row gets a filler token, and a request ends when it reaches its
``max_new_tokens`` (the trace's output length), as EOS is never produced.
"""

from __future__ import annotations

from typing import Any

from cbcore.bench.driver import VirtualClock
from cbcore.config import EngineConfig
from cbcore.engine_core import EngineCore
from cbcore.scheduling.plan import Sampled, StepPlan
from cbcore.scheduling.policy_scheduler import build_scheduler
from cbcore.sim.profile import Profile
from cbcore.sim.shape import StepShape

#: The token every simulated step emits (no request in a trace stops on it).
FILLER_TOKEN = 0


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


    def forward(self, shape: StepShape) -> None:
        cost = self.price(shape)
        self.busy_s += cost
        self.clock.advance(cost)

    def sample(self, shape: StepShape, forwarded: Any, rng_states: list) -> Sampled:
        n = shape.num_samples
        return Sampled(list(shape.sample_rows), [FILLER_TOKEN] * n, [None] * n)


def sim_num_blocks(config: EngineConfig, profile: Profile) -> int:
    """The engine's own sizing of its pool, for the profile's model and the device memory it states.

    A measured GPU profile states its KV capacity in tokens (the GPUs' memory less the weights);
    ``kv_cache.num_blocks`` or ``kv_cache.max_memory_mb`` in the config take precedence.
    """
    kv = config.kv_cache
    if kv.num_blocks is None and "max_memory_mb" not in kv.model_fields_set:
        if (tokens := profile.kv_capacity_tokens()) is not None:
            return max(1, tokens // kv.block_size)
        if (memory_mb := profile.kv_memory_mb()) is not None:
            kv = kv.model_copy(update={"max_memory_mb": memory_mb})
    import torch

    from cbcore.execution.runner import plan_num_blocks  # imports transformers: only when needed
    from cbcore.models.loading import KVGeometry

    m = profile.model
    geometry = KVGeometry(m.num_layers, m.num_kv_heads, m.head_dim)
    return plan_num_blocks(kv, geometry, getattr(torch, profile.identity.dtype))


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
