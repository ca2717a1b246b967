"""What `crowdtrain status` and `crowdtrain watch` print: pure functions of the API's answers."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

SPARK = "▁▂▃▄▅▆▇█"
SPARK_WIDTH = 48
LOWER_IS_BETTER = ("test_loss",)


def format_eta(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "unknown"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    days, hours = divmod(hours, 24)
    if days:
        return f"{days}d {hours}h"
    if hours:
        return f"{hours}h {minutes:02d}m"
    return f"{minutes}m {secs:02d}s" if minutes else f"{secs}s"


def format_number(value: Any, digits: int = 4) -> str:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return "-"
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:.{digits}f}" if abs(value) < 1e6 else f"{value:.3e}"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows, strict=True)]
    lines = [headers, ["-" * w for w in widths], *rows]
    return "\n".join(
        "  ".join(str(c).ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in lines
    )


def status_table(projects: Sequence[dict[str, Any]]) -> str:
    if not projects:
        return "You have no projects yet: `crowdtrain push ...` creates one."
    rows = [
        [
            str(p.get("id", "")),
            str(p.get("name", ""))[:40],
            str(p.get("status", "")),
            str(p.get("mode", "")),
            format_number(p.get("current_version")),
            format_number((p.get("metrics") or {}).get("test_accuracy")),
            format_number((p.get("metrics") or {}).get("test_loss")),
        ]
        for p in projects
    ]
    return table(["ID", "NAME", "STATUS", "MODE", "VERSION", "TEST ACC", "TEST LOSS"], rows)


def history(metrics: Sequence[dict[str, Any]], name: str) -> list[float]:
    """One metric's values in version order (the metrics endpoint's rows)."""
    rows = [m for m in metrics if m.get("name") == name and isinstance(m.get("value"), int | float)]
    return [float(m["value"]) for m in sorted(rows, key=lambda m: int(m.get("version") or 0))]


def best(values: Sequence[float], name: str) -> float | None:
    if not values:
        return None
    return min(values) if name in LOWER_IS_BETTER else max(values)


def target_reached(project: dict[str, Any], metrics: Sequence[dict[str, Any]]) -> bool:
    name, goal = project.get("target_metric"), project.get("target_value")
    if not isinstance(name, str) or not isinstance(goal, int | float):
        return False
    value = best(history(metrics, name), name)
    if value is None:
        return False
    return value <= goal if name in LOWER_IS_BETTER else value >= goal


def sparkline(values: Sequence[float], width: int = SPARK_WIDTH) -> str:
    values = list(values)[-width:]
    if not values:
        return ""
    low, high = min(values), max(values)
    span = high - low or 1.0
    return "".join(SPARK[min(len(SPARK) - 1, int((v - low) / span * len(SPARK)))] for v in values)


def target_line(project: dict[str, Any], metrics: Sequence[dict[str, Any]]) -> str:
    name, goal = project.get("target_metric"), project.get("target_value")
    if not isinstance(name, str) or not isinstance(goal, int | float):
        return "target: none set (`crowdtrain push --set target_value=0.95`)"
    sign = "<=" if name in LOWER_IS_BETTER else ">="
    if target_reached(project, metrics):
        return f"target {name} {sign} {goal}: reached"
    eta = (project.get("progress") or {}).get("eta_seconds")
    return f"target {name} {sign} {goal}: ETA {format_eta(eta)}"


def render(project: dict[str, Any], metrics: Sequence[dict[str, Any]], url: str, clock: str) -> str:
    """One frame of `crowdtrain watch`."""
    progress = project.get("progress") or {}
    latest = project.get("metrics") or {}
    accuracy, loss = history(metrics, "test_accuracy"), history(metrics, "test_loss")
    lines = [
        f"{project.get('name')} (project {project.get('id')}, {project.get('status')}, "
        f"{project.get('mode')})  {url}",
        f"version {format_number(project.get('current_version'))}   test accuracy "
        f"{format_number(latest.get('test_accuracy'))}   test loss {format_number(latest.get('test_loss'))}",
        f"samples/s {format_number(progress.get('samples_per_second'), 1)}   volunteers "
        f"{format_number(progress.get('volunteers_active'))}   FLOPs {format_number(progress.get('flops'))}",
        target_line(project, metrics),
    ]
    if accuracy:
        lines.append(f"accuracy {sparkline(accuracy)} best {format_number(best(accuracy, 'test_accuracy'))}")
    if loss:
        lines.append(f"loss     {sparkline(loss)} best {format_number(best(loss, 'test_loss'))}")
    lines.append(f"updated {clock}; Ctrl-C to stop")
    return "\n".join(lines)
