"""Fixtures of the account tests: fresh throttle counters, a fast hasher, and a volunteer with a history
(devices, credit in two projects, a team, results of every outcome) next to another volunteer's."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from allauth.account.models import EmailAddress
from django.contrib.auth.models import User
from django.core.cache import cache
from django.db.models import Sum
from django.utils import timezone

from projects.models import Project, Result, WorkUnit
from tests.workers.conftest import accepted_result, device_of, grant
from workers.models import CreditEntry, Device, Team
from workers.services import device_disconnect
from workers.teams import team_create, team_join

GFLOP = 10**9
PASSWORD = "alice-pass-123"


@pytest.fixture(autouse=True)
def fresh_limits(fresh_limiter: None) -> Iterator[None]:
    """Counters of this test only: django-ratelimit's under a prefix of its own (fresh_limiter), allauth's
    (which has no prefix setting) cleared from this run's Redis database."""
    cache.clear()
    yield
    cache.clear()


def ledger(**filters: object) -> int:
    return int(CreditEntry.objects.filter(**filters).aggregate(total=Sum("flops"))["total"] or 0)


@dataclass
class History:
    user: User
    other: User
    team: Team
    laptop: Device  # credited
    phone: Device  # connected once, never computed
    projects: tuple[Project, Project]
    results: dict[str, Result]


def totals(history: History) -> dict[str, int]:
    """Every sum the ledger feeds: all of it, each project, the team, each device's and volunteer's rows."""
    first, second = history.projects
    return {
        "ledger": ledger(),
        "first": ledger(project=first),
        "second": ledger(project=second),
        "team": ledger(team=history.team),
        "team_row": Team.objects.get(pk=history.team.pk).total_flops,
        "laptop": Device.objects.get(pk=history.laptop.pk).total_flops,
        "rows": sum(Device.objects.values_list("total_flops", flat=True)),
    }


@pytest.fixture
def history(
    volunteer_user: User, other_volunteer: User, mlp_project: Project, second_project: Project
) -> History:
    """alice (e-mail alice@example.org, verified) in bob's team, with a credited laptop, a phone that never
    computed, results valid in two projects, one invalid, one in progress; bob with his own credit."""
    volunteer_user.email = "alice@example.org"
    volunteer_user.save()
    EmailAddress.objects.create(user=volunteer_user, email="alice@example.org", verified=True, primary=True)
    team = team_create(user=other_volunteer, name="Gradient Descenders")
    team_join(user=volunteer_user, team_id=team.pk)
    laptop, phone = device_of(volunteer_user, "laptop-id"), device_of(volunteer_user, "phone-id")
    device_disconnect(device_id=phone.pk)
    device_disconnect(device_id=laptop.pk)
    grant(mlp_project, volunteer_user, 3 * GFLOP, device=laptop)
    grant(second_project, volunteer_user, 5 * GFLOP, device=laptop)
    grant(mlp_project, other_volunteer, 7 * GFLOP, device=device_of(other_volunteer, "bob-id"))
    results = {"valid": Result.objects.filter(volunteer=volunteer_user).latest("pk")}
    results["invalid"] = _result(
        mlp_project, volunteer_user, laptop, validation="invalid", reason="NaN in update"
    )
    results["in_progress"] = _result(mlp_project, volunteer_user, laptop, status="in_progress")
    # Sent and not back: its work unit wants no other instance until this one returns or is released.
    WorkUnit.objects.filter(results=results["in_progress"]).update(status="open", wanted=0, total_results=1)
    return History(
        volunteer_user, other_volunteer, team, laptop, phone, (mlp_project, second_project), results
    )


def _result(project: Project, user: User, device: Device, **fields: Any) -> Result:
    result = accepted_result(project, user, device=device)
    values = {"status": "received", "validation": "pending", "deadline": timezone.now()} | fields
    Result.objects.filter(pk=result.pk).update(**values)
    result.refresh_from_db()
    return result
