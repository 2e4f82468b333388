"""Linear layers computed the way this machine is fast at, for the row counts a step carries.

``F.linear(x, W)`` asks the BLAS for ``x @ W.T`` (rows x in, times in x out).
With few rows (a decode step of 1-16 sequences) some CPU BLAS builds pick a
poor kernel for that shape: on a 2-core AVX2 machine with MKL, 3 rows cost
about 2x one row although both stream the same weights. Two other orders
compute the same numbers:

* ``transposed``: ``(W @ x.T).T``, the weight as the left operand in the
  layout it already has (no copy of the weights, only the ``[rows, out]``
  result is made contiguous again);
* ``skinny``: cbcore's own kernel (:mod:`cbcore.execution.skinny_linear`),
  which streams each weight row once and dots it with every input row; on
  that machine 1-16 rows then cost what reading the weights costs.

Which order wins depends on the BLAS, the core and the row count, so it is
measured (:func:`calibrate`: every order over enough of the model's own
weights to stream them from memory, as a forward does, at each row count of
interest, interleaved), remembered per machine and model
(:mod:`cbcore.execution.linear_cache`), and looked up by row count on every
call (a count between two calibrated ones takes the larger's choice). The
other orders are used only inside an engine forward
(:meth:`LinearRouter.active`): the model object stays a plain HF model for
anyone else using it, ``generate()`` included.

All orders compute the same dot products in fp32; they sum them in different
orders (last-bit differences), which the equivalence tests cover like any
other change of batch shape.
"""

from __future__ import annotations

import bisect
import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Literal, get_args

import torch
import torch.nn.functional as F
from torch import nn

from cbcore.execution import skinny_linear as skinny
from cbcore.execution.linear_cache import calibration_key, load_choice, store_choice
from cbcore.log import get_logger

log = get_logger(__name__)

LinearOrder = Literal["standard", "transposed", "skinny"]
LinearLayout = Literal["auto", "standard", "transposed", "skinny"]
#: ``cached``: use the choice remembered for this machine and model, measuring only if there is none;
#: ``fresh``: measure now and remember the result.
Calibration = Literal["cached", "fresh"]
#: Row counts calibrated; a step with more rows than the largest uses the largest's choice.
CALIBRATED_ROWS = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64)
#: Another order must beat the standard one by this factor to be chosen.
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
        #: calibrated row count -> order, for the counts that do not run the standard order
        self.orders: dict[int, LinearOrder] = {}
        self.source = "fixed"  # or "measured" (in this process) or "cached" (by an earlier one)
        self._active = False
        device = self.modules[0].weight.device if self.modules else None
        if layout in ("transposed", "skinny"):
            if layout == "skinny":
                _require_skinny(self.modules)
            self.orders = dict.fromkeys(CALIBRATED_ROWS, layout)
        elif layout == "auto" and device is not None and device.type == "cpu":
            self.orders, self.source = _calibrated(self.modules, _candidates(self.modules), calibration)
        self._by_rows = [self.orders.get(_calibrated_at_or_above(r), "standard") for r in range(CALIBRATED_ROWS[-1] + 1)]
        for module in self.modules:
            if self.orders:
                module.forward = _routed_forward(module, self)  # type: ignore[method-assign]
            else:  # back to the class's own forward (an earlier router may have routed it)
                module.__dict__.pop("forward", None)
        log.info("linear layout", orders={r: self.orders[r] for r in sorted(self.orders)}, source=self.source)

    def order_for(self, rows: int) -> LinearOrder:
        if not self._active or rows < 1:
            return "standard"
        return self._by_rows[min(rows, CALIBRATED_ROWS[-1])]

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


PRODUCTS: dict[LinearOrder, Callable[..., torch.Tensor]] = {
    "standard": F.linear,
    "transposed": transposed_linear,
    "skinny": skinny.skinny_linear,
}


def _calibrated_at_or_above(rows: int) -> int:
    return CALIBRATED_ROWS[min(bisect.bisect_left(CALIBRATED_ROWS, rows), len(CALIBRATED_ROWS) - 1)]


def _routed_forward(module: nn.Linear, router: LinearRouter):
    def forward(x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        return PRODUCTS[router.order_for(rows)](x, module.weight, module.bias)

    return forward


def _skinny_refusal(modules: list[nn.Linear]) -> str | None:
    """Why the skinny kernel cannot run these layers, or None."""
    unsupported = next((m for m in modules if not skinny.supports(m.weight)), None)
    if unsupported is not None:
        w = unsupported.weight
        return f"it multiplies contiguous CPU float32 weights only, this model has {w.dtype} on {w.device}"
    return skinny.unavailable_reason()


def _require_skinny(modules: list[nn.Linear]) -> None:
    reason = _skinny_refusal(modules)
    if reason is not None:
        raise ValueError(f"execution.linear_layout 'skinny' cannot run here: {reason}")


def _candidates(modules: list[nn.Linear]) -> tuple[LinearOrder, ...]:
    """The orders worth timing against the standard one on this model."""
    reason = _skinny_refusal(modules)
    if reason is None:
        return ("transposed", "skinny")
    if all(skinny.supports(m.weight) for m in modules):  # it would apply; only the kernel is missing
        log.warning("skinny linear kernel unavailable; calibrating the BLAS orders only", reason=reason)
    return ("transposed",)


def _calibrated(
    modules: list[nn.Linear], candidates: tuple[LinearOrder, ...], calibration: Calibration
) -> tuple[dict[int, LinearOrder], str]:
    method = f"rows {list(CALIBRATED_ROWS)} margin {MARGIN} bytes {CALIBRATION_BYTES} orders {','.join(candidates)}"
    key = calibration_key(modules, method)
    if calibration == "cached":
        orders = load_choice(key, candidates)
        if orders is not None:
            return orders, "cached"
    orders = calibrate(modules, candidates)
    store_choice(key, orders)
    return orders, "measured"


@torch.inference_mode()
def calibrate(
    modules: list[nn.Linear], candidates: tuple[LinearOrder, ...] = ("transposed",), rounds: int = 5
) -> dict[int, LinearOrder]:
    """For each calibrated row count, the candidate clearly faster than the standard order here, if any.

    Times every order over the model's first layers, in model order, until
    :data:`CALIBRATION_BYTES` of weights are covered. A forward streams every
    weight from memory once; a handful of matrices that stay in the CPU's
    caches do not show the BLAS's weak shapes (timed that way, the standard
    order looked as fast at every row count, while over the whole model the
    transposed one costs half as much at 3 rows). Each round times the orders
    back to back and the decision takes the median of the rounds' ratios to
    the standard order, so a machine whose speed drifts (a shared host) moves
    both sides of a ratio alike.
    """
    unknown = set(candidates) - set(get_args(LinearOrder))
    if unknown:
        raise ValueError(f"calibrate: unknown linear orders {sorted(unknown)}")
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

    chosen: dict[int, LinearOrder] = {}
    timed: tuple[LinearOrder, ...] = ("standard", *candidates)
    for rows in CALIBRATED_ROWS:
        inputs = {m.in_features: torch.randn(rows, m.in_features, dtype=m.weight.dtype) for m in sample}
        for order in timed:  # first-call costs (allocations, set-up) untimed
            _pass_seconds(PRODUCTS[order], sample, inputs, clock)
        ratios: dict[LinearOrder, list[float]] = {order: [] for order in candidates}
        for _ in range(rounds):
            seconds = {order: _pass_seconds(PRODUCTS[order], sample, inputs, clock) for order in timed}
            for order in candidates:
                ratios[order].append(seconds[order] / seconds["standard"])
        best = min(candidates, key=lambda order: statistics.median(ratios[order]))
        if statistics.median(ratios[best]) < MARGIN:
            chosen[rows] = best
    return chosen


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
