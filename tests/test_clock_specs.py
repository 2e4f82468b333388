"""The benchmark's clocks at their edges: where a virtual clock starts, a zero-cost step, sub-second waits."""

from __future__ import annotations

import math

import pytest

from cbcore.bench.driver import VirtualClock, WallClock


def test_a_virtual_clock_starts_at_zero_and_a_step_that_costs_nothing_leaves_it_there() -> None:
    clock = VirtualClock()
    assert clock() == 0.0
    clock.advance(0.0)
    assert clock() == 0.0
    clock.advance(0.25)
    assert clock() == 0.25


@pytest.mark.parametrize("seconds", [-1e-9, -1.0, math.nan])
def test_a_virtual_clock_refuses_to_go_back_or_to_advance_by_a_non_number(seconds: float) -> None:
    clock = VirtualClock(3.0)
    with pytest.raises(ValueError, match="the clock cannot go back"):
        clock.advance(seconds)
    assert clock() == 3.0


def test_the_wall_clock_sleeps_exactly_until_a_future_time_and_not_at_all_for_now_or_the_past() -> None:
    slept: list[float] = []
    clock = WallClock(lambda: 10.0, slept.append)
    clock.wait_until(10.5)
    clock.wait_until(10.0)
    clock.wait_until(9.0)
    assert slept == [0.5]
