"""FlashAttention varlen backend: one kernel call per layer for the whole packed step.

The packed row is exactly what FlashAttention's *varlen* kernels take:
``cu_seqlens_q`` marks each sequence's queries, ``cu_seqlens_k`` (and
``seqused_k``) its number of keys, and with ``block_table`` the kernel reads
keys straight from the paged cache — no gather, no mask, no padding. Its
causal mask is aligned to the bottom right, which is what a prefill chunk
after earlier context needs, and a window ``(W - 1, 0)`` gives the sliding
window ``i - W < j <= i``.

Two kernels implement that interface; ``kernel: auto`` takes the first usable:

- ``flash-attn``: the ``flash_attn`` package (>= 2.5.7, where varlen gained
  ``block_table``);
- ``torch``: ``torch.nn.attention.varlen.varlen_attn`` (torch's own
  FlashAttention-2 build), where the installed torch has it on that device.

Both are FlashAttention-2 kernels: CUDA only (compute capability 8.0+), fp16
or bf16 only, head_dim a multiple of 8 up to 256, and with a block table the
page size must be a multiple of 256 (flash_api.cpp refuses anything else).
``paged: false`` lifts the page-size rule by gathering each step's keys into a
packed buffer first (one copy per layer, as eager does). Where nothing fits,
:meth:`FlashVarlenBackend.check` raises at engine start with the reason —
there is no quiet fallback to another backend.
"""

from __future__ import annotations

import functools
import importlib.metadata
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from cbcore.execution.backend import Backend, BackendUnavailable
from cbcore.execution.batch import FlatBatch
from cbcore.execution.kv_cache import KVCache
from cbcore.log import get_logger

log = get_logger(__name__)

#: FlashAttention-2 reads a paged cache only in pages of a multiple of this many tokens.
PAGE_MULTIPLE = 256
MIN_FLASH_ATTN = (2, 5, 7)
HALF_DTYPES = (torch.float16, torch.bfloat16)
# Keyword arguments of torch.nn.attention.varlen.varlen_attn this backend passes.
TORCH_VARLEN_ARGS = {"scale", "window_size", "enable_gqa", "seqused_k", "block_table"}

KernelName = Literal["flash-attn", "torch"]
KernelFn = Callable[..., torch.Tensor]


class FlashVarlenParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    kernel: Literal["auto", "flash-attn", "torch"] = Field(
        "auto", description="Which FlashAttention build to call; auto: flash-attn if usable, else torch."
    )
    paged: bool = Field(
        True,
        description="Read K/V through block tables (block_size must be a multiple of 256); "
        "false gathers each step's keys first and accepts any block size.",
    )


# -- the CPU-side plan ---------------------------------------------------------


@dataclass(frozen=True)
class VarlenMetadata:
    """The varlen kernel's per-step arguments, shared by every layer."""

    cu_seqlens_q: torch.Tensor  # [B+1] int32
    cu_seqlens_k: torch.Tensor  # [B+1] int32, cumulative keys (whole context) per sequence
    seqused_k: torch.Tensor  # [B] int32, keys per sequence
    max_seqlen_q: int
    max_seqlen_k: int
    block_table: torch.Tensor | None  # [B, max_blocks] int32, contiguous (paged only)
    kv_slots: torch.Tensor | None  # [K] cache slots, sequence after sequence (gathered only)
    window: tuple[int, int]  # (left, right) for the kernel


def varlen_window(sliding_window: int | None) -> tuple[int, int]:
    """Causal, optionally windowed, in FlashAttention's ``window_size`` convention.

    FlashAttention lets query ``i`` see keys ``[i - left, i + right]`` (bottom-right
    aligned); ``(-1, 0)`` is plain causal. cbcore's window ``W`` means ``i - W < j <= i``,
    i.e. ``left = W - 1``.
    """
    if sliding_window is None:
        return (-1, 0)
    if sliding_window < 1:
        raise ValueError(f"sliding_window must be a positive number of tokens, got {sliding_window}")
    return (sliding_window - 1, 0)


def build_varlen_metadata(batch: FlatBatch, sliding_window: int | None, paged: bool) -> VarlenMetadata:
    device = batch.device
    return VarlenMetadata(
        cu_seqlens_q=batch.cu_seqlens_q.to(torch.int32).contiguous(),
        cu_seqlens_k=batch.cu_seqlens_k.to(torch.int32).contiguous(),
        seqused_k=torch.tensor(batch.context_lens, dtype=torch.int32, device=device),
        max_seqlen_q=max(batch.query_lens, default=0),
        max_seqlen_k=max(batch.context_lens, default=0),
        block_table=batch.block_tables.to(torch.int32).contiguous() if paged else None,
        kv_slots=None if paged else batch.kv_slots,
        window=varlen_window(sliding_window),
    )


def check_shapes(head_dim: int, num_heads: int, num_kv_heads: int) -> None:
    if head_dim % 8 or head_dim > 256:
        raise BackendUnavailable(
            f"backend 'flash-varlen' needs head_dim a multiple of 8 and at most 256, got {head_dim}"
        )
    if num_heads % num_kv_heads:
        raise BackendUnavailable(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")


# -- finding a kernel ----------------------------------------------------------


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def _flash_attn_kernel() -> tuple[KernelFn | None, str]:
    try:
        version = importlib.metadata.version("flash_attn")
    except importlib.metadata.PackageNotFoundError:
        return None, "the flash_attn package is not installed"
    if _version_tuple(version) < MIN_FLASH_ATTN:
        need = ".".join(map(str, MIN_FLASH_ATTN))
        return None, f"flash_attn {version} is installed but paged varlen needs >= {need}"
    try:
        from flash_attn import flash_attn_varlen_func
    except Exception as exc:  # a wheel built for another torch/CUDA fails in many ways
        return None, f"flash_attn {version} failed to import: {exc}"
    return flash_attn_varlen_func, f"flash_attn {version}"


def _torch_kernel() -> tuple[KernelFn | None, str]:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None, f"torch {torch.__version__} has no torch.nn.attention.varlen"
    missing = TORCH_VARLEN_ARGS - set(inspect.signature(varlen_attn).parameters)
    if missing:
        return None, f"torch {torch.__version__}'s varlen_attn lacks {', '.join(sorted(missing))}"
    if not torch.backends.cuda.is_flash_attention_available():
        return None, f"torch {torch.__version__} was built without FlashAttention kernels"
    return varlen_attn, f"torch {torch.__version__} varlen_attn"


def _device_problem(device: torch.device) -> str | None:
    if device.type != "cuda":
        return f"FlashAttention kernels run on CUDA only (device is {device.type}); use 'sdpa' here"
    if not torch.cuda.is_available():
        return "CUDA is not available to this torch build"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 8:
        return f"FlashAttention-2 needs compute capability 8.0 or newer, this GPU is {major}.{minor}"
    return None


@functools.lru_cache(maxsize=8)
def find_kernel(device: torch.device, kernel: str = "auto") -> tuple[KernelName | None, KernelFn | None, str]:
    """The kernel to use on ``device`` as ``(name, fn, description)``; ``fn`` is None with the reason."""
    problem = _device_problem(device)
    if problem is not None:
        return None, None, problem
    reasons = []
    candidates: list[tuple[KernelName, Callable[[], tuple[KernelFn | None, str]]]] = [
        ("flash-attn", _flash_attn_kernel),
        ("torch", _torch_kernel),
    ]
    for name, probe in candidates:
        if kernel not in ("auto", name):
            continue
        fn, text = probe()
        if fn is not None:
            return name, fn, text
        reasons.append(text)
    return None, None, "; ".join(reasons)


# -- the backend ---------------------------------------------------------------


class FlashVarlenBackend(Backend):
    """FlashAttention-2 varlen over the packed step, reading the paged cache by block table."""

    name = "flash-varlen"
    Params = FlashVarlenParams

    def __init__(self, params: BaseModel | None = None) -> None:
        super().__init__(params)
        self._kernel: tuple[KernelName, KernelFn] | None = None

    @classmethod
    def unavailable_reason(cls, device: torch.device) -> str | None:
        name, _, reason = find_kernel(torch.device(device))
        return None if name is not None else reason

    def check(self, device: torch.device, block_size: int, dtype: torch.dtype) -> None:
        device = torch.device(device)
        super().check(device, block_size, dtype)
        name, fn, text = find_kernel(device, self.params.kernel)
        if fn is None or name is None:
            raise BackendUnavailable(f"backend 'flash-varlen' with kernel={self.params.kernel!r}: {text}")
        if dtype not in HALF_DTYPES:
            raise BackendUnavailable(
                f"backend 'flash-varlen' runs float16/bfloat16 only, the model is {dtype}; "
                "load it with model.dtype=bfloat16 (or float16), or use backend 'sdpa'"
            )
        if self.params.paged and block_size % PAGE_MULTIPLE:
            raise BackendUnavailable(
                f"backend 'flash-varlen' reads the paged cache in pages of a multiple of {PAGE_MULTIPLE} "
                f"tokens, but kv_cache.block_size is {block_size}; set kv_cache.block_size to "
                f"{PAGE_MULTIPLE} (or a multiple), or backend.paged=false to gather keys each step"
            )
        self._kernel = (name, fn)
        log.info("flash-varlen kernel", kernel=name, source=text, paged=self.params.paged)

    @property
    def variant(self) -> str | None:
        if self._kernel is None:
            return None
        return f"kernel {self._kernel[0]}, {'paged' if self.params.paged else 'gathered'}"

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        layer_idx: int,
        batch: FlatBatch,
        kv_cache: KVCache,
        scaling: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        if self._kernel is None:
            self.check(query.device, kv_cache.block_size, query.dtype)
        assert self._kernel is not None
        name, fn = self._kernel
        paged = self.params.paged
        meta_key = ("flash-varlen", sliding_window, paged)
        meta = batch.scratch.get(meta_key)
        if meta is None:
            check_shapes(query.shape[-1], query.shape[1], kv_cache.num_kv_heads)
            meta = batch.scratch[meta_key] = build_varlen_metadata(batch, sliding_window, paged)
        if paged:
            k, v = kv_cache.blocked(layer_idx)  # [num_blocks, block_size, Hkv, D]
        else:
            k, v = kv_cache.gather(layer_idx, meta.kv_slots)  # [K, Hkv, D]
        q = query.contiguous()
        if name == "flash-attn":
            return fn(
                q,
                k,
                v,
                meta.cu_seqlens_q,
                meta.cu_seqlens_k,
                meta.max_seqlen_q,
                meta.max_seqlen_k,
                softmax_scale=scaling,
                causal=True,
                window_size=meta.window,
                block_table=meta.block_table,
            )
        return fn(
            q,
            k,
            v,
            meta.cu_seqlens_q,
            meta.cu_seqlens_k,
            meta.max_seqlen_q,
            meta.max_seqlen_k,
            scale=scaling,
            window_size=meta.window,
            enable_gqa=q.shape[1] != k.shape[-2],
            seqused_k=meta.seqused_k if paged else None,
            block_table=meta.block_table,
        )
