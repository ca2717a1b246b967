"""BOINC's error back-off (issue 9, hostile volunteers): a run of invalid results pauses a volunteer's new
work, doubling with each further one, so a poisoning account stops holding slices of every round. Through
the real services on PostgreSQL, with Celery eager as in tests/integration."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.utils import timezone

from projects import lifecycle
from projects.models import Project, Result, WorkUnit
from tests.integration.volunteer import honest_update
from workers.models import INVALID_STREAK, Volunteer

pytestmark = pytest.mark.django_db(transaction=True)
BACKOFF, CAP = 60, 24 * 3600


@pytest.fixture
def mlp_project(mlp_project: Project) -> Project:
    """Rounds of many work units: one volunteer never holds two instances of a work unit."""
    mlp_project.round_samples = 8 * mlp_project.batch_size
    mlp_project.save(update_fields=["round_samples"])
    lifecycle.work_units_feed(project_id=mlp_project.pk)
    return mlp_project


def _answer(user: User, *, lie: bool) -> str:
    """Take the next work unit and answer it honestly, or with an honest update claiming a wrong version."""
    result = lifecycle.work_unit_assign(user=user)
    assert result is not None, "no work was sent"
    work_unit = WorkUnit.objects.select_related("project", "version", "shard__blob").get(
        pk=result.work_unit_id
    )
    claimed = work_unit.version.number + (999 if lie else 0)
    outcome = lifecycle.result_receive(
        user=user,
        work_unit_id=work_unit.pk,
        samples=work_unit.count,
        loss=1.0,
        compute_ms=5,
        payload=honest_update(work_unit),
        model_version=claimed,
    )
    return outcome.status


def _volunteer(user: User) -> Volunteer:
    return Volunteer.objects.get(user=user)


def _pause_seconds(user: User) -> float:
    until = _volunteer(user).no_work_until
    return 0.0 if until is None else (until - timezone.now()).total_seconds()


def _lift_pause(user: User) -> None:
    Volunteer.objects.filter(user=user).update(no_work_until=timezone.now() - timedelta(seconds=1))


def test_one_invalid_result_is_forgiven_a_streak_pauses_new_work(
    mlp_project: Project, volunteer_user: User
) -> None:
    assert _answer(volunteer_user, lie=True) == "invalid"
    assert _pause_seconds(volunteer_user) == 0.0  # a glitch: work goes on
    assert _answer(volunteer_user, lie=True) == "invalid"  # the INVALID_STREAK-th in a row
    assert BACKOFF - 5 < _pause_seconds(volunteer_user) <= BACKOFF
    assert lifecycle.work_unit_assign(user=volunteer_user) is None
    assert not Result.objects.filter(volunteer=volunteer_user, status=Result.Status.IN_PROGRESS).exists()


def test_the_pause_doubles_with_each_further_invalid_result_up_to_the_cap(
    mlp_project: Project, volunteer_user: User
) -> None:
    pauses = []
    for _ in range(INVALID_STREAK + 2):
        _lift_pause(volunteer_user)
        assert _answer(volunteer_user, lie=True) == "invalid"
        pauses.append(round(_pause_seconds(volunteer_user) / BACKOFF))
    assert pauses == [0] * (INVALID_STREAK - 1) + [1, 2, 4]
    volunteer = _volunteer(volunteer_user)
    volunteer.consecutive_invalid = 100
    volunteer.record_invalid(now=timezone.now())
    assert volunteer.no_work_until is not None
    assert (volunteer.no_work_until - timezone.now()).total_seconds() <= CAP


def test_a_valid_result_ends_the_streak(mlp_project: Project, volunteer_user: User) -> None:
    assert _answer(volunteer_user, lie=True) == "invalid"
    assert _answer(volunteer_user, lie=False) == "valid"
    assert _answer(volunteer_user, lie=True) == "invalid"
    assert _pause_seconds(volunteer_user) == 0.0  # two invalid results, but not in a row
    volunteer = _volunteer(volunteer_user)
    assert (volunteer.consecutive_invalid, volunteer.results_invalid, volunteer.consecutive_valid) == (
        1,
        2,
        0,
    )


def test_a_paused_volunteer_gets_work_again_once_the_pause_is_over(
    mlp_project: Project, volunteer_user: User, other_volunteer: User
) -> None:
    for _ in range(INVALID_STREAK):
        _answer(volunteer_user, lie=True)
    assert lifecycle.work_unit_assign(user=volunteer_user) is None
    assert _answer(other_volunteer, lie=False) == "valid"  # the pause is one volunteer's, not the project's
    _lift_pause(volunteer_user)
    assert lifecycle.work_unit_assign(user=volunteer_user) is not None


@pytest.mark.parametrize("backoff", [0, 5])
def test_the_back_off_is_a_setting(
    mlp_project: Project, volunteer_user: User, settings: Any, backoff: int
) -> None:
    settings.CROWDTRAIN = {**settings.CROWDTRAIN, "INVALID_BACKOFF_SECONDS": backoff}
    for _ in range(INVALID_STREAK):
        _answer(volunteer_user, lie=True)
    assert (lifecycle.work_unit_assign(user=volunteer_user) is None) == (backoff > 0)
