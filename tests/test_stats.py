"""Confidence intervals: Student's t quantiles, coverage on a known distribution, paired differences."""

from __future__ import annotations

import random

import pytest

from cbcore.bench.stats import incomplete_beta, mean_interval, paired_difference, t_cdf, t_quantile

# Published two-sided 95 % critical values of Student's t (df: t_0.975).
T_TABLE = {1: 12.7062, 2: 4.3027, 3: 3.1824, 4: 2.7764, 5: 2.5706, 9: 2.2622, 19: 2.0930, 29: 2.0452, 120: 1.9799}


@pytest.mark.parametrize(("df", "expected"), sorted(T_TABLE.items()))
def test_t_quantiles_match_the_published_table(df: int, expected: float) -> None:
    assert t_quantile(0.975, df) == pytest.approx(expected, abs=5e-5)
    assert t_quantile(0.025, df) == pytest.approx(-expected, abs=5e-5)
    assert t_cdf(expected, df) == pytest.approx(0.975, abs=1e-5)


def test_incomplete_beta_edges_and_symmetry() -> None:
    assert incomplete_beta(2.0, 3.0, 0.0) == 0.0 and incomplete_beta(2.0, 3.0, 1.0) == 1.0
    assert incomplete_beta(1.0, 1.0, 0.3) == pytest.approx(0.3)  # uniform
    assert incomplete_beta(2.5, 1.5, 0.4) == pytest.approx(1 - incomplete_beta(1.5, 2.5, 0.6))
    with pytest.raises(ValueError, match="x must be in"):
        incomplete_beta(1.0, 1.0, 1.5)


@pytest.mark.parametrize("n", [3, 5, 10])
def test_95_percent_intervals_cover_the_true_mean_95_percent_of_the_time(n: int) -> None:
    """1,000 synthetic studies of n replicates from N(3, 2^2): the interval must hold 3 in 93-97 % of them.

    A z interval (1.96 instead of t) covers only 81 % at n=3, 88 % at n=5 and 92 %
    at n=10; a half-width without sqrt(n), or from the wrong degrees of freedom, misses too.
    """
    rng = random.Random(20240652 + n)
    covered = sum(mean_interval([rng.gauss(3.0, 2.0) for _ in range(n)]).excludes(3.0) is False for _ in range(1000))
    assert 930 <= covered <= 970, covered


def test_one_value_has_no_interval_and_pairs_must_match() -> None:
    one = mean_interval([4.0])
    assert (one.mean, one.half_width, one.excludes(0.0)) == (4.0, None, False)
    with pytest.raises(ValueError, match="no values"):
        mean_interval([])
    with pytest.raises(ValueError, match="equal counts"):
        paired_difference([1.0, 2.0], [1.0])


def test_paired_differences_see_a_shift_that_the_rows_own_intervals_hide() -> None:
    """Two rows on the same replicate workloads: a constant +1 shift over large workload noise."""
    rng = random.Random(7)
    base = [rng.gauss(100.0, 20.0) for _ in range(5)]
    a, b = [x + 1.0 + rng.gauss(0.0, 0.1) for x in base], base
    ia, ib = mean_interval(a), mean_interval(b)
    assert ia.low < ib.high and ib.low < ia.high  # the rows' intervals overlap widely
    diff = paired_difference(a, b)
    assert diff.mean == pytest.approx(1.0, abs=0.2) and diff.excludes(0.0)
