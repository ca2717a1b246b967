"""Public pages (home, sign-up, leaderboard, contribute) and the staff credit dashboard. Thin views only."""

from __future__ import annotations

from django.contrib import admin
from django.contrib.auth import login
from django.contrib.auth.decorators import login_required
from django.contrib.auth.forms import UserCreationForm
from django.contrib.auth.models import User
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render

from frontend.throttle import SIGNUP_REFUSED, signup_counted, signup_refused
from projects.selectors import TEST_ACCURACY, project_latest_metrics, project_list_running
from workers.accounts import volunteer_create
from workers.selectors import (
    compute_share,
    credit_by_project,
    credit_by_volunteer,
    credit_rate_series,
    credit_total,
    credit_volunteer_count,
    leaderboard,
)
from workers.services import volunteer_ensure


def home(request: HttpRequest) -> HttpResponse:
    projects = list(project_list_running())
    metrics = project_latest_metrics(project_ids=[project.pk for project in projects])
    for project in projects:
        project.test_accuracy = metrics[project.pk].get(TEST_ACCURACY)  # type: ignore[attr-defined]
    return render(request, "frontend/home.html", {"projects": projects, "total_flops": credit_total()})


def signup(request: HttpRequest) -> HttpResponse:
    if request.user.is_authenticated:
        return redirect("contribute")
    posted = request.method == "POST"
    form: UserCreationForm[User] = UserCreationForm(request.POST if posted else None)
    if posted and signup_refused(request):
        form.add_error(None, SIGNUP_REFUSED)
        return render(request, "registration/signup.html", {"form": form}, status=429)
    if posted and form.is_valid():
        volunteer = volunteer_create(
            username=form.cleaned_data["username"], password=form.cleaned_data["password1"]
        )
        signup_counted(request)
        login(request, volunteer.user, backend="django.contrib.auth.backends.ModelBackend")
        return redirect("contribute")
    return render(request, "registration/signup.html", {"form": form})


def leaderboard_page(request: HttpRequest) -> HttpResponse:
    return render(request, "frontend/leaderboard.html", {"volunteers": leaderboard(limit=100)})


@login_required
def contribute(request: HttpRequest) -> HttpResponse:
    volunteer = volunteer_ensure(user=request.user)  # type: ignore[arg-type]
    return render(request, "frontend/contribute.html", {"volunteer": volunteer})


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
