"""workers/credit.py: BOINC's credit unit and recent average credit, as plain functions."""

from __future__ import annotations

import math

import pytest

from workers.credit import (
    COBBLESTONE_FLOPS,
    HALF_LIFE_DAYS,
    SECONDS_PER_DAY,
    credit_from_flops,
    decay_factor,
    decayed,
    update_average,
)

DAY = SECONDS_PER_DAY


def test_a_cobblestone_is_one_two_hundredth_of_a_day_of_a_gflops_machine() -> None:
    assert COBBLESTONE_FLOPS == 4.32e11
    one_gflops_for_a_day = 1e9 * DAY
    assert credit_from_flops(one_gflops_for_a_day) == pytest.approx(200.0)


def test_the_average_halves_in_seven_days_without_credit() -> None:
    assert HALF_LIFE_DAYS == 7
    assert decayed(avg=100.0, avg_time=0.0, now=7 * DAY) == pytest.approx(50.0)
    assert decayed(avg=100.0, avg_time=0.0, now=14 * DAY) == pytest.approx(25.0)
    assert decayed(avg=100.0, avg_time=None, now=DAY) == 0.0


def test_one_update_follows_boincs_formula() -> None:
    """avg * w + (1 - w) * credit / diff_days, w = 2^(-diff / H): here one day after an average of 10."""
    weight = 2 ** (-1 / 7)
    expected = 10 * weight + (1 - weight) * 5 / 1
    assert update_average(avg=10.0, avg_time=0.0, credit=5.0, now=DAY) == pytest.approx(expected, rel=1e-12)


def test_a_steady_rate_converges_to_that_rate_in_credit_per_day() -> None:
    """A machine earning 200 credit a day, granted every hour for ten weeks: its average is 200 a day."""
    avg, at = 0.0, None
    for hour in range(1, 24 * 70 + 1):
        now = hour * 3600.0
        avg, at = update_average(avg=avg, avg_time=at, credit=200 / 24, now=now), now
    assert avg == pytest.approx(200.0, rel=0.01)


def test_short_intervals_use_the_limit_and_agree_with_the_formula_around_the_switch() -> None:
    """Under about a second the quotient is replaced by its limit ln 2 * credit / H_days; either side of the
    switch gives the same average to the precision the formula has there."""
    first = update_average(avg=0.0, avg_time=None, credit=7.0, now=1000.0)
    assert first == pytest.approx(math.log(2) * 7.0 / 7.0)
    threshold = 1e-6 * HALF_LIFE_DAYS * DAY / math.log(2)
    below = update_average(avg=3.0, avg_time=0.0, credit=2.0, now=threshold * 0.99)
    above = update_average(avg=3.0, avg_time=0.0, credit=2.0, now=threshold * 1.01)
    assert below == pytest.approx(above, rel=1e-5)
    assert below == pytest.approx(3.0 + math.log(2) * 2.0 / 7.0, rel=1e-5)


def test_a_grant_stamped_before_the_last_update_is_not_decayed_backwards() -> None:
    late = update_average(avg=3.0, avg_time=100.0, credit=2.0, now=99.0)
    assert late == pytest.approx(3.0 + math.log(2) * 2.0 / 7.0)


def test_ancient_averages_decay_to_tiny_finite_values_not_an_underflow() -> None:
    factor = decay_factor(age_seconds=1e12)
    assert 0.0 < factor < 1e-200
    assert decay_factor(age_seconds=-5.0) == 1.0
