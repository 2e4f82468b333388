"""Decode attention over the paged KV pool on the CPU, without gathering the keys first.

The ``sdpa`` backend's decode rows otherwise copy every row's keys and values
out of the block pool into a right-padded tensor on every layer, then run
SDPA over the copy: at 32 rows of 1,024 tokens that copy alone is most of
the attention's time. ``paged_decode.c`` reads the pool in place through the
block tables instead (one pass over keys and values, a running softmax). It is
built and loaded by :mod:`cbcore.kernels.native`; where it cannot be,
:func:`unavailable_reason` says why, and the backend decides (see
``backends/sdpa.py``).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from cbcore.kernels.native import KernelUnavailable, NativeKernel

__all__ = ["KernelUnavailable", "PagedRows", "paged_decode", "unavailable_reason"]

SOURCE = Path(__file__).with_name("paged_decode.c")
_P, _I = ctypes.c_void_p, ctypes.c_int64
_ARGTYPES = [_P, _P, _P, _P, _I, _P, _P, _P, _I, _I, _I, _I, _I, _I, ctypes.c_float, ctypes.c_int]


KERNEL = NativeKernel(SOURCE, "cb_paged_decode_f32", _ARGTYPES, trial=lambda: _trial())
unavailable_reason = KERNEL.unavailable_reason


def _check(name: str, t: torch.Tensor, dtype: torch.dtype) -> None:
    if t.dtype != dtype or t.device.type != "cpu" or not t.is_contiguous():
        layout = "contiguous" if t.is_contiguous() else "non-contiguous"
        raise ValueError(
            f"paged_decode: {name} must be a contiguous CPU {dtype} tensor, got {layout} {t.dtype} on {t.device}"
        )


@dataclass(frozen=True)
class PagedRows:
    """Where each decode row's keys lie: checked once when a step's plan is built, read by every layer."""

    tables: torch.Tensor  # [rows, max_blocks] int32
    starts: torch.Tensor  # [rows] int64: first visible position
    counts: torch.Tensor  # [rows] int64: number of visible positions
    block_size: int

    def __post_init__(self) -> None:
        for name, dtype in (("tables", torch.int32), ("starts", torch.int64), ("counts", torch.int64)):
            _check(name, getattr(self, name), dtype)
        rows = self.tables.shape[0]
        if self.tables.dim() != 2 or self.starts.shape != (rows,) or self.counts.shape != (rows,):
            raise ValueError(f"paged_decode: tables/starts/counts must have {rows} rows")
        if self.block_size < 1:
            raise ValueError(f"paged_decode: block_size must be positive, got {self.block_size}")


def paged_decode(
    query: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, keys: PagedRows, scale: float
) -> torch.Tensor:
    """Each row's single query attends to positions ``[start, start + count)`` of its own blocks.

    ``query`` is ``[rows, heads, head_dim]`` float32, each pool ``[slots, kv_heads, head_dim]``.
    """
    fn = KERNEL.fn
    rows, heads, head_dim = query.shape
    kv_heads = k_pool.shape[1]
    _check("query", query, torch.float32)
    _check("k_pool", k_pool, torch.float32)
    _check("v_pool", v_pool, torch.float32)
    block_size = keys.block_size
    if k_pool.shape[0] % block_size:
        raise ValueError(f"paged_decode: a pool of {k_pool.shape[0]} slots is not made of blocks of {block_size}")
    if not kv_heads or heads % kv_heads or k_pool.shape != v_pool.shape or k_pool.shape[2] != head_dim:
        raise ValueError(f"paged_decode: query {tuple(query.shape)} does not fit the pool {tuple(k_pool.shape)}")
    if keys.tables.shape[0] != rows:
        raise ValueError(f"paged_decode: {keys.tables.shape[0]} rows of block tables for {rows} queries")
    out = torch.empty_like(query)
    failed = fn(
        query.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), keys.tables.data_ptr(), keys.tables.shape[1],
        keys.starts.data_ptr(), keys.counts.data_ptr(), out.data_ptr(),
        rows, heads, kv_heads, head_dim, block_size, k_pool.shape[0] // block_size, scale, torch.get_num_threads(),
    )  # fmt: skip
    if failed == 1:
        raise MemoryError(f"paged_decode: no memory for the scores of {rows} rows x {heads} heads")
    if failed:
        raise ValueError("paged_decode: a row's positions or blocks lie outside its block table or the pool")
    return out


def _trial() -> Callable[[], object]:
    """What the instruction sets are timed on: a decode step's attention at the default model's head
    shape (9 query heads over 3 KV heads of 64), 16 rows of 512 keys in blocks of 16."""
    gen, rows, context, block = torch.Generator().manual_seed(0), 16, 512, 16
    k, v = (torch.randn(rows * context, 3, 64, generator=gen) for _ in range(2))
    query = torch.randn(rows, 9, 64, generator=gen)
    tables = torch.arange(rows * context // block, dtype=torch.int32).view(rows, -1)
    keys = PagedRows(tables, torch.zeros(rows, dtype=torch.int64), torch.full((rows,), context), block)
    return lambda: paged_decode(query, k, v, keys, 0.125)
