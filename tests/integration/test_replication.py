"""Spot checks by replication (Project.spot_check_by "replica", BOINC's adaptive replication): a checked
work unit goes to a second volunteer, and the two updates must agree before either is valid."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
from django.contrib.auth.models import User
from django.utils import timezone

from engine import codecs
from projects import lifecycle, training, validation
from projects.models import ModelVersion, Project, Result, WorkUnit
from projects.services import project_pause, version_weights
from tests.integration.volunteer import assign, honest_update, judged, receive, tampered
from workers.models import CreditEntry, Volunteer

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def replica_project(mlp_project: Project) -> Project:
    """The MLP project (two work units of 50 samples per round) spot-checking by replication."""
    Project.objects.filter(pk=mlp_project.pk).update(spot_check_by=Project.SpotCheckBy.REPLICA, codec="fp32")
    mlp_project.refresh_from_db()
    return mlp_project


@pytest.fixture
def no_server_recompute(monkeypatch: pytest.MonkeyPatch) -> None:
    """With replicas the server never recomputes an update (compute honest payloads before using this)."""

    def refuse(**kwargs: object) -> None:
        raise AssertionError("the server recomputed an update of a project that spot-checks by replica")

    monkeypatch.setattr(validation, "recompute", refuse)


def user(name: str) -> User:
    return User.objects.create_user(name)


def trust(who: User, *, project: Project, consecutive_valid: int | None = None) -> None:
    """Trusted by default; pass consecutive_valid below the project's threshold for an untrusted history."""
    valid = project.trust_threshold if consecutive_valid is None else consecutive_valid
    Volunteer.objects.update_or_create(user=who, defaults={"consecutive_valid": valid})


def work_unit(result: Result) -> WorkUnit:
    return WorkUnit.objects.get(pk=result.work_unit_id)


def credited(who: User) -> int:
    return sum(CreditEntry.objects.filter(volunteer__user=who).values_list("flops", flat=True))


def test_an_untrusted_volunteers_work_unit_is_replicated_to_another_volunteer(
    replica_project: Project, volunteer_user: User, other_volunteer: User
) -> None:
    first = assign(volunteer_user)
    unit = work_unit(first)
    assert (unit.target_results, unit.min_quorum, unit.wanted, unit.total_results) == (2, 2, 1, 1)
    replica = assign(other_volunteer)
    assert replica.work_unit_id == first.work_unit_id
    unit.refresh_from_db()
    assert (unit.target_results, unit.wanted, unit.total_results) == (2, 0, 2)
    # The scheduler never hands the replica back to the volunteer it checks.
    assert assign(volunteer_user).work_unit_id != first.work_unit_id


def test_two_agreeing_results_are_both_valid_and_credited_and_aggregated_once(
    replica_project: Project, volunteer_user: User, other_volunteer: User, no_server_recompute: None
) -> None:
    Project.objects.filter(pk=replica_project.pk).update(round_samples=50)  # one work unit closes a round
    first, replica = assign(volunteer_user), assign(other_volunteer)
    payload = honest_update(first.work_unit)
    unit = work_unit(first)

    waiting = receive(volunteer_user, first, payload)
    assert waiting.status == "pending" and waiting.credit_flops == 0  # waits for the replica
    assert judged(first).checked and work_unit(first).status == WorkUnit.Status.OPEN
    assert replica_project.current_version().number == 0

    assert receive(other_volunteer, replica, payload).status == "valid"
    first_judged, replica_judged = judged(first), judged(replica)
    assert first_judged.is_valid and replica_judged.is_valid
    assert first_judged.spot_checked and replica_judged.spot_checked
    unit.refresh_from_db()
    assert unit.status == WorkUnit.Status.VALIDATED and unit.canonical_result_id == first.pk
    flops = replica_project.flops_per_sample * unit.count
    assert credited(volunteer_user) == credited(other_volunteer) == flops
    for each in (volunteer_user, other_volunteer):
        assert Volunteer.objects.get(user=each).consecutive_valid == 1

    version = replica_project.current_version()
    assert version.number == 1 and version.samples == unit.count  # the slice counted once
    assert list(Result.objects.filter(aggregated=True).values_list("pk", flat=True)) == [first.pk]


def test_the_next_version_moves_by_the_canonical_update_alone(
    replica_project: Project, volunteer_user: User, other_volunteer: User
) -> None:
    """Two results that differ but agree within the codec's tolerance: only the canonical one is applied."""
    Project.objects.filter(pk=replica_project.pk).update(round_samples=50)
    first, replica = assign(volunteer_user), assign(other_volunteer)
    v0 = version_weights(version=replica_project.current_version())
    grad = validation.recompute(work_unit=first.work_unit)
    nudged = {k: v * 1.006 for k, v in grad.items()}  # 0.6% apart: the same update within fp32's 1%
    assert receive(volunteer_user, first, codecs.encode(grad)).status == "pending"
    assert receive(other_volunteer, replica, codecs.encode(nudged)).status == "valid"
    assert work_unit(first).canonical_result_id == first.pk
    v1 = version_weights(version=ModelVersion.objects.get(project=replica_project, number=1))
    lr = replica_project.learning_rate  # the first SGD step: momentum's buffer is the gradient itself
    for name in grad:  # averaging both would move by 1.003 x the canonical gradient
        torch.testing.assert_close(v0[name] - v1[name], lr * grad[name], rtol=5e-4, atol=1e-7)


@pytest.mark.parametrize("how", ["sign_flip", "scaled"])
def test_a_disagreement_asks_for_a_third_result_whose_majority_convicts_the_cheater(
    replica_project: Project, volunteer_user: User, other_volunteer: User, how: str
) -> None:
    cheater, honest, third = volunteer_user, other_volunteer, user("carol")
    trust(cheater, project=replica_project, consecutive_valid=3)
    bad, good = assign(cheater), assign(honest)
    assert receive(cheater, bad, tampered(bad.work_unit, how)).status == "pending"
    assert receive(honest, good).status == "pending"  # two that disagree: nobody knows who is right yet
    unit = work_unit(bad)
    assert (unit.status, unit.wanted, unit.target_results, unit.total_results) == ("open", 1, 3, 2)
    assert judged(bad).validation == judged(good).validation == Result.Validation.PENDING

    decider = assign(third)
    assert decider.work_unit_id == bad.work_unit_id
    assert receive(third, decider).status == "valid"
    convicted = judged(bad)
    assert convicted.validation == Result.Validation.INVALID and "another volunteer" in convicted.reason
    assert judged(good).is_valid
    unit.refresh_from_db()
    assert unit.status == WorkUnit.Status.VALIDATED and unit.canonical_result_id == good.pk
    assert credited(cheater) == 0 and not CreditEntry.objects.filter(result=bad).exists()
    assert credited(honest) == credited(third) == replica_project.flops_per_sample * unit.count
    cheater_profile = Volunteer.objects.get(user=cheater)
    assert (cheater_profile.consecutive_valid, cheater_profile.results_invalid) == (0, 1)


@pytest.mark.parametrize(("rate", "replicated"), [(0.0, False), (1.0, True)])
def test_trusted_volunteers_are_replicated_at_the_spot_check_rate(
    replica_project: Project, volunteer_user: User, rate: float, replicated: bool, no_server_recompute: None
) -> None:
    Project.objects.filter(pk=replica_project.pk).update(spot_check_rate=rate)
    trust(volunteer_user, project=replica_project)
    result = assign(volunteer_user)
    unit = work_unit(result)
    assert (unit.target_results, unit.min_quorum, unit.wanted) == ((2, 2, 1) if replicated else (1, 1, 0))
    outcome = receive(volunteer_user, result)
    assert outcome.status == ("pending" if replicated else "valid"), outcome.reason
    if not replicated:  # its own checks suffice; the server does not recompute it either
        assert not judged(result).spot_checked and work_unit(result).canonical_result_id == result.pk


def test_replica_projects_never_recompute_on_the_server(
    replica_project: Project, volunteer_user: User, no_server_recompute: None
) -> None:
    """Trusted when the work was sent (so not replicated), no longer trusted when its result arrives (another
    of its results was invalid meanwhile): its own checks decide, as for any unreplicated result."""
    Project.objects.filter(pk=replica_project.pk).update(spot_check_rate=0.0)
    trust(volunteer_user, project=replica_project)
    result = assign(volunteer_user)
    assert work_unit(result).min_quorum == 1
    trust(volunteer_user, project=replica_project, consecutive_valid=0)
    assert receive(volunteer_user, result).status == "valid"
    assert not judged(result).spot_checked


def test_untrusted_volunteers_are_always_replicated_even_at_rate_zero(
    replica_project: Project, volunteer_user: User
) -> None:
    Project.objects.filter(pk=replica_project.pk).update(spot_check_rate=0.0)
    trust(volunteer_user, project=replica_project, consecutive_valid=replica_project.trust_threshold - 1)
    assert work_unit(assign(volunteer_user)).min_quorum == 2


def test_server_spot_checks_never_replicate(mlp_project: Project, volunteer_user: User) -> None:
    unit = work_unit(assign(volunteer_user))  # untrusted, spot_check_by "server" (the default)
    assert (unit.target_results, unit.min_quorum, unit.wanted) == (1, 1, 0)


def test_no_agreement_by_max_total_results_errors_the_work_unit(
    replica_project: Project, volunteer_user: User, other_volunteer: User
) -> None:
    first, second = assign(volunteer_user), assign(other_volunteer)
    WorkUnit.objects.filter(pk=first.work_unit_id).update(max_total_results=2)
    assert receive(volunteer_user, first).status == "pending"
    outcome = receive(other_volunteer, second, tampered(second.work_unit, "sign_flip"))
    unit = work_unit(first)
    assert unit.status == WorkUnit.Status.ERRORED and unit.canonical_result is None
    # Nobody can tell which one was right: both are late (no credit, no penalty), nothing is aggregated.
    assert outcome.status == "late" and receive(volunteer_user, first).status == "late"
    assert not CreditEntry.objects.exists()
    assert not Volunteer.objects.filter(results_invalid__gt=0).exists()
    assert lifecycle.work_units_feed(project_id=replica_project.pk) == 1  # its samples are fed anew


def test_a_replica_that_fails_its_own_checks_is_invalid_at_once_and_resent(
    replica_project: Project, volunteer_user: User, other_volunteer: User
) -> None:
    first, broken = assign(volunteer_user), assign(other_volunteer)
    assert receive(volunteer_user, first).status == "pending"
    outcome = receive(other_volunteer, broken, tampered(broken.work_unit, "nan"))
    assert outcome.status == "invalid" and outcome.credit_flops == 0
    unit = work_unit(first)
    assert (unit.status, unit.wanted, unit.error_results) == (WorkUnit.Status.OPEN, 1, 1)
    assert judged(first).validation == Result.Validation.PENDING
    carol = user("carol")
    assert receive(carol, assign(carol)).status == "valid"
    assert judged(first).is_valid and work_unit(first).canonical_result_id == first.pk


def test_a_replica_that_times_out_is_resent(
    replica_project: Project, volunteer_user: User, other_volunteer: User
) -> None:
    first, slow = assign(volunteer_user), assign(other_volunteer)
    assert receive(volunteer_user, first).status == "pending"
    Result.objects.filter(pk=slow.pk).update(deadline=timezone.now() - timedelta(seconds=1))
    assert lifecycle.results_expire() == [replica_project.pk]
    unit = work_unit(first)
    assert (unit.status, unit.wanted, unit.error_results) == (WorkUnit.Status.OPEN, 1, 1)
    assert receive(other_volunteer, slow).status == "late"
    carol = user("carol")
    resent = assign(carol)
    assert resent.work_unit_id == first.work_unit_id
    assert receive(carol, resent).status == "valid"
    assert judged(first).is_valid and credited(other_volunteer) == 0


def test_a_released_replica_goes_to_another_volunteer(
    replica_project: Project, volunteer_user: User, other_volunteer: User
) -> None:
    first, replica = assign(volunteer_user), assign(other_volunteer)
    assert lifecycle.results_release(user=other_volunteer, work_unit_ids=[replica.work_unit_id]) == 1
    unit = work_unit(first)
    assert (unit.wanted, unit.total_results, unit.target_results, unit.error_results) == (1, 1, 2, 0)
    assert assign(user("carol")).work_unit_id == first.work_unit_id


def test_a_result_whose_replicas_keep_failing_is_late_when_the_work_unit_errors(
    replica_project: Project, volunteer_user: User
) -> None:
    first = assign(volunteer_user)
    assert receive(volunteer_user, first).status == "pending"
    for attempt in range(work_unit(first).max_error_results):
        instance = assign(user(f"flaky{attempt}"))
        assert instance.work_unit_id == first.work_unit_id
        Result.objects.filter(pk=instance.pk).update(deadline=timezone.now() - timedelta(seconds=1))
        lifecycle.results_expire()
    assert work_unit(first).status == WorkUnit.Status.ERRORED
    waited = judged(first)
    assert waited.status == Result.Status.CANCELLED and waited.validation == Result.Validation.PENDING
    assert receive(volunteer_user, first).status == "late" and not CreditEntry.objects.exists()


@pytest.mark.parametrize(("how", "status"), [("honest", "valid"), ("sign_flip", "invalid")])
def test_a_result_arriving_after_its_work_unit_was_decided_is_judged_but_never_aggregated(
    replica_project: Project, volunteer_user: User, other_volunteer: User, how: str, status: str
) -> None:
    Project.objects.filter(pk=replica_project.pk).update(round_samples=50)
    first, replica = assign(volunteer_user), assign(other_volunteer)
    WorkUnit.objects.filter(pk=first.work_unit_id).update(wanted=1)  # a third instance in flight
    carol = user("carol")
    straggler = assign(carol)
    assert straggler.work_unit_id == first.work_unit_id
    receive(volunteer_user, first)
    assert receive(other_volunteer, replica).status == "valid"
    assert replica_project.current_version().number == 1  # decided and aggregated
    payload = honest_update(straggler.work_unit) if how == "honest" else tampered(straggler.work_unit, how)

    outcome = receive(carol, straggler, payload)

    assert outcome.status == status, outcome.reason
    assert outcome.credit_flops == (replica_project.flops_per_sample * 50 if how == "honest" else 0)
    unit = work_unit(first)
    assert (unit.status, unit.canonical_result_id, unit.wanted, unit.error_results) == (
        WorkUnit.Status.VALIDATED,
        first.pk,
        0,
        0,
    )
    assert not judged(straggler).aggregated and replica_project.current_version().number == 1
    assert training.project_step(project_id=replica_project.pk) is None
    assert replica_project.current_version().samples == 50


def test_a_timed_out_round_does_not_wait_for_a_missing_replica(
    replica_project: Project, volunteer_user: User
) -> None:
    Project.objects.filter(pk=replica_project.pk).update(spot_check_rate=0.0)
    dave = user("dave")
    trust(dave, project=replica_project)
    assert receive(dave, assign(dave)).status == "valid"  # trusted, rate 0: not replicated
    waiting = assign(volunteer_user)  # untrusted: replicated, but nobody takes the replica
    assert receive(volunteer_user, waiting).status == "pending"
    long_ago = timezone.now() - timedelta(minutes=5)
    ModelVersion.objects.filter(project=replica_project).update(created_at=long_ago)

    assert training.rounds_close_expired() == [replica_project.pk]

    assert replica_project.current_version().samples == 50  # dave's slice only
    late = judged(waiting)
    assert late.status == Result.Status.CANCELLED and not late.aggregated
    assert receive(volunteer_user, waiting).status == "late"
    assert credited(volunteer_user) == 0


def test_pausing_cancels_results_waiting_for_their_replica(
    replica_project: Project, volunteer_user: User, other_volunteer: User
) -> None:
    first, replica = assign(volunteer_user), assign(other_volunteer)
    assert receive(volunteer_user, first).status == "pending"
    project_pause(project=replica_project)
    assert receive(volunteer_user, first).status == "late"
    assert receive(other_volunteer, replica).status == "late"
    assert not CreditEntry.objects.exists()
    assert not lifecycle.results_unvalidated()


def test_results_waiting_for_a_replica_are_not_retried_as_lost_validations(
    replica_project: Project, volunteer_user: User
) -> None:
    first = assign(volunteer_user)
    assert receive(volunteer_user, first).status == "pending"
    Result.objects.filter(pk=first.pk).update(received_at=timezone.now() - timedelta(minutes=5))
    assert lifecycle.results_unvalidated() == []
    Result.objects.filter(pk=first.pk).update(checked=False)  # as if its validation had been lost
    assert lifecycle.results_unvalidated() == [first.pk]


@pytest.mark.parametrize(("how", "status"), [("honest", "valid"), ("scaled", "invalid")])
def test_dropout_replicas_are_compared_statistically(
    cnn_project: Project, volunteer_user: User, other_volunteer: User, how: str, status: str
) -> None:
    Project.objects.filter(pk=cnn_project.pk).update(spot_check_by=Project.SpotCheckBy.REPLICA)
    first, replica = assign(volunteer_user), assign(other_volunteer)
    torch.manual_seed(1)
    payload = honest_update(first.work_unit)
    torch.manual_seed(2)  # another dropout mask: not the same bytes, only the same direction and size
    other = honest_update(replica.work_unit) if how == "honest" else tampered(replica.work_unit, how)
    assert payload != other
    assert receive(volunteer_user, first, payload).status == "pending"
    outcome = receive(other_volunteer, replica, other)
    if status == "valid":
        assert outcome.status == "valid" and judged(first).is_valid
    else:  # one against one: not decided yet, a third volunteer is asked
        assert outcome.status == "pending" and work_unit(first).target_results == 3
