"""The heterogeneous fleet (issue 15 item 7): device speeds spread 10x, churn, and how busy each device was.

Speeds: volunteer i of n runs at top x 10^-((i + 0.5) / n), evenly spaced in log between 0.1x and 1x of the
top speed (a deterministic log-uniform fleet, as phones, laptops and desktops spread), so the slowest and the
fastest differ by 10^((n - 1) / n), just under 10x; the mean is about 0.39x the top speed.

Churn: `rate` of the fleet leaves per hour of the run's clock, at evenly spaced times (the first half an
interval in), each time one volunteer drawn by a seeded generator among those still connected; it drops its
connection mid-unit as a closed tab does (no goodbye, its work is lost) and a fresh volunteer (new account,
new device) of the same speed joins REJOIN_SECONDS later.

Busy fraction: a device's emulated compute time (each unit's device seconds) over its wall time, from the
start of its first unit to the end of the run or its departure; and at steady state, from the first round
planned for the whole fleet on (runner.STEADY_VERSION), without the first round's sign-in.
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass

SPREAD = 10.0  # fastest / slowest device, about
REJOIN_SECONDS = 30.0  # a leaver's replacement signs up this long after it left


def speeds(n: int, top: float) -> list[float]:
    """The fleet's emulated GFLOPS, fastest first."""
    return [round(top * SPREAD ** (-(i + 0.5) / n), 6) for i in range(n)]


@dataclass(frozen=True)
class Departure:
    at_s: float  # seconds after the clock started
    slot: int  # which of the fleet's slots leaves (its current occupant)
    rejoin_at_s: float  # when the slot's fresh volunteer joins


def churn(n: int, rate_per_hour: float, horizon_s: float, seed: int = 0) -> list[Departure]:
    """The departures of a run of `horizon_s` seconds; a slot whose occupant left is not drawn again before
    its replacement joined."""
    if rate_per_hour <= 0 or n == 0:
        return []
    interval = 3600.0 / (rate_per_hour * n)
    draw, out = random.Random(seed), list[Departure]()
    at = interval / 2
    while at < horizon_s:
        away = {d.slot for d in out if d.rejoin_at_s > at}
        present = [slot for slot in range(n) if slot not in away]
        if present:
            out.append(Departure(round(at, 3), draw.choice(present), round(at + REJOIN_SECONDS, 3)))
        at += interval
    return out


def busy_fraction(
    intervals: list[tuple[float, float]], end: float, since: float | None = None
) -> float | None:
    """Computing time over wall time from the first unit's start (or `since`, if later) to `end` (intervals:
    (start, stop) of each unit's emulated computation, clipped at `end`, and at the next unit's start: a unit
    cancelled mid-way stopped there); None if the device never computed in that window."""
    ordered = sorted((start, stop) for start, stop in intervals if start < end)
    nexts = [start for start, _ in ordered[1:]] + [end] if ordered else []
    spans = [(start, min(stop, end, after)) for (start, stop), after in zip(ordered, nexts, strict=True)]
    if since is not None:
        spans = [(max(start, since), stop) for start, stop in spans if stop > since]
    if not spans:
        return None
    first = spans[0][0]
    return sum(stop - start for start, stop in spans) / (end - first) if end > first else None


def busy_summary(fractions: list[float]) -> dict[str, float | int | None]:
    """The fleet's median and 10th percentile busy fraction."""
    if not fractions:
        return {"devices": 0, "busy_median": None, "busy_p10": None, "busy_min": None}
    ordered = sorted(fractions)
    p10 = statistics.quantiles(ordered, n=10, method="inclusive")[0] if len(ordered) > 1 else ordered[0]
    return {
        "devices": len(ordered),
        "busy_median": round(statistics.median(ordered), 4),
        "busy_p10": round(p10, 4),
        "busy_min": round(ordered[0], 4),
    }
