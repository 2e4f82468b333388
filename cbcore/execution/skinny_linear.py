"""``F.linear`` for the few rows of a decode step, as fast as the memory streams the weights.

See ``skinny_linear.c`` for why the BLAS is slow there and what the kernel does
instead. :class:`cbcore.execution.linear.LinearRouter` decides, per row count and
by measurement, where it runs; this module only checks and calls it.
"""

from __future__ import annotations

import ctypes
import math
from pathlib import Path

import torch

from cbcore.execution.native import NativeKernel

SOURCE = Path(__file__).with_name("skinny_linear.c")
_P, _I = ctypes.c_void_p, ctypes.c_int64
_ARGTYPES = [_P, _P, _P, _P, _I, _I, _I, ctypes.c_int]


KERNEL = NativeKernel(SOURCE, "cb_skinny_linear_f32", _ARGTYPES)
unavailable_reason = KERNEL.unavailable_reason


def supports(weight: torch.Tensor) -> bool:
    """Whether the kernel can multiply by this weight as it is stored (no copy of the weights)."""
    return weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.dim() == 2 and weight.is_contiguous()


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for float32 CPU tensors; any leading shape of ``x``."""
    fn = KERNEL.function()
    if not supports(weight):
        raise ValueError(
            f"skinny_linear: weight must be a contiguous 2-D CPU float32 tensor, "
            f"got {tuple(weight.shape)} {weight.dtype} on {weight.device}"
        )
    out_features, in_features = weight.shape
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[-1:] != (in_features,):
        raise ValueError(
            f"skinny_linear: input must be a CPU float32 tensor [..., {in_features}], "
            f"got {tuple(x.shape)} {x.dtype} on {x.device}"
        )
    if bias is not None and (
        bias.dtype != torch.float32 or bias.device.type != "cpu" or bias.shape != (out_features,)
        or not bias.is_contiguous()
    ):  # fmt: skip
        raise ValueError(
            f"skinny_linear: bias must be a contiguous CPU float32 [{out_features}], "
            f"got {tuple(bias.shape)} {bias.dtype} on {bias.device}"
        )
    # Called once per linear layer per step: no reshapes or views beyond the one output tensor.
    if not x.is_contiguous():
        x = x.contiguous()
    out = torch.empty((*x.shape[:-1], out_features), dtype=torch.float32)
    fn(
        x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr(),
        math.prod(x.shape[:-1]), out_features, in_features, torch.get_num_threads(),
    )  # fmt: skip
    return out
