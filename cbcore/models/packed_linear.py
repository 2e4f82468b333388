"""The fused forward's matrix products: oneDNN from weights packed once, or ``F.linear``.

``F.linear`` on the CPU goes to MKL's sgemm, which re-lays-out the weight on
every call and, with the few rows of a decode step, often picks a poor kernel
(on a 2-core AMD host, 16 rows cost 2-3x what oneDNN takes for the same
product). oneDNN multiplies from a weight reordered once into its blocked
layout, which is what vLLM's CPU path does too. The packed copies are made when
the engine is built (as much memory again as the linear weights); the model's
own weights are untouched.

Up to :data:`EXACT_ROWS` rows (a decode step) a product is one pass over a
weight that fits no cache, so its time is memory bandwidth, and there
``small_gemm.c`` (cbcore's own, four weight rows at a time, built like every
cbcore kernel) multiplies from the model's own weights: 18 ms against
oneDNN's 27 for the default model's products at one row, about 5 % less at
16 rows (2-core AVX2 host). Not on every CPU: on a 2-core AMD EPYC (Zen 5)
oneDNN took 0.99x its time at one row, 0.88x at 8 and 0.81x at 16 (all the
default model's products). So which of the two multiplies is timed once per
machine (:func:`decode_products`); ``$CBCORE_DECODE_PRODUCTS`` forces one.
Where it cannot be built, oneDNN multiplies (the ``fused forward kernels``
log line says which, and why).

The products are the same dot products summed in another order (last-bit
differences, covered by the equivalence tests like any change of batch shape).

oneDNN keeps a primitive (JIT code and scratch memory) per product shape,
megabytes each at a few hundred rows (3.6 MiB at 600-700 rows times a
576 x 1,536 weight, measured here): a server that saw every row count up to a
thousand would grow by gigabytes, and a long run of a tiny model grew by
27 MiB. So oneDNN sees few row counts: up to :data:`EXACT_ROWS` as they are,
up to :data:`PACKED_ROWS` padded to a multiple of :data:`PAD_STEP` (46 row
counts per layer shape, whatever the workload; 53 with the prefills' below).
Beyond that a float32 product has enough rows that MKL's own weight layout
costs little beside the arithmetic, and ``F.linear`` multiplies any row
count as one product with no primitive kept: a 15 x 128 prefill of the default model (1,921 rows) took
0.89-0.95x the time it took as oneDNN pieces of 1,024 + 512 + 256 + 136 rows
(three interleaved pairs of processes, 2-core Xeon with AVX-512). Not on
every CPU: on a 2-core AMD EPYC (Zen 5, AVX-512) MKL's sgemm took 2.3x
oneDNN's time at every row count from 128 to 2,048 (MKL takes another code
path on a CPU that is not Intel's). So which multiplies such a product is
timed once per machine (:func:`prefill_products`, kept and logged like the C
kernels' instruction set): ``F.linear``, or oneDNN in few row counts. There
oneDNN multiplies up to :data:`WHOLE_ROWS` rows as one product, padded to a
multiple of :data:`PACKED_ROWS`: 7 more primitives per layer shape (peak RSS
of a 16 x 128 prefill run of the default model +28 MiB). A 2,048-row step of
the default model's products took 0.90x the time it took as 256-row pieces
joined by ``torch.cat`` (0.95-0.97x at 300 to 1,900 rows; 2-core AMD EPYC,
Zen 5): the join copied every output again. Padded to a multiple of 64 rows
instead, a step of 15 prompts of 128 and one decode took 0.97x the time of
a 16 x 128 step (about 0.99x either way at a multiple of 256), but the 28
primitives per shape added 317 MiB to that run's peak RSS (a primitive's
memory grows with its rows times the weight's input width).

Padding copies the input unless the rows after it in its storage are free:
the fused forward's ops and the ``sdpa`` backend leave that room
(:func:`with_room`), and a product multiplies whatever those rows hold into
output rows it drops. A 63-sequence decode step took 0.95-0.99x its time
with the copies.
``$CBCORE_PREFILL_PRODUCTS`` forces one, so that each path runs and is tested
on one machine. bfloat16 always goes to oneDNN this way: torch hands its
``F.linear`` to oneDNN, which would keep a primitive per row count.
Every one of those row counts is multiplied once when the engine is built
(:func:`warm`), so the primitives are made before the first request, not in
the middle of serving, and the process's memory is flat from then on.
"""

from __future__ import annotations

import ctypes
import functools
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F

from cbcore.kernels import native
from cbcore.kernels.native import NativeKernel

#: Row counts oneDNN multiplies as they are; the most it multiplies (padded to PAD_STEP rows), beyond which
#: ``F.linear`` does.
EXACT_ROWS = 16
PACKED_ROWS = 256
PAD_STEP = 8
#: Past PACKED_ROWS, oneDNN multiplies up to this many rows as one product, padded to a multiple of PACKED_ROWS.
WHOLE_ROWS = 2048
#: The LM head multiplies only the sampling rows (one per sequence): warmed up to this many.
HEAD_WARM_ROWS = 64

_P, _I = ctypes.c_void_p, ctypes.c_int64
SMALL_GEMM = NativeKernel(
    Path(native.__file__).with_name("small_gemm.c"), "cb_small_gemm", [_P, _P, _P, _P, _I, _I, _I, ctypes.c_int]
)

#: ``auto``: oneDNN where it can run (CPU, float32 weights; bfloat16 on CPUs with bf16 support), else standard.
LinearKind = Literal["auto", "onednn", "standard"]
#: How float32 products of more than PACKED_ROWS rows multiply: ``standard``, ``onednn`` or ``auto`` (timed).
PREFILL_ENV = "CBCORE_PREFILL_PRODUCTS"
PREFILL_KINDS = ("standard", "onednn")
#: How float32 products of up to EXACT_ROWS rows multiply: ``small_gemm``, ``onednn`` or ``auto`` (timed).
DECODE_ENV = "CBCORE_DECODE_PRODUCTS"
DECODE_KINDS = ("small_gemm", "onednn")


def _packable() -> tuple[torch.dtype, ...]:
    """oneDNN packs bfloat16 only on CPUs with native bf16 conversion (AVX-512 or AVX-NE-CONVERT)."""
    bf16 = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return (torch.float32, torch.bfloat16) if bf16 is not None and bf16() else (torch.float32,)


def onednn_refusal(weight: torch.Tensor) -> str | None:
    """Why oneDNN cannot multiply weights like this one here, or None."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return "this torch build has no oneDNN linear"
    dtypes = _packable()
    if weight.device.type != "cpu" or weight.dtype not in dtypes:
        names = "/".join(str(d).removeprefix("torch.") for d in dtypes)
        return f"it packs CPU {names} weights only here, this model has {weight.dtype} on {weight.device}"
    return None


def resolve_kind(kind: LinearKind, weight: torch.Tensor) -> tuple[Literal["onednn", "standard"], str | None]:
    """The kind that runs and, when ``auto`` chose standard, why; ``onednn`` where it cannot run is an error."""
    reason = onednn_refusal(weight) if kind != "standard" else "asked for"
    if kind == "onednn" and reason is not None:
        raise ValueError(f"execution.linear 'onednn' cannot run here: {reason}")
    return ("standard", reason if kind == "auto" else None) if reason is not None else ("onednn", None)


class Product:
    """``x @ weight.T + bias`` for ``x`` of ``[rows, in_features]``, by the kind chosen at build."""

    __slots__ = ("bias", "packed", "small", "standard_prefill", "weight")

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, onednn: bool,
        prefill: str | None = None, decode: str | None = None,
    ) -> None:  # fmt: skip
        """``prefill`` / ``decode``: how products past PACKED_ROWS / up to EXACT_ROWS rows multiply
        (default: this machine's :func:`prefill_products` / :func:`decode_products`)."""
        self.weight, self.bias = weight, bias
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None) if onednn else None
        fp32 = onednn and weight.dtype == torch.float32
        self.small = fp32 and small_gemm_refusal(weight) is None and (decode or decode_products()) == "small_gemm"
        self.standard_prefill = fp32 and (prefill or prefill_products()) == "standard"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        packed = self.packed
        if packed is None:
            return F.linear(x, self.weight, self.bias)
        rows = len(x)
        if rows <= EXACT_ROWS:  # a decode step: one unpadded product, no Python beyond it
            if self.small:
                return _small_gemm(x.contiguous(), self.weight, self.bias)
            return torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], "")
        if rows > PACKED_ROWS:
            if self.standard_prefill:  # F.linear (MKL's sgemm): any row count, nothing kept per shape
                return F.linear(x, self.weight, self.bias)
            if rows > WHOLE_ROWS:  # oneDNN: the most rows it keeps a primitive for as one product, the rest after it
                return torch.cat([self(x[:WHOLE_ROWS]), self(x[WHOLE_ROWS:])])
        padded = padded_rows(rows)
        if padded != rows:
            x = _with_rows(x, padded)
        out = torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], "")
        return out[:rows] if padded != rows else out


def with_room(rows: int, cols: int, like: torch.Tensor) -> torch.Tensor:
    """An empty ``[rows, cols]`` tensor whose storage holds :func:`padded_rows` rows: a product of it
    pads without copying it (:func:`_with_rows`)."""
    return like.new_empty(padded_rows(rows), cols)[:rows]


def _with_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """``x`` with ``rows`` rows: the rows after it in its storage where it has them (a view: what they hold
    is multiplied into output rows that are dropped, each output row being its input row's alone), else
    zeros joined on (a copy of ``x``: at 1,921 rows the four products' inputs of a default-model layer are
    25 MB, and the 30 layers' products took 891 ms with the copies against 866 without)."""
    cols = x.shape[1]
    if x.is_contiguous() and x.untyped_storage().nbytes() >= (x.storage_offset() + rows * cols) * x.element_size():
        return x.as_strided((rows, cols), (cols, 1))
    return torch.cat([x, x.new_zeros(rows - len(x), cols)])


def _forced(env: str, kinds: tuple[str, ...]) -> str | None:
    """The kind ``$env`` forces, or None for ``auto`` (unset); anything else is an error, not a fallback."""
    value = os.environ.get(env, "auto").strip().lower() or "auto"
    if value != "auto" and value not in kinds:
        raise ValueError(f"${env}={value!r}: expected auto, {', '.join(kinds)}")
    return None if value == "auto" else value


def _timed(
    what: str, kinds: tuple[str, ...], vary: str, fixed: dict[str, str], shape: tuple[int, int], rows: int
) -> str:
    """Which of ``kinds`` (of the Product argument ``vary``) multiplies ``rows`` x a random weight of ``shape``
    fastest here (:func:`native.timed_choice`: the first kind unless another is MARGIN faster; timed once per
    machine and torch version, kept)."""
    generator = torch.Generator().manual_seed(0)
    weight, x = torch.randn(shape, generator=generator), torch.randn(rows, shape[1], generator=generator)
    runs = {kind: functools.partial(Product(weight, None, True, **fixed, **{vary: kind}), x) for kind in kinds}
    with torch.no_grad():
        key = f"{what.replace(' ', '-')}:{shape[0]}x{shape[1]}x{rows}:{native.machine_key()}"
        return native.timed_choice(key, runs, kinds[0], what)


@functools.cache
def prefill_products() -> str:
    """How this machine multiplies float32 products of more than PACKED_ROWS rows: ``standard``
    (``F.linear``) unless oneDNN ran the trial (WHOLE_ROWS / 2 rows times a 768 x 768 weight)
    :data:`native.MARGIN` faster; ``$CBCORE_PREFILL_PRODUCTS`` forces one."""
    forced = _forced(PREFILL_ENV, PREFILL_KINDS)
    trial = ((768, 768), WHOLE_ROWS // 2)
    return forced or _timed("prefill products", PREFILL_KINDS, "prefill", {"decode": "onednn"}, *trial)


@functools.cache
def decode_products() -> str:
    """How this machine multiplies float32 products of up to EXACT_ROWS rows: ``small_gemm``
    (``small_gemm.c``) unless oneDNN ran the trial (8 rows times a 64 MiB weight: more than a cache holds,
    as a model's weights are) :data:`native.MARGIN` faster; ``$CBCORE_DECODE_PRODUCTS`` forces one. Where
    ``small_gemm.c`` cannot run, oneDNN multiplies and nothing is timed (forcing it there is an error)."""
    forced, why = _forced(DECODE_ENV, DECODE_KINDS), small_gemm_refusal(torch.zeros(2, 2))
    if forced == "small_gemm" and why is not None:
        raise ValueError(f"${DECODE_ENV}=small_gemm: small_gemm.c cannot run here: {why}")
    if forced or why is not None:
        return forced or "onednn"
    trial = ((4096, 4096), EXACT_ROWS // 2)
    return _timed("decode products", DECODE_KINDS, "decode", {"prefill": "standard"}, *trial)


def small_gemm_refusal(weight: torch.Tensor) -> str | None:
    """Why ``small_gemm.c`` cannot multiply this weight here, or None (building it on first call)."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or not weight.is_contiguous():
        return f"it multiplies contiguous CPU float32 weights, this one is {weight.dtype} on {weight.device}"
    fn, why = SMALL_GEMM.load()
    if fn is None:
        return why
    if fn(None, None, None, None, 0, 0, 0, 1) != 0:
        return "it was built for a CPU without AVX2 and FMA"
    return None


def _small_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    (m, k), n = x.shape, weight.shape[0]
    out = x.new_empty(m, n)
    SMALL_GEMM.fn(
        x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr(), m, n, k,
        torch.get_num_threads(),
    )  # fmt: skip
    return out


def padded_rows(rows: int) -> int:
    """The row count oneDNN multiplies for ``rows`` (at most :data:`WHOLE_ROWS`): few distinct ones."""
    step = 1 if rows <= EXACT_ROWS else PAD_STEP if rows <= PACKED_ROWS else PACKED_ROWS
    return -(-rows // step) * step


def warm(products: Iterable[Product], head: Product) -> tuple[int, float]:
    """Multiply every row count oneDNN will see once per weight shape: its primitives made now.

    Returns how many products ran and the seconds it took.
    """
    started = time.perf_counter()
    counts = sorted({padded_rows(n) for n in range(1, WHOLE_ROWS + 1)})
    seen: set[tuple[int, int, bool, bool]] = set()
    done = 0
    with torch.no_grad():
        for product in (*products, head):
            if product.packed is None:
                continue
            out_features, in_features = product.weight.shape
            key = (in_features, out_features, product.bias is not None, product is head)
            if key in seen:
                continue
            seen.add(key)
            for rows in counts if product is not head else [c for c in counts if c <= HEAD_WARM_ROWS]:
                product(product.weight.new_zeros(rows, in_features))
                done += 1
    return done, time.perf_counter() - started
