"""Checking a roofline against published per-operator GPU timings.

The reference is Vidur's profile of Llama-2-7B on one H100 (MIT licence; the
linear-layer columns are kept in ``tests/data/h100-llama-2-7b-linear.csv``):
the median time of the fused QKV, output, fused gate+up and down projections
of one layer, for 1 to 4096 tokens. :func:`check_linear` prices the same four
products with :func:`cbcore.sim.roofline.linear_time_per_layer` and reports
the relative errors; ``scripts/fit_roofline.py`` finds the FLOP/s and
bandwidth efficiencies that minimise them, which is how the shipped Hopper
profiles got theirs.
"""

from __future__ import annotations

import csv
import itertools
from pathlib import Path
from statistics import fmean, median

from cbcore.sim.model_shape import ModelShape
from cbcore.sim.roofline import Hardware, linear_time_per_layer

LLAMA_2_7B = ModelShape(
    name="Llama-2-7B",
    num_layers=32,
    hidden_size=4096,
    intermediate_size=11008,
    num_heads=32,
    num_kv_heads=32,
    head_dim=128,
    vocab_size=32000,
    max_position_embeddings=4096,
)


def load_linear(path: str | Path) -> list[tuple[int, float]]:
    """(tokens, seconds of the four linear products of one layer) per line."""
    rows = []
    with open(path, newline="") as fh:
        for rec in csv.DictReader(fh):
            ms = sum(float(v) for k, v in rec.items() if k.endswith("_ms"))
            rows.append((int(rec["num_tokens"]), ms / 1000.0))
    if not rows:
        raise ValueError(f"{path}: no timings")
    return rows


def check_linear(hw: Hardware, model: ModelShape, timings: list[tuple[int, float]]) -> dict[str, float]:
    """Relative errors of the roofline against the measured times (fractions)."""
    errors = [abs(linear_time_per_layer(hw, model, n, 2) - t) / t for n, t in timings]
    small = [e for (n, _), e in zip(timings, errors, strict=True) if n <= 64]
    return {
        "mean_abs": fmean(errors),
        "median_abs": median(errors),
        "max_abs": max(errors),
        "mean_abs_upto_64_tokens": fmean(small) if small else float("nan"),
        "points": len(errors),
    }


def fit_efficiencies(hw: Hardware, model: ModelShape, timings: list[tuple[int, float]]) -> Hardware:
    """The (FLOP/s, bandwidth) efficiencies on a 2 % grid with the smallest mean relative error."""
    grid = [i / 100 for i in range(30, 101, 2)]
    best = min(
        itertools.product(grid, grid),
        key=lambda fb: check_linear(
            hw.model_copy(update={"flops_efficiency": fb[0], "bandwidth_efficiency": fb[1]}), model, timings
        )["mean_abs"],
    )
    return hw.model_copy(update={"flops_efficiency": best[0], "bandwidth_efficiency": best[1]})
