"""Read-only queries about projects and their progress, shared by the admin, the pages and the API."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db.models import Max, OuterRef, QuerySet, Subquery, Sum
from django.utils import timezone

from projects.models import Metric, ModelVersion, Project, Result

TEST_ACCURACY = "test_accuracy"


@dataclass(frozen=True)
class MetricPoint:
    version: int
    name: str
    value: float
    created_at: datetime


def project_list_running() -> QuerySet[Project]:
    """Running projects, largest resource share first, annotated with `current_version_number`."""
    running = Project.objects.filter(status=Project.Status.RUNNING)
    return project_annotate_current_version(queryset=running).order_by("-resource_share", "name")


def project_list_public() -> QuerySet[Project]:
    """Every project volunteers may know about (all but drafts)."""
    public = Project.objects.exclude(status=Project.Status.DRAFT)
    return project_annotate_current_version(queryset=public).order_by("name")


def project_latest_metrics(*, project_ids: list[int]) -> dict[int, dict[str, float]]:
    """{project id: {metric name: latest value}} in two queries, however many projects."""
    latest_ids = (
        Metric.objects.filter(project_id__in=project_ids)
        .values("project_id", "name")
        .annotate(last=Max("id"))
    )
    result: dict[int, dict[str, float]] = {pk: {} for pk in project_ids}
    rows = Metric.objects.filter(id__in=[row["last"] for row in latest_ids]).values_list(
        "project_id", "name", "value"
    )
    for project_id, name, value in rows:
        result[project_id][name] = value
    return result


def project_metric_series(*, project: Project) -> list[MetricPoint]:
    """Every metric of a project, in version order (for charts)."""
    rows = project.metrics.order_by("version__number", "name").values_list(
        "version__number", "name", "value", "created_at"
    )
    return [MetricPoint(version=n, name=name, value=value, created_at=at) for n, name, value, at in rows]


def project_samples_per_second(*, project: Project, seconds: int = 300) -> float:
    """Accepted training samples per second over the last `seconds`."""
    since = timezone.now() - timedelta(seconds=seconds)
    accepted = Result.objects.filter(
        work_unit__project=project, validation=Result.Validation.VALID, received_at__gte=since
    ).aggregate(samples=Sum("samples"))["samples"]
    return (accepted or 0) / seconds


def project_annotate_current_version(*, queryset: QuerySet[Project]) -> QuerySet[Project]:
    """Adds `current_version_number` (None before version 0 exists) and joins the dataset."""
    newest = ModelVersion.objects.filter(project=OuterRef("pk")).order_by("-number").values("number")[:1]
    return queryset.select_related("dataset").annotate(current_version_number=Subquery(newest))
