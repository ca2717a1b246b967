"""Reading learning curves (projects/curves.py): the ETA and the platform-against-one-CPU statement."""

from __future__ import annotations

import pytest

from projects.curves import Point, compare, duration, eta

ACC = "test_accuracy"
LOSS = "test_loss"


def curve(*points: tuple[float, float], samples_per_second: float = 100.0) -> list[Point]:
    return [Point(seconds=s, samples=int(s * samples_per_second), value=v) for s, v in points]


# --- the speedup statement ------------------------------------------------------------------------


def test_one_cpu_faster_to_the_target_is_said_plainly() -> None:
    platform = curve((0, 0.1), (60, 0.5), (120, 0.92))
    one_cpu = curve((0, 0.1), (10, 0.7), (30, 0.91))
    comparison = compare(platform, one_cpu, metric=ACC, target=0.9, baseline_finished=True)
    assert comparison.statement.startswith("One CPU was 4.0× faster than the platform to the target, 90.0%")
    assert "One machine wins here" in comparison.statement
    assert comparison.factor == pytest.approx(30 / 120)
    assert comparison.platform == platform[2] and comparison.baseline == one_cpu[2]


def test_the_platform_faster_to_the_target_is_said_plainly() -> None:
    platform = curve((0, 0.1), (20, 0.95))
    one_cpu = curve((0, 0.1), (50, 0.6), (100, 0.9))
    comparison = compare(platform, one_cpu, metric=ACC, target=0.9, baseline_finished=True)
    assert comparison.statement.startswith("The platform was 5.0× faster than one CPU to the target")
    assert "the platform took 20 s, one CPU 1 min 40 s" in comparison.statement
    assert comparison.factor == pytest.approx(5.0)


def test_a_loss_target_is_reached_going_down() -> None:
    platform = curve((0, 2.3), (40, 0.9), (80, 0.25))
    one_cpu = curve((0, 2.3), (10, 0.29), (20, 0.2))
    comparison = compare(platform, one_cpu, metric=LOSS, target=0.3, baseline_finished=True)
    assert comparison.statement.startswith(
        "One CPU was 8.0× faster than the platform to the target, test loss 0.3"
    )


def test_only_one_cpu_reached_the_target_bounds_the_slowdown_from_below() -> None:
    platform = curve((0, 0.1), (100, 0.6))
    one_cpu = curve((0, 0.1), (4, 0.95))
    comparison = compare(platform, one_cpu, metric=ACC, target=0.9, baseline_finished=True)
    assert comparison.statement == (
        "One CPU reached 90.0% test accuracy in 4.0 s; the platform has not yet, after 1 min 40 s, so the "
        "platform is at least 25.0× slower."
    )


def test_a_platform_not_started_yet_is_not_timed() -> None:
    comparison = compare(
        curve((0, 0.1)), curve((0, 0.1), (4, 0.95)), metric=ACC, target=0.9, baseline_finished=True
    )
    assert (
        comparison.statement
        == "One CPU reached 90.0% test accuracy in 4.0 s; the platform has not started training yet."
    )


def test_only_the_platform_reached_the_target_within_the_baselines_budget() -> None:
    platform = curve((0, 0.1), (50, 0.91))
    one_cpu = curve((0, 0.1), (300, 0.8))
    comparison = compare(platform, one_cpu, metric=ACC, target=0.9, baseline_finished=True)
    assert comparison.statement.startswith(
        "The platform reached 90.0% test accuracy in 50 s; one CPU did not"
    )
    assert "best 80.0% test accuracy" in comparison.statement


def test_a_baseline_still_running_is_compared_at_the_best_level_both_reached() -> None:
    platform = curve((0, 0.1), (50, 0.91))
    one_cpu = curve((0, 0.1), (10, 0.5), (25, 0.8))
    comparison = compare(platform, one_cpu, metric=ACC, target=0.9, baseline_finished=False)
    assert comparison.level == 0.8
    assert "80.0% test accuracy (the best both reached)" in comparison.statement


def test_without_a_target_the_best_common_level_is_used_both_ways() -> None:
    platform = curve((0, 0.1), (10, 0.4), (30, 0.7), (60, 0.75))
    one_cpu = curve((0, 0.1), (5, 0.7), (9, 0.9))
    faster_cpu = compare(platform, one_cpu, metric=ACC, target=None, baseline_finished=True)
    assert faster_cpu.level == 0.75 and faster_cpu.factor == pytest.approx(9 / 60)
    assert faster_cpu.statement.startswith("One CPU was 6.7× faster")
    faster_platform = compare(one_cpu, platform, metric=ACC, target=None, baseline_finished=True)
    assert faster_platform.statement.startswith("The platform was 6.7× faster")


def test_close_times_are_about_as_fast_and_no_progress_or_no_data_says_so() -> None:
    close = compare(
        curve((0, 0.1), (100, 0.9)),
        curve((0, 0.1), (105, 0.9)),
        metric=ACC,
        target=0.9,
        baseline_finished=True,
    )
    assert close.statement.startswith("The platform and one CPU were about as fast")
    stuck = compare(
        curve((0, 0.1), (10, 0.1)), curve((0, 0.1), (5, 0.5)), metric=ACC, target=None, baseline_finished=True
    )
    assert stuck.statement.startswith("Not enough progress yet") and stuck.factor is None
    empty = compare([], curve((0, 0.1)), metric=ACC, target=0.9, baseline_finished=True)
    assert empty.statement.startswith("Not enough data yet")


# --- ETA ------------------------------------------------------------------------------------------


def test_eta_follows_the_recent_straight_line() -> None:
    points = curve((0, 0.1), (10, 0.2), (20, 0.3), (30, 0.4))
    estimate = eta(points, metric=ACC, target=0.9, now=30)
    assert estimate.seconds == pytest.approx(50.0)


def test_eta_for_a_loss_going_down_and_from_a_later_now() -> None:
    points = curve((0, 2.0), (10, 1.5), (20, 1.0))
    assert eta(points, metric=LOSS, target=0.5, now=25).seconds == pytest.approx(5.0)


@pytest.mark.parametrize(
    ("points", "target", "reason"),
    [
        (curve((0, 0.1), (10, 0.2)), 0.9, "Not enough data yet: 2 evaluations, 3 needed."),
        (curve((0, 0.5), (10, 0.4), (20, 0.3)), 0.9, "Not improving over the last 3 evaluations."),
        (curve((0, 0.5), (10, 0.5), (20, 0.5)), 0.9, "Not improving over the last 3 evaluations."),
        (curve((0, 0.1), (10, 0.2), (20, 0.3)), None, "No target is set for this project."),
        (
            curve((0, 0.1), (1, 0.10000001), (2, 0.10000002)),
            0.9,
            "More than a month away at the current rate.",
        ),
    ],
)
def test_eta_declines_rather_than_guesses(points: list[Point], target: float | None, reason: str) -> None:
    estimate = eta(points, metric=ACC, target=target, now=20)
    assert estimate.seconds is None and estimate.reason == reason


def test_eta_is_zero_once_reached() -> None:
    assert eta(curve((0, 0.1), (5, 0.95)), metric=ACC, target=0.9, now=9).seconds == 0.0


def test_durations_read_naturally() -> None:
    assert [duration(s) for s in (1.234, 45, 200, 7500, 200000)] == [
        "1.2 s",
        "45 s",
        "3 min 20 s",
        "2 h 05 min",
        "2 d 7 h",
    ]
