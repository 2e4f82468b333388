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
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Literal

import torch
from torch import nn

from cbcore.log import get_logger

log = get_logger(__name__)

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

    def __init__(self, model: nn.Module, kind: LinearKind = "standard") -> None:
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
        log.info("linear layers", kind=self.kind, layers=len(modules), why_standard=reason if kind == "auto" else None)

    def _routed(self, module: nn.Linear):
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), None)
        plain = nn.Linear.forward.__get__(module)
        bias = module.bias

        def forward(x: torch.Tensor) -> torch.Tensor:
            if not self._active or x.dtype != packed.dtype or x.numel() == 0:
                return plain(x)
            flat = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), packed, bias, "none", [], "")
            return flat.view(*x.shape[:-1], flat.shape[-1])

        return forward

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        self._active = True
        try:
            yield
        finally:
            self._active = False
