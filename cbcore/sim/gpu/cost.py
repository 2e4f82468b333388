"""A step's time on a GPU from the measured operator tables, and the KV cache that GPU has room for.

Per step, with ``T`` tokens, ``L`` layers and tensor-parallel degree ``tp``:

* **measured**: ``emb(T) + L * (sum of the layer's operators at T + 2 * all_reduce(T * hidden * 2 bytes))``
  (two all-reduces per layer at TP > 1, after attention and after the MLP, as Megatron-style tensor
  parallelism and Vidur have them; none at TP 1);
* **LM head** for the rows that sample: the measured MLP up-projection at that many rows, scaled by
  the ratio of the two matrices' sizes (``vocab`` against the up-projection's width): the same
  GEMM family at the same row count, an assumption since the tables do not time the head;
* **attention: roofline, not validated** (the tables have no attention timings): per layer the larger
  of the query-key products at half the GPU's dense FP16 peak and the K/V bytes read at the bandwidth
  the tables' memory-bound kernels reach (:mod:`.catalog`), as :func:`~cbcore.sim.roofline.attention_coefficients`;
* swaps over the host link; no CPU overhead (scheduling, sampling, input preparation: Vidur's own
  default leaves them out too, and its CPU-overhead tables are not published).

Every table entry is precomputed per token count when the profile is built, so pricing a step is a
list lookup and a few multiplications. Steps wider than the tables (4,096 tokens; 32,768 for
Llama-3), or whose all-reduce message is larger than the network table's largest (64 MiB on the
DGX tables), are extrapolated in proportion (:mod:`.tables`) and counted: each simulated row
reports ``extrapolated_steps``.
"""

from __future__ import annotations

import functools
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from cbcore.sim.gpu import catalog, tables
from cbcore.sim.roofline import Hardware, attention_coefficients
from cbcore.sim.shape import StepShape

ATTN_FLOPS_EFFICIENCY = 0.5  # the share of dense peak the roofline gives attention (assumption)


class StepPricer:
    """Prices steps of one profile; counts the steps priced beyond the measured tables."""

    __slots__ = (
        "arrays",
        "base",
        "extrapolated",
        "head",
        "limit",
        "per_key",
        "per_pair",
        "per_query",
        "per_swap_block",
        "top",
    )  # fmt: skip

    def __init__(self, arrays: _Arrays, block_size: int) -> None:
        self.arrays = arrays
        self.base, self.head, self.limit, self.top = arrays.base, arrays.head, arrays.limit, arrays.top
        self.per_pair, self.per_key, self.per_query = arrays.attention
        self.per_swap_block = block_size * arrays.swap_per_token
        self.extrapolated = 0

    def __call__(self, shape: StepShape) -> float:
        t = shape.prefill_tokens + shape.decode_tokens
        if t > self.limit:
            self.extrapolated += 1
            base = self.base[t] if t <= self.top else self.arrays.beyond(t)
        else:
            base = self.base[t]
        n = len(shape.sample_rows)
        head = self.head[n] if n <= self.top else self.head[self.top] * n / self.top
        compute = shape.attn_pairs * self.per_pair
        memory = shape.kv_tokens * self.per_key + t * self.per_query
        return base + (compute if compute > memory else memory) + head + shape.swap_blocks * self.per_swap_block


class _Arrays:
    """Everything a pricer reads, computed once per profile from the tables (seconds)."""

    def __init__(self, spec: catalog.Spec, attn_flops_efficiency: float) -> None:
        model = catalog.MODELS[spec.model].shape
        layers, hidden = model.num_layers, model.hidden_size
        curves = tables.operator_curves(spec.gpu, spec.model, spec.tp)
        self.top = top = int(curves["emb"].top)
        tokens = np.arange(top + 1, dtype=float)
        tokens[0] = 1.0  # priced below as zero: a step without tokens computes nothing
        self.layer_ops = [op for op in tables.LAYER_OPS if op in curves]
        per_layer = sum(curves[op].over(tokens) for op in self.layer_ops)
        compute = curves["emb"].over(tokens) + layers * per_layer
        self.compute_top = float(compute[top])
        self.message_bytes = hidden * catalog.DTYPE_BYTES  # one token's activations, reduced per all-reduce
        self.allreduce = tables.allreduce_curve(spec.cluster, spec.tp) if spec.cluster else None
        self.layers = layers
        network = np.zeros_like(tokens)
        self.limit = top
        if self.allreduce is not None:
            network = 2 * layers * self.allreduce.over(tokens * self.message_bytes)
            self.limit = min(top, int(self.allreduce.top // self.message_bytes))
        base = compute + network
        base[0] = 0.0
        self.base: list[float] = base.tolist()
        up = curves["mlp_up_proj"].over(tokens)
        up_width = (2 if model.gated_mlp else 1) * model.intermediate_size
        head = up * model.vocab_size / up_width
        head[0] = 0.0
        self.head: list[float] = head.tolist()
        gpu = catalog.GPUS[spec.gpu]
        self.hardware = Hardware(
            name=gpu.name, peak_flops=gpu.peak_flops, mem_bandwidth=gpu.mem_bandwidth,
            bandwidth_efficiency=gpu.achieved_bandwidth, attn_flops_efficiency=attn_flops_efficiency,
            host_bandwidth=gpu.host_bandwidth,
        )  # fmt: skip
        per_pair, per_key, per_query = attention_coefficients(self.hardware, model, catalog.DTYPE_BYTES, spec.tp)
        self.attention = (layers * per_pair, layers * per_key, layers * per_query)
        # K and V of every layer for the K/V heads one GPU holds (replicated when fewer than tp)
        kv_heads_gpu = -(-model.num_kv_heads // spec.tp)
        self.kv_per_token_gpu = 2 * layers * kv_heads_gpu * model.head_dim * catalog.DTYPE_BYTES
        self.swap_per_token = self.kv_per_token_gpu / gpu.host_bandwidth

    def beyond(self, t: int) -> float:
        """The step's measured part past the compute table: proportional in tokens and message bytes."""
        network = 0.0
        if self.allreduce is not None:
            network = 2 * self.layers * self.allreduce.at(t * self.message_bytes)
        return self.compute_top * t / self.top + network


@functools.cache
def _arrays(spec: catalog.Spec, attn_flops_efficiency: float) -> _Arrays:
    return _Arrays(spec, attn_flops_efficiency)


class MeasuredCost(BaseModel):
    """A profile priced from the measured tables of one GPU x model x tensor-parallel degree."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["gpu-tables"] = "gpu-tables"
    gpu: str
    model: str
    tp: int = Field(1, ge=1)
    network: Literal["dgx", "pairwise-nvlink"] = "dgx"
    util: float = Field(catalog.DEFAULT_UTILIZATION, gt=0, le=1, description="Share of GPU memory for weights + KV.")
    attn_flops_efficiency: float = Field(ATTN_FLOPS_EFFICIENCY, gt=0, le=1)

    @property
    def spec(self) -> catalog.Spec:
        return catalog.validate(catalog.Spec(self.gpu, self.model, self.tp, self.network, self.util))

    def arrays(self) -> _Arrays:
        return _arrays(self.spec, self.attn_flops_efficiency)

    def pricer(self, block_size: int) -> StepPricer:
        """A fresh pricer (its own count of extrapolated steps) over the shared arrays."""
        return StepPricer(self.arrays(), block_size)

    def step_time(self, shape: StepShape, block_size: int) -> float:
        return _shared_pricer(self, block_size)(shape)

    def memory(self) -> dict[str, float]:
        """GPU memory, the weights one GPU holds, and what is left for the KV cache (bytes), per GPU."""
        spec = self.spec
        gpu, model = catalog.GPUS[spec.gpu], catalog.MODELS[spec.model]
        total = gpu.memory_gib * catalog.GIB
        weights = model.params_per_gpu(spec.tp) * catalog.DTYPE_BYTES
        return {"gpu_bytes": total, "usable_bytes": spec.util * total, "weight_bytes": weights,
                "kv_bytes": spec.util * total - weights}  # fmt: skip

    def kv_capacity_tokens(self) -> int:
        """Tokens of KV cache the replica holds: each GPU's free memory over its share of a token's K/V."""
        mem = self.memory()
        if mem["kv_bytes"] <= 0:
            gib = catalog.GIB
            raise catalog.CatalogError(
                f"{self.spec.name}: the weights ({mem['weight_bytes'] / gib:.1f} GiB per GPU) do not fit in "
                f"{self.util:g} of the GPU's {mem['gpu_bytes'] / gib:g} GiB, leaving no KV cache; use a higher tp, "
                "or set kv_cache.num_blocks to simulate anyway"
            )
        return int(mem["kv_bytes"] // self.arrays().kv_per_token_gpu)

    def describe(self) -> dict[str, Any]:
        spec, a = self.spec, self.arrays()
        gib = catalog.GIB
        mem = self.memory()
        network = "none (TP 1)"
        if a.allreduce is not None:
            network = (
                f"{spec.cluster} all-reduce, {spec.tp} workers, measured to {a.allreduce.top / 2**20:.0f} MiB "
                f"({a.limit} tokens); 2 per layer"
            )
        return {
            "profile": spec.name,
            "cost": f"measured operator tables ({tables.source()}; Agrawal et al., MLSys 2024)",
            "measured_tokens": f"1-{a.top}",
            "exact_up_to_tokens": a.limit,
            "operators": ["emb (once per step)", *a.layer_ops],
            "network": network,
            "attention": (
                f"roofline, not validated: {self.attn_flops_efficiency:g} of {a.hardware.peak_flops / 1e12:g} "
                f"TFLOP/s, K/V read at {a.hardware.bandwidth_efficiency:g} of "
                f"{a.hardware.mem_bandwidth / 1e12:g} TB/s"
            ),
            "lm_head": "measured MLP up-projection at the sampled rows, scaled by vocab / up-projection width",
            "extrapolation": f"steps wider than {a.limit} tokens: in proportion to their tokens from the last "
            "measured point; counted per row as extrapolated_steps",
            "not_modelled": "CPU overhead (scheduling, sampling, input preparation), logits all-gather",
            "memory": {
                "gpu_gib": mem["gpu_bytes"] / gib,
                "util": spec.util,
                "weights_gib_per_gpu": round(mem["weight_bytes"] / gib, 3),
                "kv_gib_per_gpu": round(mem["kv_bytes"] / gib, 3),
                "kv_tokens": int(mem["kv_bytes"] // a.kv_per_token_gpu) if mem["kv_bytes"] > 0 else 0,
            },
        }


@functools.cache
def _shared_pricer(cost: MeasuredCost, block_size: int) -> StepPricer:
    return cost.pricer(block_size)
