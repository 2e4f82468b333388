"""A step's time from hardware numbers: each operator is bound by compute or by memory.

For every matrix product of a step the time is its FLOPs over the
achievable FLOP/s plus its bytes (weights once, activations in and out) over
the achievable bandwidth (or the larger of the two with ``overlap: true``,
the textbook roofline; the sum follows published GEMM timings better around
the ridge point, see docs/simulate.md); attention reads each sequence's cached keys
and values once and does ``4 * heads * head_dim`` FLOPs per query-key pair;
norms, rotary, activation and residuals are a fixed number of passes over the
activations. The two efficiencies are the fraction of the data-sheet peaks
that real kernels reach; they are fitted once against published operator
timings (:mod:`cbcore.sim.anchor`) and stated with their error.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeFloat, PositiveFloat

from cbcore.sim.model_shape import ModelShape
from cbcore.sim.shape import StepShape

# Elementwise passes over a token's hidden vector per layer (two norms, rotary,
# activation over the MLP width counted separately, two residual adds; each
# reads and writes).
HIDDEN_PASSES = 10
INTERMEDIATE_PASSES = 3


class Hardware(BaseModel):
    """Data-sheet numbers of one accelerator and the share of them kernels reach."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    peak_flops: PositiveFloat = Field(description="Dense FLOP/s at the profile's dtype.")
    mem_bandwidth: PositiveFloat = Field(description="Device memory bandwidth, bytes/s.")
    flops_efficiency: float = Field(0.7, gt=0, le=1, description="Achieved share of peak_flops in GEMMs.")
    bandwidth_efficiency: float = Field(0.8, gt=0, le=1, description="Achieved share of mem_bandwidth.")
    attn_flops_efficiency: float = Field(0.5, gt=0, le=1, description="Achieved share of peak in attention.")
    host_bandwidth: PositiveFloat = Field(25e9, description="Host<->device bytes/s, for swap preemption.")
    step_overhead_s: NonNegativeFloat = Field(0.0, description="Fixed per-step time (launches, host work).")
    per_seq_overhead_s: NonNegativeFloat = Field(0.0, description="Per scheduled sequence and step.")
    overlap: bool = Field(False, description="Matmul time = max(compute, memory) instead of their sum.")
    kv_memory_mb: PositiveFloat | None = Field(
        None, description="Device memory for the KV pool when kv_cache.num_blocks is unset."
    )


def matmul_time(hw: Hardware, tokens: int, n_in: int, n_out: int, dtype_bytes: int) -> float:
    flops = 2.0 * tokens * n_in * n_out
    moved = (n_in * n_out + tokens * (n_in + n_out)) * dtype_bytes
    compute = flops / (hw.peak_flops * hw.flops_efficiency)
    memory = moved / (hw.mem_bandwidth * hw.bandwidth_efficiency)
    return max(compute, memory) if hw.overlap else compute + memory


def linear_time_per_layer(hw: Hardware, model: ModelShape, tokens: int, dtype_bytes: int) -> float:
    """The four matrix products of one layer (what published per-operator timings check)."""
    return sum(matmul_time(hw, tokens, i, o, dtype_bytes) for i, o in model.linear_layers())


def attention_coefficients(
    hw: Hardware, model: ModelShape, dtype_bytes: int, tp: int = 1
) -> tuple[float, float, float]:
    """One layer's attention on one GPU: seconds per query-key pair (compute), per key read and per
    query token (memory: K and V of every key, the query in and its output out).

    A step's attention is ``max(pairs * per_pair, keys * per_key + tokens * per_query)`` per layer.
    With tensor parallelism each GPU has ``heads / tp`` query heads and ``ceil(kv_heads / tp)`` K/V
    heads (replicated when there are fewer K/V heads than GPUs).
    """
    heads, kv_heads = model.num_heads // tp, -(-model.num_kv_heads // tp)
    bw = hw.mem_bandwidth * hw.bandwidth_efficiency
    per_pair = 4.0 * heads * model.head_dim / (hw.peak_flops * hw.attn_flops_efficiency)
    per_key = 2 * kv_heads * model.head_dim * dtype_bytes / bw
    per_query = 2 * heads * model.head_dim * dtype_bytes / bw
    return per_pair, per_key, per_query


class RooflineCost(BaseModel):
    """Step time for hardware that is not here, from the numbers of :class:`Hardware`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["roofline"] = "roofline"
    hardware: Hardware

    def step_time(self, shape: StepShape, model: ModelShape, dtype_bytes: int, block_size: int) -> float:
        hw = self.hardware
        bw = hw.mem_bandwidth * hw.bandwidth_efficiency
        t_tokens = shape.num_tokens
        layers = model.num_layers
        linear = layers * linear_time_per_layer(hw, model, t_tokens, dtype_bytes)
        per_pair, per_key, per_query = attention_coefficients(hw, model, dtype_bytes)
        attention = layers * max(shape.attn_pairs * per_pair, shape.kv_tokens * per_key + t_tokens * per_query)
        passes = HIDDEN_PASSES * model.hidden_size + INTERMEDIATE_PASSES * model.intermediate_size
        elementwise = layers * 2 * t_tokens * passes * dtype_bytes / bw
        head = matmul_time(hw, shape.num_samples, model.hidden_size, model.vocab_size, dtype_bytes)
        swap = shape.swap_blocks * block_size * model.kv_bytes_per_token(dtype_bytes) / hw.host_bandwidth
        overhead = hw.step_overhead_s + hw.per_seq_overhead_s * shape.num_seqs
        return linear + attention + elementwise + head + swap + overhead
