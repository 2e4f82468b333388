"""Linear layers multiplied by oneDNN from weights packed once, inside engine forwards.

``F.linear`` on the CPU goes to MKL's sgemm, which re-lays-out the weight on
every call and, with the few rows of a decode step, often picks a poor kernel
(on a 2-core AMD host, 16 rows cost 2-3x what oneDNN takes for the same
product). oneDNN multiplies from a weight reordered once into its blocked
layout, which is what vLLM's CPU path does too. The packed copies are made when
the engine is built (as much memory again as the linear weights) and used only
inside an engine forward (:meth:`PackedLinears.active`): the model stays a
plain HF model for anyone else, ``generate()`` included, and its own weights
are untouched.

The products are the same dot products summed in another order (last-bit
differences, covered by the equivalence tests like any change of batch shape).

oneDNN keeps a primitive (JIT code and scratch memory) per product shape,
megabytes each at a few hundred rows (3.6 MiB at 600-700 rows times a
576 x 1,536 weight, measured here): a server that saw every row count up to a
thousand would grow by gigabytes, and a long run of a tiny model grew by
27 MiB. So the row counts oneDNN sees stay few: up to :data:`EXACT_ROWS` as
they are, more in pieces of at most :data:`PIECE_ROWS` rows, each padded to a
multiple of :data:`PAD_STEP` (46 row counts per layer shape, whatever the
workload). Products of more than ``PIECE_ROWS`` rows are compute-bound, so
the pieces cost little (512 rows as two pieces: 8 % more than one product).
Every one of those row counts is
multiplied once when the engine is built (:meth:`PackedLinears._warm`), so the
primitives are made before the first request, not in the middle of serving,
and the process's memory is flat from then on.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Literal

import torch
from torch import nn

from cbcore.log import get_logger

log = get_logger(__name__)

#: Row counts oneDNN multiplies as they are; rows per product at most; the padding step in between.
EXACT_ROWS = 16
PIECE_ROWS = 256
PAD_STEP = 8
#: The LM head multiplies only the sampling rows (one per sequence): warmed up to this many.
HEAD_WARM_ROWS = 64

#: ``auto``: oneDNN where it can run (CPU, float32 weights; bfloat16 on CPUs with bf16 support), else standard.
LinearKind = Literal["auto", "onednn", "standard"]


def _packable() -> tuple[torch.dtype, ...]:
    """oneDNN packs bfloat16 only on CPUs with native bf16 conversion (AVX-512 or AVX-NE-CONVERT)."""
    bf16 = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return (torch.float32, torch.bfloat16) if bf16 is not None and bf16() else (torch.float32,)


def onednn_refusal(modules: list[nn.Linear]) -> str | None:
    """Why oneDNN cannot multiply these layers here, or None."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return "this torch build has no oneDNN linear"
    dtypes = _packable()
    odd = next((m for m in modules if m.weight.device.type != "cpu" or m.weight.dtype not in dtypes), None)
    if odd is not None:
        names = "/".join(str(d).removeprefix("torch.") for d in dtypes)
        return f"it packs CPU {names} weights only here, this model has {odd.weight.dtype} on {odd.weight.device}"
    return None


class PackedLinears:
    """The model's ``nn.Linear`` layers, routed to packed oneDNN products while :meth:`active`."""

    def __init__(self, model: nn.Module, kind: LinearKind = "auto") -> None:
        modules = [m for m in model.modules() if type(m) is nn.Linear]
        reason = onednn_refusal(modules) if kind != "standard" else "asked for"
        if kind == "onednn" and reason is not None:
            raise ValueError(f"execution.linear 'onednn' cannot run here: {reason}")
        self.kind: Literal["onednn", "standard"] = "standard" if reason is not None else "onednn"
        self._active = False
        for module in modules:
            # An engine built earlier on the same model may have routed it; start from the class's forward.
            # (That earlier engine then multiplies with F.linear: the same numbers, its speed of old.)
            module.__dict__.pop("forward", None)
            if self.kind == "onednn":
                module.forward = self._routed(module)  # type: ignore[method-assign]
        warmed, seconds = self._warm(modules, model) if self.kind == "onednn" else (0, 0.0)
        log.info(
            "linear layers",
            kind=self.kind,
            layers=len(modules),
            why_standard=reason if kind == "auto" else None,
            warmed_products=warmed,
            warm_s=round(seconds, 2),
        )

    def _warm(self, modules: list[nn.Linear], model: nn.Module) -> tuple[int, float]:
        """Multiply every row count oneDNN will see once per layer shape: its primitives made now."""
        started = time.perf_counter()
        get_head = getattr(model, "get_output_embeddings", None)
        head = get_head() if callable(get_head) else None
        counts = sorted({padded for n in range(1, PIECE_ROWS + 1) for *_, padded in row_pieces(n)})
        seen: set[tuple[int, int, bool, bool]] = set()
        products = 0
        with torch.no_grad(), self.active():
            for module in modules:
                key = (module.in_features, module.out_features, module.bias is not None, module is head)
                if key not in seen:
                    seen.add(key)
                    for rows in counts if module is not head else [c for c in counts if c <= HEAD_WARM_ROWS]:
                        module(module.weight.new_zeros(rows, module.in_features))
                        products += 1
        return products, time.perf_counter() - started

    def _routed(self, module: nn.Linear):
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), None)
        plain = nn.Linear.forward.__get__(module)
        bias = module.bias

        def forward(x: torch.Tensor) -> torch.Tensor:
            if not self._active or x.dtype != packed.dtype or x.numel() == 0:
                return plain(x)
            flat = x.reshape(-1, x.shape[-1])
            if len(flat) <= EXACT_ROWS:  # a decode step: one unpadded product, no Python beyond it
                out = torch.ops.mkldnn._linear_pointwise(flat, packed, bias, "none", [], "")
            else:
                pieces = [_product(flat[a:b], padded, packed, bias) for a, b, padded in row_pieces(len(flat))]
                out = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
            return out.view(*x.shape[:-1], out.shape[-1])

        return forward

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        self._active = True
        try:
            yield
        finally:
            self._active = False


def row_pieces(n: int) -> list[tuple[int, int, int]]:
    """``(start, stop, padded rows)`` per oneDNN product of ``n`` rows: few distinct row counts for any ``n``."""
    pieces = []
    for start in range(0, n, PIECE_ROWS):
        rows = min(PIECE_ROWS, n - start)
        pieces.append((start, start + rows, rows if rows <= EXACT_ROWS else -(-rows // PAD_STEP) * PAD_STEP))
    return pieces


def _product(rows: torch.Tensor, padded: int, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    n = len(rows)
    if padded != n:
        rows = torch.cat([rows, rows.new_zeros(padded - n, rows.shape[1])])
    out = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")
    return out[:n] if padded != n else out
