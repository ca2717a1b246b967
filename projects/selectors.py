"""Read-only queries about projects and their progress, shared by the admin, the pages and the API."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from django.contrib.auth.models import AnonymousUser, User
from django.db.models import Case, F, Max, Min, OuterRef, Q, QuerySet, Subquery, Sum, When, Window
from django.utils import timezone
from django.utils.translation import gettext as _

from projects import curves
from projects.models import Baseline, Dataset, Metric, ModelVersion, Project, Result

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


# --- the project page: progress, curves, the one-CPU baseline ----------------------------------------

ACTIVE_SECONDS = 300  # a volunteer sent or returned work this recently is active


@dataclass(frozen=True)
class ProjectProgress:
    """The numbers of the API's ProjectDetail.progress and of the project page."""

    samples_per_second: float
    volunteers_active: int
    flops: int
    versions: int
    eta_seconds: float | None
    eta_reason: str


def project_progress(*, project: Project) -> ProjectProgress:
    eta = project_eta(project=project)
    return ProjectProgress(
        samples_per_second=project_samples_per_second(project=project),
        volunteers_active=project_volunteers_active(project=project),
        flops=int(project.credit.aggregate(total=Sum("flops"))["total"] or 0),
        versions=project.versions.count(),
        eta_seconds=eta.seconds,
        eta_reason=eta.reason,
    )


def project_volunteers_active(*, project: Project, seconds: int = ACTIVE_SECONDS) -> int:
    since = timezone.now() - timedelta(seconds=seconds)
    recent = Result.objects.filter(
        Q(sent_at__gte=since) | Q(received_at__gte=since), work_unit__project=project
    )
    return recent.values("volunteer_id").distinct().count()


def project_started_at(*, project: Project) -> datetime | None:
    """When volunteers got the project's first work: its training clock starts there (a draft's time, and
    the time before anyone connected, are not the platform's)."""
    first = Result.objects.filter(work_unit__project=project).aggregate(first=Min("sent_at"))["first"]
    return first


def project_curve(*, project: Project, metric: str) -> list[curves.Point]:
    """One metric against wall seconds since training started and training samples aggregated so far."""
    started = project_started_at(project=project)
    versions = ModelVersion.objects.filter(project=project).annotate(
        seen=Window(Sum("samples"), order_by=F("number").asc())
    )
    seen = {number: total for number, total in versions.values_list("number", "seen")}
    rows = project.metrics.filter(name=metric).order_by("version__number")
    return [
        curves.Point(seconds=_seconds_since(started, at), samples=int(seen.get(number) or 0), value=value)
        for number, at, value in rows.values_list("version__number", "version__created_at", "value")
    ]


def _seconds_since(start: datetime | None, at: datetime) -> float:
    return 0.0 if start is None else max((at - start).total_seconds(), 0.0)


def project_eta(*, project: Project) -> curves.Eta:
    started = project_started_at(project=project)
    now = _seconds_since(started, timezone.now())
    points = project_curve(project=project, metric=project.target_metric)
    return curves.eta(points, metric=project.target_metric, target=project.target_value, now=now)


def version_best(*, project: Project) -> ModelVersion | None:
    """The evaluated version best by the project's target metric (the latest of equals)."""
    direction = "-value" if curves.higher_is_better(project.target_metric) else "value"
    best = project.metrics.filter(name=project.target_metric).order_by(direction, "-version__number").first()
    return best.version if best else None


def baseline_curve(*, baseline: Baseline, metric: str) -> list[curves.Point]:
    rows = baseline.points.order_by("samples").values_list("seconds", "samples", "metrics")
    return [
        curves.Point(seconds=seconds, samples=samples, value=float(metrics[metric]))
        for seconds, samples, metrics in rows
        if isinstance(metrics.get(metric), int | float)
    ]


def project_comparison(*, project: Project, baseline: Baseline | None) -> curves.Comparison:
    if baseline is None or baseline.status == Baseline.Status.SKIPPED:
        return curves.Comparison(
            stored_reason(baseline.reason) if baseline else _("No one-CPU baseline for this project.")
        )
    metric = project.target_metric
    return curves.compare(
        project_curve(project=project, metric=metric),
        baseline_curve(baseline=baseline, metric=metric),
        metric=metric,
        target=project.target_value,
        baseline_finished=baseline.status in (Baseline.Status.DONE, Baseline.Status.FAILED),
    )


def stored_reason(reason: str) -> str:
    """A reason stored in English, in the reader's language when it is one of the fixed ones the catalogue
    holds (marked with gettext_noop where they are written); any other (an exception's text) as it is."""
    return _(reason) if reason else reason  # gettext("") would be the catalogue's header


# --- the REST API (projects/api.py): what each user may see ----------------------------------------


def project_list_api(*, user: User | AnonymousUser, mine: bool) -> QuerySet[Project]:
    """Non-draft projects, running first; `mine`: the user's own, drafts included."""
    public = Project.objects.exclude(status=Project.Status.DRAFT)
    projects = Project.objects.filter(owner_id=user.pk) if mine else public
    running_first = Case(When(status=Project.Status.RUNNING, then=0), default=1)
    annotated = project_annotate_current_version(queryset=projects.select_related("owner"))
    return annotated.order_by(running_first, "-resource_share", "name", "pk")


def project_visible(*, user: User | AnonymousUser, project_id: int) -> Project | None:
    """The project if `user` may read it: any non-draft project, their own drafts (all, for superusers)."""
    projects = project_annotate_current_version(queryset=Project.objects.select_related("owner"))
    project = projects.filter(pk=project_id).first()
    if project is None or project.status != Project.Status.DRAFT or user.is_superuser:
        return project
    return project if user.is_authenticated and project.owner_id == user.pk else None


def project_owned(*, user: User | AnonymousUser, project: Project) -> bool:
    return bool(user.is_authenticated and (project.owner_id == user.pk or user.is_superuser))


def version_list(*, project: Project) -> QuerySet[ModelVersion]:
    return project.versions.prefetch_related("metrics").order_by("number")


def version_pick(*, project: Project, which: str) -> ModelVersion | None:
    """A version by "latest", "best" (by the project's target metric) or its number."""
    if which == "best":
        return version_best(project=project)
    versions = project.versions.select_related("weights")
    if which == "latest":
        return versions.order_by("-number").first()
    return versions.filter(number=int(which)).first() if which.isdigit() and len(which) < 10 else None


def version_numbers_kept(*, project: Project) -> list[int]:
    """Numbers of the versions whose weights are still stored."""
    kept = project.versions.filter(weights__isnull=False).order_by("number")
    return list(kept.values_list("number", flat=True))


def dataset_list_owned(*, user: User) -> QuerySet[Dataset]:
    return Dataset.objects.filter(owner=user).order_by("-created_at", "-pk")
