"""A step-time model fitted to steps timed on this machine.

``t = g(tokens) + a * attn_pairs + k * keys_read + b * sampled_rows + c * sequences``,
where ``g`` is piecewise linear in the step's token count with a knot at every
width the profile measured. The knots are what lets the model follow a CPU
BLAS whose cost is not monotone in the number of rows (2-3 rows can cost more
than 4 here). Attention has two terms because it has two regimes: a prompt's
queries against its keys is compute (``attn_pairs``, query x key products),
while a decode row reads each of its keys once from the paged cache for one
query, which is memory traffic (``keys_read``); one per-pair price cannot fit
both, and a fit with only the first priced a 2,048-key decode row like a
16-key one. The rest are the LM head and per-sequence host work. Coefficients are fitted by non-negative least squares on relative
error, so short steps weigh as much as long ones, then scaled so that the
timed steps' predicted total equals their measured total: on a machine whose
step times are noisy, a fit of relative errors alone predicts the typical step
and undershoots the mean, and durations and latencies are sums of steps.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, NonNegativeFloat

from cbcore.sim.shape import StepShape


class FitError(BaseModel):
    """How well the model reproduces the timed steps (relative errors, as fractions)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_steps: int
    mean_abs: float = Field(description="Mean |predicted - measured| / measured over the fitted steps.")
    p90_abs: float
    max_abs: float
    holdout_mean_abs: float | None = Field(
        None, description="The same over every 5th step, left out of the fit."
    )
    holdout_total_time: float | None = Field(
        None, description="Sum of predicted over sum of measured times of the held-out steps, minus 1."
    )


class FittedCost(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["fitted"] = "fitted"
    knots: list[int] = Field(description="Token counts at which g is given (ascending).")
    knot_s: list[NonNegativeFloat] = Field(description="g at each knot, seconds.")
    per_attn_pair_s: NonNegativeFloat
    per_kv_token_s: NonNegativeFloat = Field(0.0, description="Per key read from the cache (0 in older profiles).")
    per_sample_s: NonNegativeFloat
    per_seq_s: NonNegativeFloat
    fit: FitError
    steps: list[tuple[int, int, int, int, int, int, float]] | None = Field(
        None,
        description="The timed steps: (sequences, prefill tokens, decode tokens, attention pairs, keys read, "
        "sampled rows, seconds), so the fit can be checked or redone.",
    )

    def step_time(self, shape: StepShape) -> float:
        tokens = shape.num_tokens
        if tokens > self.knots[-1]:  # proportional beyond the widest step measured
            g = self.knot_s[-1] * tokens / self.knots[-1]
        else:
            g = float(np.interp(tokens, self.knots, self.knot_s))
        return (
            g
            + self.per_attn_pair_s * shape.attn_pairs
            + self.per_kv_token_s * shape.kv_tokens
            + self.per_sample_s * shape.num_samples
            + self.per_seq_s * shape.num_seqs
        )


def _design(shapes: Seq[StepShape], knots: Seq[int]) -> np.ndarray:
    tokens = np.array([s.num_tokens for s in shapes], dtype=float)
    cols = []
    for j, k in enumerate(knots):  # hat functions: g(T) = sum_j g_j * hat_j(T)
        hat = np.zeros_like(tokens)
        if j > 0:
            lo = knots[j - 1]
            rising = (tokens >= lo) & (tokens <= k)
            hat[rising] = (tokens[rising] - lo) / (k - lo)
        else:
            hat[tokens <= k] = 1.0
        if j + 1 < len(knots):
            hi = knots[j + 1]
            falling = (tokens > k) & (tokens < hi)
            hat[falling] = (hi - tokens[falling]) / (hi - k)
        else:
            hat[tokens > k] = tokens[tokens > k] / k  # proportional beyond the last knot
        cols.append(hat)
    cols.append(np.array([s.attn_pairs for s in shapes], dtype=float))
    cols.append(np.array([s.kv_tokens for s in shapes], dtype=float))
    cols.append(np.array([s.num_samples for s in shapes], dtype=float))
    cols.append(np.array([s.num_seqs for s in shapes], dtype=float))
    return np.stack(cols, axis=1)


def nnls(a: np.ndarray, b: np.ndarray, iterations: int = 200) -> np.ndarray:
    """Non-negative least squares (Lawson-Hanson active set)."""
    n = a.shape[1]
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    for _ in range(iterations):
        w = a.T @ (b - a @ x)
        candidates = ~passive & (w > 1e-12 * max(1.0, np.abs(w).max()))
        if not candidates.any():
            break
        passive[np.argmax(np.where(candidates, w, -np.inf))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            bad = passive & (z <= 0)
            alpha = np.min(x[bad] / (x[bad] - z[bad]))
            x = x + alpha * (z - x)
            passive &= x > 1e-15
    return x


def supported_knots(knots: Seq[int], widths: Seq[int]) -> list[int]:
    """The knots the timed steps determine: none past the widest step, none without a step beside it.

    A knot no timed step lies beside has an all-zero column in the fit, so the
    solver sets it to 0 s: a grid knot past the widest step measured (the
    profiler's grid names widths its request groups never reach) then drags
    ``g`` to 0 there, and steps wider than that (several recomputed prompts
    at once, past capacity) were priced as almost free. So the widest step
    measured is the last knot (steps past it are priced in proportion to it),
    and a knot with no step strictly between its neighbours is dropped.
    """
    top = max(widths)
    kept = sorted({k for k in knots if 0 < k < top} | {top})
    tokens = np.array(widths)
    while len(kept) > 1:
        empty = [
            j for j, k in enumerate(kept)
            if not ((tokens > (kept[j - 1] if j else 0)) & (tokens < (kept[j + 1] if j + 1 < len(kept) else top + 1))).any()
        ]
        if not empty:
            break
        del kept[empty[0]]
    return kept


def fit_cost(shapes: Seq[StepShape], times: Seq[float], knots: Seq[int]) -> FittedCost:
    """Fit on 4 of every 5 steps, report the error on all of them and on the 5th left out."""
    if len(shapes) != len(times) or len(shapes) < 8:
        raise ValueError(f"need at least 8 timed steps to fit a cost model, got {len(shapes)}")
    knots = supported_knots(knots, [s.num_tokens for s in shapes])
    y = np.array(times, dtype=float)
    x = _design(shapes, knots)
    # Scale columns so the solver sees comparable magnitudes; weight rows by 1/y (relative error).
    scale = np.maximum(np.abs(x).max(axis=0), 1e-12)
    train = np.arange(len(y)) % 5 != 4
    coef = _solve(x[train] / scale, y[train])
    held_pred = x[~train] / scale @ coef
    held = _errors(held_pred, y[~train])
    coef = _solve(x / scale, y)  # the model kept uses every step
    pred = x / scale @ coef
    err = _errors(pred, y)
    coef = coef / scale
    k = len(knots)
    return FittedCost(
        knots=list(knots),
        knot_s=[float(v) for v in coef[:k]],
        per_attn_pair_s=float(coef[k]),
        per_kv_token_s=float(coef[k + 1]),
        per_sample_s=float(coef[k + 2]),
        per_seq_s=float(coef[k + 3]),
        fit=FitError(
            num_steps=len(y),
            mean_abs=float(err.mean()),
            p90_abs=float(np.quantile(err, 0.9)),
            max_abs=float(err.max()),
            holdout_mean_abs=float(held.mean()) if held.size else None,
            holdout_total_time=float(held_pred.sum() / y[~train].sum() - 1.0) if held.size else None,
        ),
        steps=[
            (
                s.num_seqs,
                s.prefill_tokens,
                s.decode_tokens,
                s.attn_pairs,
                s.kv_tokens,
                s.num_samples,
                float(t),
            )
            for s, t in zip(shapes, times, strict=True)
        ],
    )


def refit(*costs: FittedCost) -> FittedCost:
    """The timed steps of one or more profiles, fitted (again) with this version's model form.

    Several profiles of the same machine taken at different times fit one model
    over all their steps: where the machine's speed drifts over minutes (a
    shared host), a profile from one window carries that window's speed, and
    profiles taken before and after a run bracket it.
    """
    if not costs or any(not c.steps for c in costs):
        raise ValueError("a profile to fit again carries no timed steps")
    steps = [step for c in costs for step in c.steps]  # type: ignore[union-attr]
    shapes = [
        StepShape(num_seqs=n, prefill_tokens=p, decode_tokens=d, attn_pairs=a, kv_tokens=k, sample_rows=tuple(range(r)))
        for n, p, d, a, k, r, _ in steps
    ]
    return fit_cost(shapes, [t for *_, t in steps], sorted({k for c in costs for k in c.knots}))


def _solve(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    w = 1.0 / y
    coef = nnls(x * w[:, None], y * w)
    total = (x @ coef).sum()
    return coef * (y.sum() / total) if total > 0 else coef


def _errors(pred: np.ndarray, y: np.ndarray) -> np.ndarray:
    return np.abs(pred - y) / y
