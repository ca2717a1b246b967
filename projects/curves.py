"""Reading learning curves: which way is better, when a curve reached a level, an ETA to the project's target,
and the platform-against-one-CPU comparison the project page states. Plain Python, no database; the sentences
are in the active language (the request's, on the project page)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from django.utils.formats import get_format
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy, ngettext

ETA_WINDOW = 8  # evaluations the ETA's straight line is fitted through
ETA_MIN_POINTS = 3
ETA_MAX_SECONDS = 30 * 86400.0  # beyond a month at the current rate: no promise
SAME_SPEED = 1.1  # within 10% of each other: "about as fast"
METRIC_NAMES = {"test_accuracy": gettext_lazy("test accuracy"), "test_loss": gettext_lazy("test loss")}


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


def decimal(text: str) -> str:
    """A number formatted by Python, with the active language's decimal separator."""
    return text.replace(".", str(get_format("DECIMAL_SEPARATOR")))


def label(metric: str, value: float) -> str:
    """'90.0% test accuracy', 'test loss 0.3'."""
    name = str(METRIC_NAMES.get(metric, metric.replace("_", " ")))
    if higher_is_better(metric):
        percent = _("%(number)s%%") % {"number": decimal(f"{value * 100:.1f}")}
        return _("%(percent)s %(metric)s") % {"percent": percent, "metric": name}
    return _("%(metric)s %(value)s") % {"metric": name, "value": decimal(f"{value:.3g}")}


def duration(seconds: float) -> str:
    """1.2 s, 45 s, 3 min 20 s, 2 h 05 min, 3 d 4 h."""
    if seconds < 10:
        return decimal(f"{seconds:.1f} s")
    if seconds < 60:
        return f"{seconds:.0f} s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours} h {minutes:02d} min"
    return _("%(days)s d %(hours)s h") % {"days": hours // 24, "hours": hours % 24}


# --- ETA ------------------------------------------------------------------------------------------


def eta(points: Sequence[Point], *, metric: str, target: float | None, now: float) -> Eta:
    """Seconds from `now` until the target, from a least-squares line through the last evaluations (value
    against wall time). Learning curves bend, so this is a rough guide; it declines rather than guesses."""
    if target is None:
        return Eta(None, _("No target is set for this project."))
    if points and reached(metric=metric, value=points[-1].value, target=target):
        return Eta(0.0, _("Reached %(goal)s.") % {"goal": label(metric, target)})
    recent = list(points[-ETA_WINDOW:])
    if len(recent) < ETA_MIN_POINTS:
        return Eta(None, _not_enough(len(points)))
    slope, intercept = _line([p.seconds for p in recent], [p.value for p in recent])
    towards = slope > 0 if higher_is_better(metric) else slope < 0
    if not towards or not math.isfinite(slope):
        return Eta(None, _("Not improving over the last %(count)d evaluations.") % {"count": len(recent)})
    remaining = (target - intercept) / slope - now
    if remaining > ETA_MAX_SECONDS:
        return Eta(None, _("More than a month away at the current rate."))
    return Eta(
        max(remaining, 0.0),
        _("To %(goal)s, on a line through the last %(count)d evaluations.")
        % {"goal": label(metric, target), "count": len(recent)},
    )


def _not_enough(count: int) -> str:
    text = ngettext(
        "Not enough data yet: %(count)d evaluation, %(needed)d needed.",
        "Not enough data yet: %(count)d evaluations, %(needed)d needed.",
        count,
    )
    return text % {"count": count, "needed": ETA_MIN_POINTS}


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
        return Comparison(_("Not enough data yet to compare the platform with one CPU."))
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
            _("One CPU reached %(goal)s in %(time)s; the platform has not started training yet.")
            % {"goal": goal, "time": duration(at_b.seconds)},
            level=target,
            baseline=at_b,
        )
    if at_b and not at_p:
        return Comparison(_cpu_only(goal, at_b=at_b, platform=platform), level=target, baseline=at_b)
    if at_p and not at_b and finished:
        return Comparison(
            _(
                "The platform reached %(goal)s in %(time)s; one CPU did not within its budget "
                "(%(budget)s of training, best %(best)s)."
            )
            % {
                "goal": goal,
                "time": duration(at_p.seconds),
                "budget": duration(baseline[-1].seconds),
                "best": label(metric, _best(baseline, metric)),
            },
            level=target,
            platform=at_p,
        )
    return None  # neither yet, or the baseline may still get there: compare at the best common level


def _cpu_only(goal: str, *, at_b: Point, platform: Sequence[Point]) -> str:
    """One CPU reached the target and the platform, training for a while, has not: slower by at least..."""
    factor = platform[-1].seconds / at_b.seconds if at_b.seconds > 0 else None
    times = {"goal": goal, "time": duration(at_b.seconds), "elapsed": duration(platform[-1].seconds)}
    if factor and factor > 1:
        return _(
            "One CPU reached %(goal)s in %(time)s; the platform has not yet, after %(elapsed)s, so the "
            "platform is at least %(factor)s× slower."
        ) % {**times, "factor": decimal(f"{factor:.1f}")}
    return _("One CPU reached %(goal)s in %(time)s; the platform has not yet, after %(elapsed)s.") % times


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
    where = (_("the target, %(level)s") if target else _("%(level)s (the best both reached)")) % {
        "level": label(metric, level)
    }
    if at_p.seconds <= 0 or at_b.seconds <= 0:
        return Comparison(
            _("Not enough progress yet to compare: %(where)s was the starting point.") % {"where": where},
            level=level,
        )
    factor = at_b.seconds / at_p.seconds
    words = {
        "where": where,
        "times": _("the platform took %(platform)s, one CPU %(cpu)s")
        % {"platform": duration(at_p.seconds), "cpu": duration(at_b.seconds)},
        "factor": decimal(f"{max(factor, 1 / factor):.1f}"),
    }
    return Comparison(
        _speed_statement(factor) % words, level=level, platform=at_p, baseline=at_b, factor=factor
    )


def _speed_statement(factor: float) -> str:
    if max(factor, 1 / factor) < SAME_SPEED:
        return _("The platform and one CPU were about as fast to %(where)s: %(times)s.")
    if factor > 1:
        return _("The platform was %(factor)s× faster than one CPU to %(where)s: %(times)s.")
    return _(
        "One CPU was %(factor)s× faster than the platform to %(where)s: %(times)s. One machine wins here: "
        "for this model, handing out, checking and combining work costs more than the volunteers' computing "
        "saves."
    )
