"""Validator poison (issue 9, item 1): no result, however crafted, and no validation that keeps failing
for the server's own reasons may hold a round open. Through the real services on PostgreSQL, with Celery
eager as in tests/integration."""

from __future__ import annotations

import struct
from collections.abc import Iterator
from datetime import timedelta
from unittest import mock

import pytest
from django.contrib.auth.models import User
from django.db import OperationalError
from django.utils import timezone

from projects import lifecycle, tasks, training, validation
from projects.models import ModelVersion, Project, Result, WorkUnit
from tests.integration.volunteer import assign, judged, receive
from workers.models import CreditEntry, Volunteer

pytestmark = pytest.mark.django_db(transaction=True)

# A safetensors file whose JSON header nests 100,000 deep: json.loads raises RecursionError.
NESTED_HEADER = struct.pack("<Q", 200_000) + b"[" * 100_000 + b"]" * 100_000


def _round_expired(project: Project) -> None:
    ModelVersion.objects.filter(project=project).update(created_at=timezone.now() - timedelta(minutes=5))


def _assert_judged_invalid(result: Result, user: User, *why: str) -> None:
    judgement = judged(result)
    assert (judgement.status, judgement.validation) == ("received", "invalid")
    assert judgement.reason.startswith(why), judgement.reason
    assert not CreditEntry.objects.filter(volunteer__user=user).exists()
    assert Volunteer.objects.get(user=user).consecutive_valid == 0
    assert WorkUnit.objects.get(pk=result.work_unit_id).wanted == 1  # its slice is sent again


def test_a_deeply_nested_header_is_invalid_and_the_round_still_closes(
    mlp_project: Project, volunteer_user: User, other_volunteer: User
) -> None:
    Volunteer.objects.create(user=other_volunteer, consecutive_valid=5)
    poisoned = assign(other_volunteer)
    outcome = receive(other_volunteer, poisoned, payload=NESTED_HEADER)
    assert outcome.status == "invalid" and outcome.credit_flops == 0
    # The codec refuses such headers itself (engine/codecs.py); were it to raise anything else, judging
    # would still catch it.
    _assert_judged_invalid(
        poisoned, other_volunteer, "undecodable update:", "could not be validated: RecursionError"
    )

    assert receive(volunteer_user, assign(volunteer_user)).status == "valid"
    _round_expired(mlp_project)
    assert training.rounds_close_expired() == [mlp_project.pk]
    assert mlp_project.current_version().samples == 50


@pytest.mark.parametrize("step", ["_own_problem", "_spot_check", "_validate", "recompute"])
def test_any_exception_while_judging_makes_the_result_invalid(
    mlp_project: Project, volunteer_user: User, monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    """Whatever part of judging breaks on a hostile result (decoding, shapes, norm, spot check, the
    verdict), the result gets a verdict, and nothing half-done by the failed attempt is kept."""

    def broken(*_: object, **__: object) -> None:
        raise OverflowError("crafted")

    monkeypatch.setattr(validation, step, broken)
    result = assign(volunteer_user)
    outcome = receive(volunteer_user, result)
    assert outcome.status == "invalid" and outcome.credit_flops == 0
    _assert_judged_invalid(result, volunteer_user, "could not be validated: OverflowError")
    assert not judged(result).checked and WorkUnit.objects.get(pk=result.work_unit_id).status == "open"


@pytest.fixture
def database_down(monkeypatch: pytest.MonkeyPatch) -> Iterator[mock.Mock]:
    """Validation fails for the server's own reasons: the database went away mid-judgement."""
    failing = mock.Mock(side_effect=OperationalError("server closed the connection unexpectedly"))
    monkeypatch.setattr(validation, "_own_problem", failing)
    yield failing


def test_infrastructure_failures_are_retried_a_bounded_number_of_times(
    mlp_project: Project, volunteer_user: User, database_down: mock.Mock
) -> None:
    result = assign(volunteer_user)
    assert receive(volunteer_user, result).status == "pending"  # not the volunteer's fault: no verdict
    assert database_down.call_count == 1 + tasks.validate_result.max_retries
    assert 0 < tasks.validate_result.max_retries <= 10
    assert judged(result).validation == "pending"


def test_a_result_that_cannot_be_validated_is_given_up_and_the_round_closes(
    mlp_project: Project,
    volunteer_user: User,
    other_volunteer: User,
    database_down: mock.Mock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stuck = assign(other_volunteer)
    assert receive(other_volunteer, stuck).status == "pending"
    monkeypatch.undo()  # the database is back, but only for newer results: the stuck one's blob stays
    # unreadable, so the batch of the next result (which takes it along) leaves it pending (_judge_mate)
    own_problem = validation._own_problem

    def unreadable(result: Result) -> tuple[str | None, object]:
        if result.pk == stuck.pk:
            raise OperationalError("server closed the connection unexpectedly")
        return own_problem(result)

    monkeypatch.setattr(validation, "_own_problem", unreadable)
    assert receive(volunteer_user, assign(volunteer_user)).status == "valid"
    _round_expired(mlp_project)
    assert training.rounds_close_expired() == []  # the round waits for a recent result's verdict

    received = timezone.now() - timedelta(seconds=lifecycle.VALIDATION_GIVE_UP_SECONDS + 1)
    Result.objects.filter(pk=stuck.pk).update(received_at=received)
    with (
        mock.patch("projects.notify.results_decided") as told,
        mock.patch.object(tasks.validate_result, "delay"),
    ):
        tasks.transition()
    gave_up = judged(stuck)
    assert (gave_up.status, gave_up.reason) == ("cancelled", "the server could not validate this result")
    told.assert_called_once_with(result_ids=[stuck.pk])
    assert lifecycle.results_unvalidated() == []  # never queued again
    assert mlp_project.current_version().number == 1  # the round closed on its timeout with what it had
    assert Volunteer.objects.get(user=other_volunteer).results_invalid == 0  # no penalty
    assert not CreditEntry.objects.filter(volunteer__user=other_volunteer).exists()


def test_the_round_does_not_wait_for_a_validation_past_the_give_up_bound(
    mlp_project: Project, volunteer_user: User, other_volunteer: User
) -> None:
    """Even before the transitioner gives a stuck result up, the round's wait for it is bounded."""
    stuck, honest = assign(other_volunteer), assign(volunteer_user)
    assert receive(volunteer_user, honest).status == "valid"
    with mock.patch("projects.notify.result_received"):  # after: a validation takes waiting results along
        receive(other_volunteer, stuck)
    _round_expired(mlp_project)
    assert training.rounds_close_expired() == []
    received = timezone.now() - timedelta(seconds=lifecycle.VALIDATION_GIVE_UP_SECONDS + 1)
    Result.objects.filter(pk=stuck.pk).update(received_at=received)
    assert training.rounds_close_expired() == [mlp_project.pk]
