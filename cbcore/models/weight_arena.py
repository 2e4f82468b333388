"""The decode products' weights in one buffer on 2 MiB pages, where the kernel grants them.

A decode step of a few rows reads every linear weight once, half a gigabyte
for the default model in float32, and on 4 KiB pages that stream misses the
TLB on every page: the products of 8-16 rows took 0.90-0.91x the time with
the weights on 2 MiB pages (one row 0.98x; 30 layers' products side by
side, 2-core Zen 4). HF loads weights from a mapped file (4 KiB pages) and
the joined projections come from the heap, so the fused forward copies them
all into one anonymous buffer, asked for transparent huge pages
(``madvise(MADV_HUGEPAGE)``) before anything is written to it, and makes the
model's weights views of it: the same values, ``generate()`` sees the same
model. Where the kernel refuses (no transparent huge pages, another OS) the
buffer is used on whatever pages it got, and :attr:`WeightArena.why_small`
says why.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import torch

HUGE_PAGE = 2 * 2**20
THP_POLICY = "/sys/kernel/mm/transparent_hugepage/enabled"
_MADV_HUGEPAGE = 14  # Linux


def advise_huge_pages(t: torch.Tensor) -> str | None:
    """Ask the kernel to back ``t`` (2 MiB-aligned, not yet touched) with huge pages; None, else why not."""
    try:
        policy = Path(THP_POLICY).read_text()
    except OSError:
        return "this kernel has no transparent huge pages"
    if "[never]" in policy:
        return f"transparent huge pages are off ({THP_POLICY}: {policy.strip()})"
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except AttributeError:
        return "the C library has no madvise"
    madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    if madvise(t.data_ptr(), t.nbytes, _MADV_HUGEPAGE) != 0:
        return f"madvise(MADV_HUGEPAGE) failed: {os.strerror(ctypes.get_errno())}"
    return None


class WeightArena:
    """Hands out consecutive slices of one 2 MiB-aligned buffer of ``numel`` elements."""

    def __init__(self, numel: int, dtype: torch.dtype) -> None:
        per_page = HUGE_PAGE // torch.empty((), dtype=dtype).element_size()
        raw = torch.empty(numel + per_page, dtype=dtype)
        skip = (-raw.data_ptr() % HUGE_PAGE) // raw.element_size()
        self.buffer = raw[skip : skip + numel]
        self.why_small = advise_huge_pages(self.buffer)
        self._used = 0

    def take(self, rows: int, cols: int) -> torch.Tensor:
        start, end = self._used, self._used + rows * cols
        if end > self.buffer.numel():
            raise ValueError(f"weight arena: {rows} x {cols} more than the {self.buffer.numel()} elements planned")
        self._used = end
        return self.buffer[start:end].view(rows, cols)
