"""Reading learning curves: which way is better, when a curve reached a level, an ETA to the project's target,
and the platform-against-one-CPU comparison the project page states. Plain Python, no database."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

ETA_WINDOW = 8  # evaluations the ETA's straight line is fitted through
ETA_MIN_POINTS = 3
ETA_MAX_SECONDS = 30 * 86400.0  # beyond a month at the current rate: no promise
SAME_SPEED = 1.1  # within 10% of each other: "about as fast"


@dataclass(frozen=True)
class Point:
    seconds: float
    samples: int
    value: float


@dataclass(frozen=True)
class Eta:
    seconds: float | None
    reason: str  # shown when seconds is None, or how it was estimated


@dataclass(frozen=True)
class Comparison:
    statement: str
    level: float | None = None  # the metric value both times are measured to
    platform: Point | None = None  # where each curve first reached `level`
    baseline: Point | None = None
    factor: float | None = None  # baseline time / platform time: > 1 means the platform was faster


def higher_is_better(metric: str) -> bool:
    return "accuracy" in metric


def reached(*, metric: str, value: float, target: float) -> bool:
    return value >= target if higher_is_better(metric) else value <= target


def first_reaching(points: Sequence[Point], *, metric: str, level: float) -> Point | None:
    return next((p for p in points if reached(metric=metric, value=p.value, target=level)), None)


def label(metric: str, value: float) -> str:
    return (
        f"{value:.1%} {metric.replace('_', ' ')}"
        if higher_is_better(metric)
        else f"{metric.replace('_', ' ')} {value:.3g}"
    )


def duration(seconds: float) -> str:
    """1.2 s, 45 s, 3 min 20 s, 2 h 05 min, 3 d 4 h."""
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 60:
        return f"{seconds:.0f} s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min" if hours < 48 else f"{hours // 24} d {hours % 24} h"


# --- ETA ------------------------------------------------------------------------------------------


def eta(points: Sequence[Point], *, metric: str, target: float | None, now: float) -> Eta:
    """Seconds from `now` until the target, from a least-squares line through the last evaluations (value
    against wall time). Learning curves bend, so this is a rough guide; it declines rather than guesses."""
    if target is None:
        return Eta(None, "No target is set for this project.")
    if points and reached(metric=metric, value=points[-1].value, target=target):
        return Eta(0.0, f"Reached {label(metric, target)}.")
    recent = list(points[-ETA_WINDOW:])
    if len(recent) < ETA_MIN_POINTS:
        return Eta(None, f"Not enough data yet: {len(points)} evaluation(s), {ETA_MIN_POINTS} needed.")
    slope, intercept = _line([p.seconds for p in recent], [p.value for p in recent])
    towards = slope > 0 if higher_is_better(metric) else slope < 0
    if not towards or not math.isfinite(slope):
        return Eta(None, f"Not improving over the last {len(recent)} evaluations.")
    remaining = (target - intercept) / slope - now
    if remaining > ETA_MAX_SECONDS:
        return Eta(None, "More than a month away at the current rate.")
    return Eta(
        max(remaining, 0.0),
        f"To {label(metric, target)}, on a line through the last {len(recent)} evaluations.",
    )


def _line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    n = len(xs)
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    spread = sum((x - mean_x) ** 2 for x in xs)
    if spread == 0:
        return math.nan, mean_y
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / spread
    return slope, mean_y - slope * mean_x


# --- platform against one CPU ---------------------------------------------------------------------


def compare(
    platform: Sequence[Point],
    baseline: Sequence[Point],
    *,
    metric: str,
    target: float | None,
    baseline_finished: bool,
) -> Comparison:
    """Who reached the target first (or, without a target both reached, the best level both reached), and by
    what factor in wall time. Says so plainly either way."""
    if not platform or not baseline:
        return Comparison("Not enough data yet to compare the platform with one CPU.")
    if target is not None:
        by_target = _compare_at_target(
            platform, baseline, metric=metric, target=target, finished=baseline_finished
        )
        if by_target is not None:
            return by_target
    return _compare_at(
        platform, baseline, metric=metric, level=_best_common(platform, baseline, metric), target=False
    )


def _compare_at_target(
    platform: Sequence[Point], baseline: Sequence[Point], *, metric: str, target: float, finished: bool
) -> Comparison | None:
    at_p, at_b = (first_reaching(s, metric=metric, level=target) for s in (platform, baseline))
    goal = label(metric, target)
    if at_p and at_b:
        return _compare_at(platform, baseline, metric=metric, level=target, target=True)
    if at_b and not at_p and platform[-1].seconds <= 0:
        return Comparison(
            f"One CPU reached {goal} in {duration(at_b.seconds)}; the platform has not started training yet.",
            level=target,
            baseline=at_b,
        )
    if at_b and not at_p:
        factor = platform[-1].seconds / at_b.seconds if at_b.seconds > 0 else None
        slower = f", so the platform is at least {factor:.1f}× slower" if factor and factor > 1 else ""
        return Comparison(
            f"One CPU reached {goal} in {duration(at_b.seconds)}; the platform has not yet, after "
            f"{duration(platform[-1].seconds)}{slower}.",
            level=target,
            baseline=at_b,
        )
    if at_p and not at_b and finished:
        return Comparison(
            f"The platform reached {goal} in {duration(at_p.seconds)}; one CPU did not within its budget "
            f"({duration(baseline[-1].seconds)} of training, best {label(metric, _best(baseline, metric))}).",
            level=target,
            platform=at_p,
        )
    return None  # neither yet, or the baseline may still get there: compare at the best common level


def _best(points: Sequence[Point], metric: str) -> float:
    values = [p.value for p in points]
    return max(values) if higher_is_better(metric) else min(values)


def _best_common(platform: Sequence[Point], baseline: Sequence[Point], metric: str) -> float:
    """The best level both curves reached: the worse of the two bests."""
    bests = (_best(platform, metric), _best(baseline, metric))
    return min(bests) if higher_is_better(metric) else max(bests)


def _compare_at(
    platform: Sequence[Point], baseline: Sequence[Point], *, metric: str, level: float, target: bool
) -> Comparison:
    at_p, at_b = (first_reaching(s, metric=metric, level=level) for s in (platform, baseline))
    assert at_p is not None and at_b is not None  # both reach the worse of their bests
    where = (
        f"the target, {label(metric, level)}" if target else f"{label(metric, level)} (the best both reached)"
    )
    if at_p.seconds <= 0 or at_b.seconds <= 0:
        return Comparison(f"Not enough progress yet to compare: {where} was the starting point.", level=level)
    factor = at_b.seconds / at_p.seconds
    times = f"the platform took {duration(at_p.seconds)}, one CPU {duration(at_b.seconds)}"
    if max(factor, 1 / factor) < SAME_SPEED:
        statement = f"The platform and one CPU were about as fast to {where}: {times}."
    elif factor > 1:
        statement = f"The platform was {factor:.1f}× faster than one CPU to {where}: {times}."
    else:
        statement = (
            f"One CPU was {1 / factor:.1f}× faster than the platform to {where}: {times}. "
            "One machine wins here: for this model, handing out, checking and combining work costs more "
            "than the volunteers' computing saves."
        )
    return Comparison(statement, level=level, platform=at_p, baseline=at_b, factor=factor)
