"""The public project page (/projects/<id>/) and the JSON its charts poll (/projects/<id>/live/).

Public for every project but drafts; a draft is shown to its owner only (everyone else gets a 404, as if it
did not exist). The page renders its first state from the same data the JSON gives, so it needs no second
request to draw, and then polls that JSON to update without a reload.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import get_object_or_404, render
from django.views.decorators.http import require_GET

from projects import curves
from projects.models import Baseline, ModelVersion, Project
from projects.selectors import (
    baseline_curve,
    project_comparison,
    project_curve,
    project_metric_series,
    project_progress,
    version_best,
)

RECENT_VERSIONS = 12
POLL_SECONDS = 5


def project_visible(*, request: HttpRequest, project_id: int) -> Project:
    """The project, or 404: drafts exist only for their owner."""
    project = get_object_or_404(Project.objects.select_related("owner", "dataset"), pk=project_id)
    if project.status == Project.Status.DRAFT and project.owner_id != request.user.pk:
        raise Http404("No such project.")
    return project


@require_GET
def project_page(request: HttpRequest, project_id: int) -> HttpResponse:
    project = project_visible(request=request, project_id=project_id)
    context = {"project": project, "live": project_live_data(project=project), "poll_seconds": POLL_SECONDS}
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
        "reason": baseline.reason,
        "budget_seconds": baseline.budget_seconds,
        "budget_samples": baseline.budget_samples,
    }


def _comparison(comparison: curves.Comparison) -> dict[str, Any]:
    return {"statement": comparison.statement, "level": comparison.level, "factor": comparison.factor}
