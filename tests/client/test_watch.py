"""crowdtrain.watch: what `status` and `watch` print, from the API's answers."""

from __future__ import annotations

from typing import Any

import pytest

from crowdtrain.watch import format_eta, render, sparkline, status_table, target_reached


def project(**overrides: Any) -> dict[str, Any]:
    base = {
        "id": 7,
        "name": "Digits CNN",
        "status": "running",
        "mode": "averaging",
        "current_version": 12,
        "metrics": {"test_accuracy": 0.91234, "test_loss": 0.3},
        "target_metric": "test_accuracy",
        "target_value": 0.95,
        "progress": {
            "samples_per_second": 1520.25,
            "volunteers_active": 3,
            "flops": 12345678,
            "versions": 13,
            "eta_seconds": 200.0,
        },
    }
    return base | overrides


def metrics(name: str, values: list[float]) -> list[dict[str, Any]]:
    return [{"version": 5 * i, "name": name, "value": v} for i, v in enumerate(values)]


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (None, "unknown"),
        (float("inf"), "unknown"),
        (-1.0, "unknown"),
        (42.4, "42s"),
        (200.0, "3m 20s"),
        (3 * 3600 + 65, "3h 01m"),
        (2 * 86400 + 7200, "2d 2h"),
    ],
)
def test_eta(seconds: float | None, text: str) -> None:
    assert format_eta(seconds) == text


def test_accuracy_target_is_reached_by_the_best_version_not_the_latest() -> None:
    rows = metrics("test_accuracy", [0.5, 0.96, 0.94])
    assert target_reached(project(), rows)
    assert not target_reached(project(), metrics("test_accuracy", [0.5, 0.94]))


def test_loss_target_is_reached_going_down() -> None:
    p = project(target_metric="test_loss", target_value=0.2)
    assert not target_reached(p, metrics("test_loss", [0.9, 0.3]))
    assert target_reached(p, metrics("test_loss", [0.9, 0.19, 0.4]))


def test_no_target_is_never_reached() -> None:
    assert not target_reached(project(target_value=None), metrics("test_accuracy", [1.0]))


def test_a_frame_shows_progress_eta_and_curves() -> None:
    rows = metrics("test_accuracy", [0.2, 0.6, 0.91]) + metrics("test_loss", [2.0, 1.0, 0.3])
    frame = render(project(), rows, "http://h/projects/7/", "12:00:00")
    assert "Digits CNN (project 7, running, averaging)  http://h/projects/7/" in frame
    assert "test accuracy 0.9123" in frame and "version 12" in frame
    assert "samples/s 1520.2" in frame and "volunteers 3" in frame and "FLOPs 12,345,678" in frame
    assert "target test_accuracy >= 0.95: ETA 3m 20s" in frame
    assert "accuracy ▁▅█ best 0.9100" in frame and "loss     █▄▁ best 0.3000" in frame


def test_a_frame_survives_a_project_with_nothing_yet() -> None:
    frame = render({"id": 1, "name": "new"}, [], "http://h/projects/1/", "12:00:00")
    assert "version -" in frame and "target: none set" in frame


def test_sparkline_keeps_the_last_values() -> None:
    assert sparkline([float(i) for i in range(100)], width=4) == "▁▃▆█"
    assert sparkline([1.0, 1.0]) == "▁▁"


def test_status_table() -> None:
    table = status_table([project(), project(id=8, name="x" * 60, current_version=None, metrics={})])
    lines = table.splitlines()
    assert lines[0].split() == ["ID", "NAME", "STATUS", "MODE", "VERSION", "TEST", "ACC", "TEST", "LOSS"]
    assert lines[2].split()[:5] == ["7", "Digits", "CNN", "running", "averaging"]
    assert "x" * 40 in lines[3] and "x" * 41 not in lines[3]
    assert "You have no projects yet" in status_table([])
