"""ModelRunner: owns the model and the KV tensors, runs each step's plan: swaps, packing, one forward, sampling.

It is the engine's executor (:class:`cbcore.engine_core.Executor`): it gets the
step's plan and gives back one token per sampling row, nothing else.
"""

from __future__ import annotations

import functools
import math
from typing import Literal

import torch
from transformers import PreTrainedModel

from cbcore.config import KVCacheConfig
from cbcore.execution.attention import check_model_supported, routed_to_cbcore
from cbcore.execution.backend import Backend
from cbcore.execution.batch import FlatBatch, build_flat_batch
from cbcore.execution.kv_cache import KVCache
from cbcore.execution.sampler import sample_each
from cbcore.log import get_logger
from cbcore.models.fused_decoder import FusedDecoder, fused_refusal
from cbcore.models.loading import KVGeometry
from cbcore.models.packed_linear import LinearKind, resolve_kind
from cbcore.scheduling.plan import Sampled, StepPlan

log = get_logger(__name__)

#: ``auto``: cbcore's fused forward where the model is of its family, else HF's modules.
ForwardKind = Literal["auto", "fused", "hf"]


def plan_num_blocks(cfg: KVCacheConfig, geometry: KVGeometry, dtype: torch.dtype) -> int:
    if cfg.num_blocks is not None:
        return cfg.num_blocks
    per_block = 2 * geometry.num_layers * cfg.block_size * geometry.num_kv_heads * geometry.head_dim
    return max(1, math.floor(cfg.max_memory_mb * 2**20 / (per_block * dtype.itemsize)))


class ModelRunner:
    def __init__(
        self, model: PreTrainedModel, backend: Backend, block_size: int, num_blocks: int,
        num_host_blocks: int = 0, linear: LinearKind = "auto", forward: ForwardKind = "auto",
    ) -> None:  # fmt: skip
        check_model_supported(model)
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.backend = backend
        backend.check(self.device, block_size, self.dtype)
        g = self.geometry = KVGeometry.of(model)
        self.kv_cache = KVCache(
            g.num_layers, num_blocks, block_size, g.num_kv_heads, g.head_dim, self.dtype, self.device, num_host_blocks
        )
        why_hf = fused_refusal(model) if forward != "hf" else "asked for"
        if why_hf is not None and (forward == "fused" or linear == "onednn"):
            what = "forward 'fused'" if forward == "fused" else "linear 'onednn' (it multiplies in the fused forward)"
            raise ValueError(f"execution.{what} cannot run this model: {why_hf}")
        self.linear, why_standard = resolve_kind(linear, model.lm_head.weight) if why_hf is None else ("standard", None)
        self.fused = FusedDecoder(model, self.linear == "onednn") if why_hf is None else None
        self.model_forward: Literal["fused", "hf"] = "hf" if self.fused is None else "fused"
        log.info(
            "model forward", forward=self.model_forward, why_hf=why_hf if forward == "auto" else None,
            linear=self.linear, why_standard=why_standard, warmed_products=getattr(self.fused, "warmed", 0),
            warm_s=round(getattr(self.fused, "warm_s", 0.0), 2),
        )  # fmt: skip
        log.info(
            "kv cache ready", backend=backend.name, variant=backend.variant, num_blocks=num_blocks,
            block_size=block_size, host_blocks=num_host_blocks, mib=round(self.kv_cache.nbytes / 2**20, 1),
        )  # fmt: skip

    def prepare(self, plan: StepPlan) -> FlatBatch:
        """The step's swap copies first (before anything overwrites the freed blocks), then its packed batch."""
        if plan.swap_out or plan.swap_in:
            self.kv_cache.copy_out(plan.swap_out)
            self.kv_cache.copy_in(plan.swap_in)
        chunks = [(row.token_ids, row.start, row.block_table) for row in plan.rows]
        sample = [row.params is not None for row in plan.rows]
        batch = build_flat_batch(chunks, sample, self.kv_cache.block_size, self.device)
        batch.sampling = [plan.rows[i] for i in batch.sample_rows]
        return batch

    @torch.inference_mode()
    def forward(self, batch: FlatBatch) -> torch.Tensor:
        """One forward over the packed row; logits ``[S, vocab]`` for the sampling rows only."""
        if self.fused is not None:
            logits = self.fused(batch, functools.partial(self.attend, batch))
        else:
            with routed_to_cbcore(self.model):
                logits = self.model(
                    input_ids=batch.input_ids.unsqueeze(0), position_ids=batch.positions.unsqueeze(0),
                    use_cache=False, cb_batch=batch, cb_attn=self, logits_to_keep=batch.logits_indices,
                ).logits[0]  # fmt: skip
        if logits.device.type == "cuda":
            torch.cuda.synchronize()  # so that the step's forward time is the forward's
        return logits

    def attend(
        self, batch: FlatBatch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
        window: int | None, scaling: float,
    ) -> torch.Tensor:  # fmt: skip
        """Store ``layer``'s keys and values of this step in the pool (once), then attend; ``[T, heads, D]``."""
        self.kv_cache.write(layer, batch.slot_mapping, k, v)
        return self.backend.forward(q, k, v, layer, batch, self.kv_cache, scaling, window)

    def sample(self, batch: FlatBatch, logits: torch.Tensor, rng_states: list) -> Sampled:
        tokens, top, errors = sample_each(logits, batch.sampling, rng_states)
        return Sampled(list(batch.sample_rows), list(tokens), list(top), errors)
