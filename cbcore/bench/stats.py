"""Confidence intervals over replicates: Student's t, without scipy.

A study's claim rests on replicates (the same rows on independently drawn
workloads), not on one run: each metric is reported as its mean over the
replicates and the half-width of a 95 % interval, ``mean ± t(0.975, n-1) * s /
sqrt(n)``. Two rows that ran on the same replicate workloads are compared by
their paired differences (one per replicate), whose interval is narrower than
the two rows' own intervals when both feel the same workload noise: they
differ when that interval excludes zero.

The t quantile is found by bisection on the t distribution's CDF, computed
from the regularized incomplete beta function (continued fraction, modified
Lentz's method), so no dependency beyond the standard library is needed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from functools import lru_cache
from statistics import fmean, stdev

#: The confidence level of every interval the reports show.
LEVEL = 0.95


def _betacf(a: float, b: float, x: float) -> float:
    """The continued fraction of the incomplete beta function (converges for x < (a+1)/(a+b+2))."""
    tiny, eps = 1e-300, 1e-15
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 400):
        m2 = 2 * m
        for numerator in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < eps:
            return h
    raise ArithmeticError(f"incomplete beta: no convergence for a={a}, b={b}, x={x}")


def incomplete_beta(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b)."""
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"x must be in [0, 1], got {x}")
    if x in (0.0, 1.0):
        return x
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _betacf(a, b, x) / a
    return 1.0 - math.exp(log_front) * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: int) -> float:
    """P(T <= t) for Student's t with ``df`` degrees of freedom."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    tail = 0.5 * incomplete_beta(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t > 0 else tail


@lru_cache(maxsize=256)
def t_quantile(p: float, df: int) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom (e.g. 12.706 for 0.975, 1)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must be in (0, 1), got {p}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12 * max(1.0, hi):
            break
    return 0.5 * (lo + hi)


@dataclass(frozen=True)
class Interval:
    """A mean and the half-width of its confidence interval (None with one value: no spread is known)."""

    mean: float
    half_width: float | None
    n: int

    @property
    def low(self) -> float | None:
        return None if self.half_width is None else self.mean - self.half_width

    @property
    def high(self) -> float | None:
        return None if self.half_width is None else self.mean + self.half_width

    def excludes(self, value: float) -> bool:
        """The interval lies wholly above or below ``value`` (False when its width is unknown)."""
        return self.half_width is not None and abs(self.mean - value) > self.half_width


def mean_interval(values: Seq[float], level: float = LEVEL) -> Interval:
    """Mean and Student-t half-width of ``values`` (independent replicates of one quantity)."""
    if not values:
        raise ValueError("no values to average")
    n = len(values)
    mean = fmean(values)
    if n < 2:
        return Interval(mean, None, n)
    return Interval(mean, t_quantile(0.5 + level / 2.0, n - 1) * stdev(values) / math.sqrt(n), n)


def paired_difference(a: Seq[float], b: Seq[float], level: float = LEVEL) -> Interval:
    """The interval of mean(a - b) over pairs (replicate i of ``a`` beside replicate i of ``b``)."""
    if len(a) != len(b):
        raise ValueError(f"paired values need equal counts, got {len(a)} and {len(b)}")
    return mean_interval([x - y for x, y in zip(a, b, strict=True)], level)
