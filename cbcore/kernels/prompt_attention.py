"""Causal attention of a step's whole prompts on the CPU, all of them in one C call per layer.

SDPA takes one call per prompt, and at 128 x 128 per head its CPU kernel
reaches about a quarter of this machine's float32 rate: a 16 x 128 prefill of
the default model spent 199-255 ms of 2.3 s in it. ``prompt_attention.c``
scores each KV head's query heads together and sums each value row once
for all of them, on the step's own q/k/v (nothing is copied). It is built
and loaded like every cbcore kernel (:mod:`cbcore.kernels.native`); the
``sdpa`` backend runs it wherever it runs the paged decode.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from cbcore.kernels.native import NativeKernel

_P, _I = ctypes.c_void_p, ctypes.c_int64
KERNEL = NativeKernel(
    Path(__file__).with_name("prompt_attention.c"), "cb_prompt_attention_f32",
    [_P, _I, _I, _P, _I, _I, _P, _I, _I, _P, _P, _P, _I, _I, _I, _I, ctypes.c_float, ctypes.c_int],
    trial=lambda: _trial(),
)  # fmt: skip
unavailable_reason = KERNEL.unavailable_reason


@dataclass(frozen=True)
class Prompts:
    """Where a step's whole prompts lie among its ``rows`` rows: checked once per step, read by every layer."""

    starts: torch.Tensor  # [prompts] int64: first row
    lens: torch.Tensor  # [prompts] int64: rows (tokens)
    rows: int

    @classmethod
    def of(cls, spans: list[tuple[int, int]], rows: int) -> Prompts:
        if any(start < 0 or n < 1 or start + n > rows for start, n in spans):
            raise ValueError(f"prompt_attention: a prompt of {spans} lies outside the step's {rows} rows")
        starts, lens = zip(*spans, strict=True) if spans else ((), ())
        return cls(torch.tensor(starts, dtype=torch.int64), torch.tensor(lens, dtype=torch.int64), rows)


def prompt_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, out: torch.Tensor, prompts: Prompts, scale: float
) -> None:
    """Write into ``out`` the rows of each prompt, each query row seeing its prompt's keys up to itself.

    ``query``/``out`` ``[T, heads, D]``, ``key``/``value`` ``[T, kv_heads, D]``: float32 on the CPU, each
    head's ``D`` contiguous, ``out`` contiguous.
    """
    rows, heads, dim = query.shape
    kv_heads = key.shape[1]
    for name, t in (("query", query), ("key", key), ("value", value), ("out", out)):
        if t.dtype != torch.float32 or t.device.type != "cpu" or t.stride(2) != 1:
            raise ValueError(f"prompt_attention: {name} must be float32 on the CPU, each head's dims contiguous")
    if not out.is_contiguous() or out.shape != query.shape or key.shape != value.shape or key.shape[0] != rows:
        raise ValueError(f"prompt_attention: shapes q {tuple(query.shape)} k/v {tuple(key.shape)} out {tuple(out.shape)}")
    if not kv_heads or heads % kv_heads or heads // kv_heads > 64 or key.shape[2] != dim:
        raise ValueError(f"prompt_attention: {heads} query heads cannot share {kv_heads} KV heads of {key.shape[2]}")
    if prompts.rows != rows:
        raise ValueError(f"prompt_attention: prompts placed among {prompts.rows} rows, the step has {rows}")
    n = prompts.lens.numel()
    failed = KERNEL.fn(
        query.data_ptr(), *query.stride()[:2], key.data_ptr(), *key.stride()[:2], value.data_ptr(),
        *value.stride()[:2], out.data_ptr(), prompts.starts.data_ptr(), prompts.lens.data_ptr(), n,
        heads, kv_heads, dim, scale, torch.get_num_threads(),
    )  # fmt: skip
    if failed:
        raise MemoryError(f"prompt_attention: no memory for the scores of {n} prompts")


def _trial() -> Callable[[], object]:
    """What the instruction sets are timed on: four whole prompts of 128 tokens at the default model's head
    shape (9 query heads over 3 KV heads of 64)."""
    gen, rows = torch.Generator().manual_seed(0), 512
    query, out = torch.randn(rows, 9, 64, generator=gen), torch.empty(rows, 9, 64)
    key, value = (torch.randn(rows, 3, 64, generator=gen) for _ in range(2))
    prompts = Prompts.of([(i, 128) for i in range(0, rows, 128)], rows)
    return lambda: prompt_attention(query, key, value, out, prompts, 0.125)
