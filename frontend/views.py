"""Public pages (home, leaderboard, contribute) and the staff credit dashboard. Thin views only."""

from __future__ import annotations

from django.contrib import admin
from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.utils import timezone
from django.views.decorators.http import require_GET

from frontend.contribute_page import contribute_context
from projects.selectors import TEST_ACCURACY, project_latest_metrics, project_list_running
from workers.forms import BoardForm
from workers.leaderboards import board_find, board_page, board_projects, volunteer_board, volunteer_find
from workers.selectors import (
    compute_share,
    credit_by_project,
    credit_by_volunteer,
    credit_rate_series,
    credit_total,
    credit_volunteer_count,
)
from workers.services import volunteer_ensure


def home(request: HttpRequest) -> HttpResponse:
    projects = list(project_list_running())
    metrics = project_latest_metrics(project_ids=[project.pk for project in projects])
    for project in projects:
        project.test_accuracy = metrics[project.pk].get(TEST_ACCURACY)  # type: ignore[attr-defined]
    return render(request, "frontend/home.html", {"projects": projects, "total_flops": credit_total()})


@require_GET
def leaderboard_page(request: HttpRequest) -> HttpResponse:
    """Volunteers by credit: all projects or one, all-time or recent; the viewer's own rank always shown."""
    project_id, order = BoardForm(request.GET).filters()
    board = volunteer_board(project_id=project_id, order=order, now=timezone.now())
    page, rows = board_page(board=board, number=request.GET.get("page"))
    me = volunteer_find(user_id=request.user.pk)
    context = {
        "page": page,
        "rows": rows,
        "mine": board_find(board=board, key=me.pk if me else None),
        "projects": board_projects(),
        "project_id": project_id,
        "order": order,
        "by_project": credit_by_project(),
    }
    return render(request, "frontend/leaderboard.html", context)


@login_required
def contribute(request: HttpRequest) -> HttpResponse:
    volunteer = volunteer_ensure(user=request.user)  # type: ignore[arg-type]
    return render(request, "frontend/contribute.html", contribute_context(volunteer=volunteer))


def admin_dashboard(request: HttpRequest) -> HttpResponse:
    """Credit overview for staff; wrapped in admin.site.admin_view by the URLconf."""
    rate = credit_rate_series(minutes=60)
    context = {
        **admin.site.each_context(request),
        "title": "Credit dashboard",
        "total_flops": credit_total(),
        "by_project": credit_by_project(),
        "by_volunteer": credit_by_volunteer(limit=50),
        "volunteer_count": credit_volunteer_count(),
        "compute_share": compute_share(hours=24),
        "rate_chart": {"labels": [at.strftime("%H:%M") for at, _ in rate], "values": [v for _, v in rate]},
    }
    return render(request, "admin/dashboard.html", context)
