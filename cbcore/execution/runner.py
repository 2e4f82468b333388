"""ModelRunner: owns the model and the KV tensors, runs one packed forward per step."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Literal

import torch
from transformers import PreTrainedModel

from cbcore.config import KVCacheConfig
from cbcore.execution.attention import AttentionContext, check_model_supported, routed_to_cbcore
from cbcore.execution.backend import Backend
from cbcore.execution.batch import FlatBatch, build_flat_batch
from cbcore.execution.kv_cache import KVCache
from cbcore.kernels.native import hold_freed_memory
from cbcore.log import get_logger
from cbcore.models.fused_decoder import FusedDecoder, fused_refusal
from cbcore.models.packed_linear import LinearKind, resolve_kind
from cbcore.scheduling.plan import StepPlan

log = get_logger(__name__)

#: ``auto``: cbcore's fused forward where the model is of its family, else HF's modules.
ForwardKind = Literal["auto", "fused", "hf"]


@dataclass(frozen=True)
class KVGeometry:
    """The per-token KV shape a model needs."""

    num_layers: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, model: PreTrainedModel) -> KVGeometry:
        cfg = model.config.get_text_config()
        heads = cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        return cls(cfg.num_hidden_layers, kv_heads, head_dim)


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
        self._attn = AttentionContext(backend, self.kv_cache)
        why_freed = hold_freed_memory() if self.device.type == "cpu" else "not on the CPU"
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
            freed_memory="held" if why_freed is None else "returned", why_returned=why_freed,
        )  # fmt: skip
        log.info(
            "kv cache ready", backend=backend.name, variant=backend.variant, num_blocks=num_blocks,
            block_size=block_size, host_blocks=num_host_blocks, mib=round(self.kv_cache.nbytes / 2**20, 1),
        )  # fmt: skip

    def prepare(self, plan: StepPlan) -> FlatBatch:
        chunks = [(row.token_ids, row.start, row.block_table) for row in plan.rows]
        sample = [row.params is not None for row in plan.rows]
        return build_flat_batch(chunks, sample, self.kv_cache.block_size, self.device)

    @torch.inference_mode()
    def forward(self, batch: FlatBatch) -> torch.Tensor:
        """One forward over the packed row; logits ``[S, vocab]`` for the sampling rows only."""
        if self.fused is not None:
            return self.fused(batch, functools.partial(self._attn.attend, batch))
        with routed_to_cbcore(self.model):
            return self.model(
                input_ids=batch.input_ids.unsqueeze(0), position_ids=batch.positions.unsqueeze(0),
                use_cache=False, cb_batch=batch, cb_attn=self._attn, logits_to_keep=batch.logits_indices,
            ).logits[0]  # fmt: skip

    def swap(self, plan: StepPlan) -> None:
        """Apply the step's swap copies before anything overwrites the freed blocks."""
        self.kv_cache.copy_out(plan.swap_out)
        self.kv_cache.copy_in(plan.swap_in)
