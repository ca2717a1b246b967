"""The public project page (/projects/<id>/) and the JSON its charts poll (/projects/<id>/live/).

Public for every project but drafts; a draft is shown to its owner only (everyone else gets a 404, as if it
did not exist). The page renders its first state from the same data the JSON gives, so it needs no second
request to draw, and then polls that JSON to update without a reload. Its texts, its scripts' too (the page's
#project-text), are in the request's language.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import get_object_or_404, render
from django.utils.functional import Promise
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy
from django.views.decorators.http import require_GET

from projects import curves
from projects.models import Baseline, ModelVersion, Project
from projects.selectors import (
    baseline_curve,
    project_comparison,
    project_curve,
    project_metric_series,
    project_progress,
    stored_reason,
    version_best,
)

RECENT_VERSIONS = 12
POLL_SECONDS = 5
STATUS_LABELS: dict[str, Promise] = {
    Project.Status.DRAFT: gettext_lazy("Draft"),
    Project.Status.RUNNING: gettext_lazy("Running"),
    Project.Status.PAUSED: gettext_lazy("Paused"),
    Project.Status.FINISHED: gettext_lazy("Finished"),
}
MODE_LABELS: dict[str, Promise] = {
    Project.Mode.SYNC_SGD: gettext_lazy("synchronous SGD"),
    Project.Mode.AVERAGING: gettext_lazy("local steps and averaging"),
    Project.Mode.ASYNC_SGD: gettext_lazy("asynchronous SGD"),
}
METRIC_LABELS: dict[str, Promise] = {
    "test_accuracy": gettext_lazy("accuracy"),
    "test_loss": gettext_lazy("loss"),
}
BASELINE_LABELS: dict[str, Promise] = {
    Baseline.Status.PENDING: gettext_lazy("waiting"),
    Baseline.Status.RUNNING: gettext_lazy("running"),
    Baseline.Status.DONE: gettext_lazy("done"),
    Baseline.Status.SKIPPED: gettext_lazy("skipped"),
    Baseline.Status.FAILED: gettext_lazy("failed"),
}


def project_visible(*, request: HttpRequest, project_id: int) -> Project:
    """The project, or 404: drafts exist only for their owner."""
    project = get_object_or_404(Project.objects.select_related("owner", "dataset"), pk=project_id)
    if project.status == Project.Status.DRAFT and project.owner_id != request.user.pk:
        raise Http404("No such project.")
    return project


@require_GET
def project_page(request: HttpRequest, project_id: int) -> HttpResponse:
    project = project_visible(request=request, project_id=project_id)
    live = project_live_data(project=project)
    context = {
        "project": project,
        "live": live,
        "poll_seconds": POLL_SECONDS,
        "status_label": STATUS_LABELS.get(project.status, project.status),
        "mode_label": MODE_LABELS.get(project.mode, project.mode),
        "metric_label": METRIC_LABELS.get(project.target_metric, project.target_metric),
        "baseline_label": _baseline_label(live["baseline"]),
        "text": project_text(),
    }
    return render(request, "frontend/project.html", context)


@require_GET
def project_live(request: HttpRequest, project_id: int) -> JsonResponse:
    project = project_visible(request=request, project_id=project_id)
    return JsonResponse(project_live_data(project=project))


def project_live_data(*, project: Project) -> dict[str, Any]:
    """Everything the page shows that changes while training runs."""
    baseline = Baseline.objects.filter(project=project).first()
    best = version_best(project=project)
    return {
        "project": {
            "id": project.pk,
            "status": project.status,
            "target_metric": project.target_metric,
            "target_value": project.target_value,
        },
        "progress": asdict(project_progress(project=project)),
        "metrics": [
            {"version": p.version, "name": p.name, "value": p.value}
            for p in project_metric_series(project=project)
        ],
        "versions": _versions(project=project),
        "checkpoints": {"latest": _latest_number(project), "best": best.number if best else None},
        "curves": _curves(project=project, baseline=baseline),
        "baseline": _baseline(baseline),
        "comparison": _comparison(project_comparison(project=project, baseline=baseline)),
    }


def project_text() -> dict[str, Any]:
    """Every text the page's scripts (project.js, charts.js) show, in the request's language."""
    return {
        "reached": _("reached"),
        "baseline": _("Baseline: %(status)s"),
        "statuses": {status: str(label) for status, label in STATUS_LABELS.items()},
        "baseline_statuses": {status: str(label) for status, label in BASELINE_LABELS.items()},
        "metrics": {"test_accuracy": _("test accuracy"), "test_loss": _("test loss")},
        "model_version": _("model version"),
        "accuracy": _("accuracy"),
        "loss": _("loss"),
        "platform": _("platform (volunteers)"),
        "one_cpu": _("one CPU (server)"),
        "target": _("target"),
        "wall_time": _("wall time (log scale)"),
        "samples_seen": _("training samples seen (log scale)"),
        "days": _("%(days)s d %(hours)s h"),
    }


def _baseline_label(baseline: dict[str, Any] | None) -> str:
    return str(BASELINE_LABELS.get(baseline["status"], baseline["status"])) if baseline else ""


def _latest_number(project: Project) -> int | None:
    return project.versions.order_by("-number").values_list("number", flat=True).first()


def _versions(*, project: Project) -> list[dict[str, Any]]:
    recent = list(ModelVersion.objects.filter(project=project).order_by("-number")[:RECENT_VERSIONS])
    metrics: dict[int, dict[str, float]] = {v.pk: {} for v in recent}
    for version_id, name, value in project.metrics.filter(version__in=recent).values_list(
        "version_id", "name", "value"
    ):
        metrics[version_id][name] = value
    return [
        {
            "number": v.number,
            "created_at": v.created_at.isoformat(),
            "samples": v.samples,
            "train_loss": v.train_loss,
            "metrics": metrics[v.pk],
        }
        for v in recent
    ]


def _curves(*, project: Project, baseline: Baseline | None) -> dict[str, Any]:
    metric = project.target_metric
    one_cpu = baseline_curve(baseline=baseline, metric=metric) if baseline else []
    return {
        "metric": metric,
        "platform": [asdict(p) for p in project_curve(project=project, metric=metric)],
        "baseline": [asdict(p) for p in one_cpu],
    }


def _baseline(baseline: Baseline | None) -> dict[str, Any] | None:
    if baseline is None:
        return None
    return {
        "status": baseline.status,
        "reason": stored_reason(baseline.reason),
        "budget_seconds": baseline.budget_seconds,
        "budget_samples": baseline.budget_samples,
    }


def _comparison(comparison: curves.Comparison) -> dict[str, Any]:
    return {"statement": comparison.statement, "level": comparison.level, "factor": comparison.factor}
