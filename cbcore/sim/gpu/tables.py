"""The shipped operator tables and the one interpolation rule every measured profile uses.

``data/vidur-tables.json.gz`` is derived from Vidur's CSVs by
``scripts/build_gpu_tables.py`` (the median of each operator's timings, by
token count and tensor-parallel degree; all-reduce medians by message size).
A :class:`Curve` reproduces every measured point exactly and, between two,
never leaves the range of its neighbours, so a stretch where the
measurements rise rises in between too. Between points it follows one of two
rules, chosen by what the operator is:

* the matrix products (:data:`LINEAR_OPS`) take the value of the next
  measured token count up: a GEMM kernel pads its rows to whole tiles, so
  its time steps up just past a tile boundary (a layer's four products
  cost up to 62 % more at 136 tokens than at 128 in these tables) and is
  flat up to the next; on rows held out of the tables this halves the error
  of straight lines (1.3-1.7 % against 2.7-3.3 % mean per operator), and
  Vidur too rounds a batch's token count up (to a multiple of 8) before
  predicting;
* everything else (norms, rotary, activation, residual add, embedding, the
  all-reduce by message size) joins the points with straight lines, which
  held-out rows favour for these smooth, bandwidth-bound operations.

Below the first point a curve holds the first value (a step has at least
one token; an all-reduce at least 2 KiB); beyond the last it grows in
proportion to ``x``: the large-batch regime is compute- or bandwidth-bound,
and cutting each table at half its range and extending the rest this way
errs by 0.6-7.7 % on average over the cut-off half (the check in
:mod:`.check` prints it), better than extending the last half's slope.
"""

from __future__ import annotations

import functools
import gzip
import json
from bisect import bisect_left, bisect_right
from collections.abc import Sequence as Seq
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np

DATA = Path(__file__).parent / "data" / "vidur-tables.json.gz"
#: The operators of one layer that the tables time (``emb`` is once per step, not per layer).
LAYER_OPS = (
    "input_layernorm",
    "attn_pre_proj",
    "attn_rope",
    "attn_post_proj",
    "post_attention_layernorm",
    "mlp_up_proj",
    "mlp_act",
    "mlp_down_proj",
    "add",
)
#: The four matrix products of a layer (what the fitted roofline is checked on).
LINEAR_OPS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj")


class Curve:
    """``y(x)`` through measured points (x ascending): straight lines between (or, with ``step``, the
    next point's value), proportional beyond the last."""

    __slots__ = ("step", "x", "y")

    def __init__(self, x: Seq[float], y: Seq[float], step: bool = False) -> None:
        if len(x) != len(y) or len(x) < 2:
            raise ValueError(f"a curve needs at least two points and one y per x, got {len(x)} x, {len(y)} y")
        if any(b <= a for a, b in pairwise(x)):
            raise ValueError("a curve's x must be strictly ascending")
        self.x = [float(v) for v in x]
        self.y = [float(v) for v in y]
        self.step = step

    @property
    def top(self) -> float:
        """The largest measured x; beyond it values are extrapolated."""
        return self.x[-1]

    def at(self, x: float) -> float:
        xs, ys = self.x, self.y
        if x >= xs[-1]:
            return ys[-1] * x / xs[-1]
        if x <= xs[0]:
            return ys[0]
        if self.step:
            return ys[bisect_left(xs, x)]
        i = bisect_right(xs, x)
        x0, x1 = xs[i - 1], xs[i]
        return ys[i - 1] + (ys[i] - ys[i - 1]) * (x - x0) / (x1 - x0)

    def over(self, x: np.ndarray) -> np.ndarray:
        """:meth:`at` for many points at once."""
        x = np.asarray(x, dtype=float)
        if self.step:
            inside = np.asarray(self.y)[np.minimum(np.searchsorted(self.x, x, side="left"), len(self.x) - 1)]
        else:
            inside = np.interp(x, self.x, self.y)
        return np.where(x > self.x[-1], self.y[-1] * x / self.x[-1], inside)

    def without(self, drop: Seq[int]) -> Curve:
        """The curve rebuilt with the points at indices ``drop`` left out (for held-out checks)."""
        gone = set(drop)
        keep = [i for i in range(len(self.x)) if i not in gone]
        return Curve([self.x[i] for i in keep], [self.y[i] for i in keep], self.step)


@functools.cache
def _data() -> dict[str, Any]:
    return json.loads(gzip.decompress(DATA.read_bytes()))


def source() -> str:
    """Where the tables come from (repository and commit)."""
    return str(_data()["source"])


def measured() -> dict[tuple[str, str], list[int]]:
    """(gpu, model) -> the tensor-parallel degrees its table has."""
    return {
        tuple(key.split("/")): sorted(int(tp) for tp in by_tp)  # type: ignore[misc]
        for key, by_tp in _data()["compute"].items()
    }


def clusters() -> dict[str, list[int]]:
    """All-reduce tables: cluster (``a100_dgx``) -> the worker counts measured inside one node."""
    return {name: sorted(int(w) for w in by_w) for name, by_w in _data()["network"].items()}


def operator_curves(gpu: str, model: str, tp: int) -> dict[str, Curve]:
    """Seconds per call of every operator the table has, by token count (``emb``: once per step)."""
    table = _data()["compute"][f"{gpu}/{model}"][str(tp)]
    tokens = table["tokens"]
    return {op: Curve(tokens, [v / 1000.0 for v in ms], op in LINEAR_OPS) for op, ms in table["ops"].items()}


def allreduce_curve(cluster: str, workers: int) -> Curve:
    """Seconds of one all-reduce by message size in bytes."""
    table = _data()["network"][cluster][str(workers)]
    return Curve(table["bytes"], [v / 1000.0 for v in table["ms"]])


def held_out(n: int) -> list[int]:
    """Every fourth point, never the first or the last (so a held-out point is interpolated, not extrapolated)."""
    return [i for i in range(3, n - 1, 4)]
