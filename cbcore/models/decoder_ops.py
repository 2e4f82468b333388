"""The fused forward's elementwise glue: one C call per norm, rotary and activation, or torch's ops.

At one decoding sequence of the default model a layer's products take about
1 ms and its twenty-odd small torch ops about a quarter of that again, nearly
all of it dispatch (measured: some 8 ms of a 44 ms step).
``cbcore/kernels/decoder_ops.c`` does each group in one pass (built and loaded like every cbcore kernel, see
:mod:`cbcore.kernels.native`): the residual add with the norm after it,
rotary in place on the joined q/k/v product, silu times up. The sums run in
another order than torch's (the norm's mean of squares), so the logits differ
from HF's modules in the last bits, as any change of batch shape makes them;
the equivalence tests cover it. :class:`TorchOps` is the same contract in
HF's own ops, op for op: for other dtypes or devices, and where the kernel
cannot be built (the reason is logged).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
from torch import nn
from transformers.activations import SiLUActivation

from cbcore.kernels import native
from cbcore.kernels.native import NativeKernel
from cbcore.models.packed_linear import with_room

_P, _I, _F, _T = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
SOURCE = Path(native.__file__).with_name("decoder_ops.c")
ADD_RMS_NORM = NativeKernel(SOURCE, "cb_add_rms_norm", [_P, _P, _P, _P, _I, _I, _F, _T])
ROTARY = NativeKernel(SOURCE, "cb_rotary", [_P, _I, _P, _P, _I, _I, _I, _T])
SILU_MUL = NativeKernel(SOURCE, "cb_silu_mul", [_P, _P, _I, _I, _T])


class TorchOps:
    """HF's ops in HF's order (float32 inside the norm, the weight applied in the input dtype)."""

    name = "torch"

    @staticmethod
    def add_norm(h: torch.Tensor, delta: torch.Tensor | None, norm: nn.Module) -> torch.Tensor:
        """``h += delta`` in place, then ``norm(h)``."""
        if delta is not None:
            h.add_(delta)
        x = h.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
        return norm.weight * x.to(h.dtype)

    @staticmethod
    def rotate(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """HF's ``apply_rotary_pos_emb`` on ``[T, heads, dim]`` (cos/sin ``[T, dim]``); a new tensor."""
        half = qk.shape[-1] // 2
        cos, sin = cos[:, None], sin[:, None]
        return qk * cos + torch.cat((-qk[..., half:], qk[..., :half]), dim=-1) * sin

    @staticmethod
    def silu_mul(gate_up: torch.Tensor, act: nn.Module) -> torch.Tensor:
        n = gate_up.shape[1] // 2
        return act(gate_up[:, :n]) * gate_up[:, n:]


class NativeOps:
    """The same contract in ``decoder_ops.c``: float32 on the CPU, rows contiguous in the last dim."""

    name = "native"

    @staticmethod
    def add_norm(h: torch.Tensor, delta: torch.Tensor | None, norm: nn.Module) -> torch.Tensor:
        if not h.is_contiguous():  # h is added to in place: a copy would lose the residual
            raise ValueError("NativeOps.add_norm: the residual stream h must be contiguous")
        rows, width = h.shape
        out = with_room(rows, width, h)  # the next product's input
        delta = None if delta is None else delta.contiguous()
        ADD_RMS_NORM.fn(
            h.data_ptr(), None if delta is None else delta.data_ptr(), norm.weight.data_ptr(), out.data_ptr(),
            rows, width, norm.variance_epsilon, torch.get_num_threads(),
        )  # fmt: skip
        return out

    @staticmethod
    def rotate(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """In place on ``qk`` (``[T, heads, dim]``, a view whose rows may be strided); returns it."""
        rows, heads, dim = qk.shape
        if qk.stride(2) != 1 or qk.stride(1) != dim:
            raise ValueError(
                f"NativeOps.rotate: heads must be contiguous within a row, got strides {qk.stride()}"
            )
        cos, sin = cos.contiguous(), sin.contiguous()
        threads = torch.get_num_threads()
        ROTARY.fn(
            qk.data_ptr(), qk.stride(0), cos.data_ptr(), sin.data_ptr(), rows, heads, dim, threads
        )
        return qk

    @staticmethod
    def silu_mul(gate_up: torch.Tensor, act: nn.Module) -> torch.Tensor:
        gate_up = gate_up.contiguous()
        rows, width = gate_up.shape
        out = with_room(rows, width // 2, gate_up)  # the down product's input
        SILU_MUL.fn(gate_up.data_ptr(), out.data_ptr(), rows, width // 2, torch.get_num_threads())
        return out


def native_refusal(model: nn.Module, head_dim: int) -> str | None:
    """Why ``NativeOps`` cannot run this model here, or None (building the kernel on first call)."""
    param = next(model.parameters())
    if param.device.type != "cpu" or param.dtype != torch.float32:
        return f"it runs float32 on the CPU, this model is {param.dtype} on {param.device}"
    if head_dim % 2:
        return f"rotary needs an even head_dim, this model has {head_dim}"
    acts = {type(layer.mlp.act_fn) for layer in model.model.layers}
    if not acts <= {nn.SiLU, SiLUActivation}:
        return f"it implements silu, this model's MLP uses {', '.join(sorted(a.__name__ for a in acts))}"
    return ADD_RMS_NORM.unavailable_reason()
