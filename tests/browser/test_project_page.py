"""The project page in Chromium: its charts take in a new version, metric and one-CPU point, no reload."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from projects.models import Baseline, BaselinePoint, Metric, Project
from projects.services import version_publish, version_weights

pytestmark = [pytest.mark.browser, pytest.mark.slow]

ACCURACY_POINTS = """() => {
  const chart = Chart.getChart("metrics-chart");
  const accuracy = chart && chart.data.datasets.find((d) => d.label === "test accuracy");
  return accuracy ? accuracy.data.map((p) => [p.x, p.y]) : null;
}"""
BASELINE_POINTS = (
    """(id) => Chart.getChart(id).data.datasets.find((d) => d.label.startsWith("one CPU")).data.length"""
)


@pytest.fixture(autouse=True, scope="module")
def orm_beside_playwright() -> Iterator[None]:
    """Playwright's sync API leaves its event loop marked running in this thread, and Django then refuses ORM
    calls here. Nothing here is async: Playwright only waits on its browser while one of its calls runs, never
    beside the ORM. Module-scoped, so that it outlasts live_server's flush of the database after the test."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
        yield


def publish(project: Project, number: int, accuracy: float) -> None:
    weights = version_weights(version=project.current_version())
    version = version_publish(project=project, number=number, weights=weights, momentum={}, samples=100)
    Metric.objects.create(project=project, version=version, name="test_accuracy", value=accuracy)


def test_the_charts_update_without_a_reload_when_a_version_and_a_metric_arrive(
    live_server: Any, mlp_project: Any, own_browser: Any
) -> None:
    # The database fixtures come before the browser: the test database must exist before Playwright starts.
    Metric.objects.create(
        project=mlp_project, version=mlp_project.current_version(), name="test_accuracy", value=0.1
    )
    baseline = Baseline.objects.get(project=mlp_project)
    context = own_browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(f"{live_server.url}/projects/{mlp_project.pk}/")
    page.wait_for_function(f"() => ({ACCURACY_POINTS})() !== null")
    assert page.evaluate(ACCURACY_POINTS) == [[0, 0.1]]
    assert page.text_content("#stat-versions") == "1"
    page.evaluate("window.notReloaded = true")

    publish(mlp_project, 1, accuracy=0.72)
    BaselinePoint.objects.create(baseline=baseline, seconds=1.5, samples=300, metrics={"test_accuracy": 0.8})
    page.wait_for_function(f"() => ({ACCURACY_POINTS})().length === 2", timeout=30_000)

    assert page.evaluate(ACCURACY_POINTS) == [[0, 0.1], [1, 0.72]]
    assert page.evaluate("window.notReloaded") is True
    assert page.text_content("#stat-versions") == "2"
    assert page.evaluate(BASELINE_POINTS, "curve-seconds") == 1  # the 0-second start is off a log axis
    assert page.evaluate(BASELINE_POINTS, "curve-samples") == 1
    assert page.text_content("#versions-body tr:first-child td:first-child") == "v1"
    assert page.is_visible("#download-best") and page.text_content("#download-best [data-field=best]") == "1"
    assert errors == []
    context.close()
