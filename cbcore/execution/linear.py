"""Linear layers in the product order the BLAS is fast at, for the row counts a step carries.

``F.linear(x, W)`` asks the BLAS for ``x @ W.T`` (rows x in, times in x out).
With few rows (a decode step of 2-8 sequences) some CPU BLAS builds pick a
poor kernel for that shape: on a 2-core AVX2 machine with MKL, 3 rows cost
about 2x one row although both stream the same weights. The same numbers
computed as ``(W @ x.T).T`` — the weight as the left operand, in the layout
it already has — avoid that: no copy of the weights, only the ``[rows, out]``
result is made contiguous again.

Which order wins depends on the BLAS, the core and the row count, so it is
measured (:func:`calibrate`: both orders over enough of the model's own
weights to stream them from memory, as a forward does, at each row count of
interest, interleaved), remembered per machine and model
(:mod:`cbcore.execution.linear_cache`), and looked up by row count on every
call. The alternative order is used only
inside an engine forward (:meth:`LinearRouter.active`): the model object stays
a plain HF model for anyone else using it, ``generate()`` included.

Both orders compute the same dot products in fp32; they may sum them in a
different order (last-bit differences), which the equivalence tests cover
like any other change of batch shape.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from cbcore.execution.linear_cache import calibration_key, load_choice, store_choice
from cbcore.log import get_logger

log = get_logger(__name__)

LinearLayout = Literal["auto", "standard", "transposed"]
#: ``cached``: use the choice remembered for this machine and model, measuring only if there is none;
#: ``fresh``: measure now and remember the result.
Calibration = Literal["cached", "fresh"]
#: Row counts calibrated; a step with more rows than the largest uses the larger's choice.
CALIBRATED_ROWS = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64)
#: The transposed order must beat the standard one by this factor to be chosen.
MARGIN = 0.95
#: Weights each calibration pass reads: well beyond a CPU's caches, as in a forward.
CALIBRATION_BYTES = 64 * 2**20


class LinearRouter:
    """Owns the per-row-count choice and the modules it applies to.

    One router per model and layout (:meth:`for_model`): engines built one
    after another on the same model share its calibration.
    """

    @classmethod
    def for_model(
        cls, model: nn.Module, layout: LinearLayout = "auto", calibration: Calibration = "cached"
    ) -> LinearRouter:
        router = getattr(model, "_cbcore_linear_router", None)
        # "fresh" asks for a measurement in this process; one made here already is one.
        fresh_enough = calibration == "cached" or (router is not None and router.source == "measured")
        if router is None or router.layout != layout or not fresh_enough:
            router = cls(model, layout, calibration)
            model._cbcore_linear_router = router  # type: ignore[assignment]
        return router

    def __init__(self, model: nn.Module, layout: LinearLayout = "auto", calibration: Calibration = "cached") -> None:
        self.layout = layout
        self.modules = [m for m in model.modules() if type(m) is nn.Linear]
        self.transposed_rows: frozenset[int] = frozenset()
        self.above_max = False  # choice for row counts beyond CALIBRATED_ROWS
        self.source = "fixed"  # or "measured" (in this process) or "cached" (by an earlier one)
        self._active = False
        device = self.modules[0].weight.device if self.modules else None
        if layout == "transposed":
            self.transposed_rows, self.above_max = frozenset(CALIBRATED_ROWS), True
        elif layout == "auto" and device is not None and device.type == "cpu":
            self.transposed_rows, self.source = _calibrated(self.modules, calibration)
            self.above_max = max(CALIBRATED_ROWS) in self.transposed_rows
        for module in self.modules:
            if self.transposed_rows:
                module.forward = _routed_forward(module, self)  # type: ignore[method-assign]
            else:  # back to the class's own forward (an earlier router may have routed it)
                module.__dict__.pop("forward", None)
        log.info("linear layout", transposed_rows=sorted(self.transposed_rows), source=self.source)

    def uses_transposed(self, rows: int) -> bool:
        if not self._active:
            return False
        if rows > CALIBRATED_ROWS[-1]:
            return self.above_max
        return rows in self.transposed_rows

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        self._active = True
        try:
            yield
        finally:
            self._active = False


def transposed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` computed as ``(W @ x.T).T`` (made contiguous)."""
    flat = x.reshape(-1, x.shape[-1])
    out = torch.mm(weight, flat.t()).t().contiguous()
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], weight.shape[0])


def _routed_forward(module: nn.Linear, router: LinearRouter):
    def forward(x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if router.uses_transposed(rows):
            return transposed_linear(x, module.weight, module.bias)
        return F.linear(x, module.weight, module.bias)

    return forward


def _calibrated(modules: list[nn.Linear], calibration: Calibration) -> tuple[frozenset[int], str]:
    key = calibration_key(modules, f"rows {list(CALIBRATED_ROWS)} margin {MARGIN} bytes {CALIBRATION_BYTES}")
    if calibration == "cached":
        rows = load_choice(key)
        if rows is not None:
            return rows, "cached"
    rows = calibrate(modules)
    store_choice(key, rows)
    return rows, "measured"


@torch.inference_mode()
def calibrate(modules: list[nn.Linear], rounds: int = 5) -> frozenset[int]:
    """Row counts at which the transposed order is clearly faster on this machine.

    Times both orders over the model's first layers, in model order, until
    :data:`CALIBRATION_BYTES` of weights are covered. A forward streams every
    weight from memory once; a handful of matrices that stay in the CPU's
    caches do not show the BLAS's weak shapes (timed that way, the standard
    order looked as fast at every row count, while over the whole model the
    transposed one costs half as much at 3 rows). Each round times the two
    orders back to back and the decision takes the median of the rounds'
    ratios, so a machine whose speed drifts (a shared host) moves both sides
    of a ratio alike.
    """
    sample: list[nn.Linear] = []
    size = 0
    for m in modules:
        sample.append(m)
        size += m.weight.numel() * m.weight.element_size()
        if size >= CALIBRATION_BYTES:
            break
    # With one thread, CPU time of this thread is what the product costs, and it is far less
    # disturbed by other processes on a shared machine than wall time.
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter

    chosen = set()
    for rows in CALIBRATED_ROWS:
        inputs = {m.in_features: torch.randn(rows, m.in_features, dtype=m.weight.dtype) for m in sample}
        for product in (F.linear, transposed_linear):  # first-call costs (allocations, set-up) untimed
            _pass_seconds(product, sample, inputs, clock)
        ratios = [
            _pass_seconds(transposed_linear, sample, inputs, clock) / _pass_seconds(F.linear, sample, inputs, clock)
            for _ in range(rounds)
        ]
        if statistics.median(ratios) < MARGIN:
            chosen.add(rows)
    return frozenset(chosen)


def _pass_seconds(
    product: Callable[..., torch.Tensor],
    sample: list[nn.Linear],
    inputs: dict[int, torch.Tensor],
    clock: Callable[[], float],
) -> float:
    t0 = clock()
    for m in sample:
        product(inputs[m.in_features], m.weight, m.bias)
    return max(clock() - t0, 1e-9)
