"""Team pages: the list with the team leaderboard (/teams/), a team's page (/teams/<id>/), creating one,
the founder's edit and hand-over, joining, leaving and taking over a founderless team. Thin views: the rules
are workers.teams'."""

from __future__ import annotations

from typing import Any

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.contrib.auth.models import User
from django.core.exceptions import PermissionDenied, ValidationError
from django.core.paginator import Paginator
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.utils import timezone
from django.utils.translation import gettext as _
from django.views.decorators.http import require_GET, require_POST

from workers.forms import BoardForm, FounderForm, TeamForm
from workers.leaderboards import (
    PAGE_SIZE,
    board_find,
    board_page,
    board_projects,
    team_board,
    team_detail,
    team_members,
    team_projects,
    volunteer_find,
)
from workers.models import Team, Volunteer
from workers.teams import team_claim, team_create, team_founder_transfer, team_join, team_leave, team_update


def _volunteer(request: HttpRequest) -> Volunteer | None:
    return volunteer_find(user_id=request.user.pk)


@require_GET
def teams_page(request: HttpRequest) -> HttpResponse:
    project_id, order = BoardForm(request.GET).filters()
    board = team_board(project_id=project_id, order=order, now=timezone.now())
    page, rows = board_page(board=board, number=request.GET.get("page"))
    volunteer = _volunteer(request)
    mine = board_find(board=board, key=volunteer.team_id if volunteer else None)
    context = {"page": page, "rows": rows, "mine": mine, "volunteer": volunteer, "projects": board_projects()}
    return render(request, "frontend/teams.html", {**context, "project_id": project_id, "order": order})


@require_GET
def team_page(request: HttpRequest, team_id: int) -> HttpResponse:
    try:
        team = team_detail(team_id=team_id)
    except Team.DoesNotExist as exc:
        raise Http404(_("No such team.")) from exc
    now = timezone.now()
    volunteer = _volunteer(request)
    members = Paginator(team_members(team=team, now=now), PAGE_SIZE).get_page(request.GET.get("page"))
    context = {
        "team": team,
        "recent": team.recent_credit(now=now),
        "members": members,
        "projects": team_projects(team=team, now=now),
        "volunteer": volunteer,
        "is_member": volunteer is not None and volunteer.team_id == team.pk,
        "is_founder": volunteer is not None and team.founder_id == volunteer.user_id,
        "founder_form": _founder_form(team=team),
    }
    return render(request, "frontend/team.html", context)


def _founder_form(*, team: Team, data: Any = None) -> FounderForm:
    others = team.members.exclude(user=team.founder).select_related("user").order_by("pk")
    return FounderForm(data, members=[(member.user_id, member.public_name()) for member in others])


@login_required
def team_create_page(request: HttpRequest) -> HttpResponse:
    form = TeamForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        try:
            team = team_create(user=request.user, **form.cleaned_data)  # type: ignore[arg-type]
        except ValidationError as exc:
            form.add_error("name", exc)
        else:
            messages.success(request, _("Your team is created; you are its founder."))
            return redirect("team", team_id=team.pk)
    return render(request, "frontend/team_form.html", {"form": form, "team": None}, status=_status(form))


@login_required
def team_edit_page(request: HttpRequest, team_id: int) -> HttpResponse:
    team = _team_or_404(team_id)
    if team.founder_id != request.user.pk:
        raise PermissionDenied(_("Only the team's founder can edit its page."))
    form = TeamForm(request.POST or None, instance=team)
    if request.method == "POST" and form.is_valid():
        try:
            team_update(user=request.user, team_id=team.pk, **form.cleaned_data)  # type: ignore[arg-type]
        except ValidationError as exc:
            form.add_error("name", exc)
        else:
            messages.success(request, _("The team's page is saved."))
            return redirect("team", team_id=team.pk)
    return render(request, "frontend/team_form.html", {"form": form, "team": team}, status=_status(form))


def _status(form: TeamForm) -> int:
    return 400 if form.is_bound and form.errors else 200


def _team_or_404(team_id: int) -> Team:
    team = Team.objects.filter(pk=team_id).first()
    if team is None:
        raise Http404(_("No such team."))
    return team


@login_required
@require_POST
def team_join_view(request: HttpRequest, team_id: int) -> HttpResponse:
    try:
        team = team_join(user=request.user, team_id=team_id)  # type: ignore[arg-type]
    except Team.DoesNotExist as exc:
        raise Http404(_("No such team.")) from exc
    messages.success(request, _("You are now a member of %(team)s.") % {"team": team.name})
    return redirect("team", team_id=team_id)


@login_required
@require_POST
def team_leave_view(request: HttpRequest, team_id: int) -> HttpResponse:
    if team_leave(user=request.user, team_id=team_id):  # type: ignore[arg-type]
        messages.success(request, _("You have left the team. The credit you earned in it stays the team's."))
    else:
        messages.error(request, _("You are not a member of this team."))
    return redirect("team", team_id=team_id)


@login_required
@require_POST
def team_founder_view(request: HttpRequest, team_id: int) -> HttpResponse:
    team = _team_or_404(team_id)
    form = _founder_form(team=team, data=request.POST)
    if not form.is_valid():
        messages.error(request, _("Choose a member of the team."))
        return redirect("team", team_id=team_id)
    user: User = request.user  # type: ignore[assignment]
    try:
        team_founder_transfer(user=user, team_id=team_id, to_user_id=form.cleaned_data["founder"])
    except ValidationError as exc:
        messages.error(request, " ".join(exc.messages))
    else:
        messages.success(request, _("You have handed the team over."))
    return redirect("team", team_id=team_id)


@login_required
@require_POST
def team_claim_view(request: HttpRequest, team_id: int) -> HttpResponse:
    _team_or_404(team_id)
    team_claim(user=request.user, team_id=team_id)  # type: ignore[arg-type]
    messages.success(request, _("You are now the team's founder."))
    return redirect("team", team_id=team_id)
