"""BOINC's credit conventions as plain functions (no Django): the unit and the recent average credit.

The unit is BOINC's Cobblestone: 1/200 of a day of a machine doing 1 GFLOPS, i.e. 4.32e11 FLOPs. Crowdtrain
counts FLOPs on the server (flops_per_sample x samples of each accepted result); credit is that count over
COBBLESTONE_FLOPS.

The recent average credit ("RAC", expavg_credit) is credit per day, averaged with an exponential weight of
half-life 7 days, exactly as BOINC's update_average (lib/util.cpp): when `credit` is granted at `now` to an
average `avg` last updated at `avg_time`,

    diff   = now - avg_time                      (seconds, never below 0)
    weight = exp(-diff * ln 2 / H)               (H = the half-life in seconds)
    avg    = avg * weight + (1 - weight) * credit / diff_days

i.e. the new credit is taken as done at an even rate since the last update. For a short diff (1 - weight
under 1e-6, under a second at H = 7 days) the quotient loses its precision and BOINC uses its limit as diff
goes to 0: avg = avg * weight + ln 2 * credit / H_days. The first grant (no avg_time yet) takes that same
limit, so a volunteer's first result counts as much as any later one. Between grants the stored value only
decays: shown at time t, it is avg * exp(-(t - avg_time) * ln 2 / H) (see docs/credit.md).
"""

from __future__ import annotations

import math

SECONDS_PER_DAY = 86400.0
# BOINC's Cobblestone: 1/200 day of a 1-GFLOPS machine.
COBBLESTONE_FLOPS = SECONDS_PER_DAY * 1e9 / 200  # 4.32e11
HALF_LIFE_DAYS = 7.0
HALF_LIFE_SECONDS = HALF_LIFE_DAYS * SECONDS_PER_DAY
# Below this, (1 - weight) / diff_days loses its precision: BOINC switches to its limit.
TINY = 1e-6
# exp() of less than this underflows a double; PostgreSQL raises on it rather than return 0.
MIN_EXPONENT = -600.0


def credit_from_flops(flops: float) -> float:
    """FLOPs to Cobblestones."""
    return flops / COBBLESTONE_FLOPS


def decay_factor(*, age_seconds: float) -> float:
    """How much of an average `age_seconds` old is left: exp(-age * ln 2 / H), 1 for an age below 0."""
    exponent = -max(0.0, age_seconds) * math.log(2) / HALF_LIFE_SECONDS
    return math.exp(max(exponent, MIN_EXPONENT))


def decayed(*, avg: float, avg_time: float | None, now: float) -> float:
    """The stored average as it stands at `now` (times are unix seconds)."""
    if avg_time is None:
        return 0.0
    return avg * decay_factor(age_seconds=now - avg_time)


def update_average(*, avg: float, avg_time: float | None, credit: float, now: float) -> float:
    """The average after `credit` is granted at `now` (BOINC's update_average); the caller stores `now` as
    the new avg_time. Times are unix seconds, credit in Cobblestones, the average in credit per day."""
    if avg_time is None:
        avg, diff = 0.0, 0.0
    else:
        diff = max(0.0, now - avg_time)
    weight = decay_factor(age_seconds=diff)
    if 1.0 - weight > TINY:
        return avg * weight + (1.0 - weight) * credit / (diff / SECONDS_PER_DAY)
    return avg * weight + math.log(2) * credit / HALF_LIFE_DAYS
