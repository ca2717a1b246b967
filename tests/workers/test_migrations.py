"""workers/migrations/0008_teams_credit.py: the backfill gives from the ledger what credit_grant keeps."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from datetime import datetime

import pytest
from django.apps import apps
from django.contrib.auth.models import User
from django.utils import timezone

from projects.models import Project
from tests.workers.conftest import days, device_of, grant
from workers.models import CreditEntry, Device, Team, TeamProjectCredit, Volunteer, VolunteerProjectCredit
from workers.teams import team_create

backfill = importlib.import_module("workers.migrations.0008_teams_credit").backfill
CREDITED = (Volunteer, Team, Device, VolunteerProjectCredit, TeamProjectCredit)


def snapshot() -> dict[str, list[tuple[object, ...]]]:
    fields = ("total_flops", "expavg_credit", "expavg_time")
    return {
        model.__name__: sorted(
            model.objects.values_list("pk" if model in CREDITED[:3] else "project_id", *fields)
        )
        for model in CREDITED
    }


def test_the_backfill_gives_what_the_grants_gave(
    mlp_project: Project,
    second_project: Project,
    volunteer_user: User,
    other_volunteer: User,
    clock: Callable[[datetime], None],
) -> None:
    start = timezone.now() - days(30)
    team_create(user=volunteer_user, name="Backfilled")
    device = device_of(volunteer_user)
    for i, (project, who, flops) in enumerate(
        [
            (mlp_project, volunteer_user, 5),
            (second_project, other_volunteer, 7),
            (mlp_project, volunteer_user, 11),
            (second_project, volunteer_user, 3),
        ]
    ):
        clock(start + days(2.5 * i))
        grant(project, who, flops * 10**9, device=device if who == volunteer_user else None)
    granted = snapshot()

    # As the database was before 0008: no team on the lines, no per-project rows, no averages.
    CreditEntry.objects.update(team=None)
    VolunteerProjectCredit.objects.all().delete()
    TeamProjectCredit.objects.all().delete()
    for model in CREDITED[:3]:
        model.objects.update(total_flops=0, expavg_credit=0.0, expavg_time=None)
    backfill(apps)

    restored = snapshot()
    for name, rows in granted.items():
        assert [row[:2] for row in restored[name]] == [row[:2] for row in rows], name
        assert [row[2] for row in restored[name]] == pytest.approx([row[2] for row in rows], rel=1e-12), name
        assert [row[3] for row in restored[name]] == [row[3] for row in rows], name
    assert CreditEntry.objects.filter(team__name="Backfilled").count() == 3
