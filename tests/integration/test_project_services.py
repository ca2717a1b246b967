"""Synchronous data-parallel training through the services, on PostgreSQL with real digits."""

from __future__ import annotations

import math

import pytest
import torch
from django.contrib.auth.models import User

from engine import codecs
from engine.flops import train_flops_per_sample
from projects import services
from projects.models import ModelVersion, Project, Result, WorkUnit
from projects.services import ProjectError, ResultError
from tests.integration.volunteer import honest_update
from workers.models import CreditEntry, Volunteer

pytestmark = pytest.mark.django_db(transaction=True)


def submit(user: User, work_unit: WorkUnit, payload: bytes | None = None, loss: float = 1.0):  # type: ignore[no-untyped-def]
    if payload is None:
        payload, loss = honest_update(work_unit)
    return services.result_submit(
        user=user,
        work_unit_id=work_unit.pk,
        samples=work_unit.count,
        loss=loss,
        compute_ms=5,
        payload=payload,
    )


def test_project_create_publishes_version_zero_with_server_side_flops(mlp_project: Project) -> None:
    version = mlp_project.current_version()
    assert version.number == 0
    assert set(services.version_weights(version=version)) == {
        p.name for p in services.project_graph(project=mlp_project).params
    }
    assert mlp_project.flops_per_sample == train_flops_per_sample(services.project_graph(project=mlp_project))
    assert mlp_project.flops_per_sample > 0


def test_project_create_rejects_a_model_that_does_not_fit_the_dataset(
    researcher: User, digits_dataset
) -> None:  # type: ignore[no-untyped-def]
    digits_dataset.input_shape = [3, 32, 32]
    digits_dataset.save()
    with pytest.raises(ProjectError, match="expects samples of shape"):
        services.project_create(owner=researcher, name="bad", dataset=digits_dataset, preset="mlp")
    assert not Project.objects.filter(name="bad").exists()


def test_feeder_fills_one_round_and_is_idempotent(mlp_project: Project) -> None:
    units = WorkUnit.objects.filter(project=mlp_project, status=WorkUnit.Status.READY)
    assert sum(u.count for u in units) == mlp_project.round_samples  # start() fed it eagerly
    assert services.work_units_feed(project_id=mlp_project.pk) == 0
    offsets = sorted((u.shard.index, u.offset) for u in units)
    assert offsets == [(0, 0), (0, 50)]


def test_assignment_is_exclusive(mlp_project: Project, volunteer_user: User, other_volunteer: User) -> None:
    first = services.work_unit_assign(user=volunteer_user)
    second = services.work_unit_assign(user=other_volunteer)
    assert first and second and first.pk != second.pk
    assert services.work_unit_assign(user=volunteer_user) is None
    first.refresh_from_db()
    assert first.assigned_to == volunteer_user and first.deadline is not None


def test_accepted_result_is_credited_from_server_flops(mlp_project: Project, volunteer_user: User) -> None:
    work_unit = services.work_unit_assign(user=volunteer_user)
    assert work_unit is not None
    outcome = submit(volunteer_user, work_unit)
    assert outcome.accepted, outcome.reason
    assert outcome.credit_flops == mlp_project.flops_per_sample * work_unit.count
    assert outcome.total_credit_flops == outcome.credit_flops
    assert Volunteer.objects.get(user=volunteer_user).total_flops == outcome.credit_flops


def test_duplicate_result_is_idempotent(mlp_project: Project, volunteer_user: User) -> None:
    work_unit = services.work_unit_assign(user=volunteer_user)
    assert work_unit is not None
    first = submit(volunteer_user, work_unit)
    again = submit(volunteer_user, work_unit)
    assert again == first
    assert CreditEntry.objects.count() == 1 and Result.objects.count() == 1


def test_results_only_from_the_assigned_volunteer(
    mlp_project: Project, volunteer_user: User, other_volunteer: User
) -> None:
    work_unit = services.work_unit_assign(user=volunteer_user)
    assert work_unit is not None
    with pytest.raises(ResultError) as stolen:
        submit(other_volunteer, work_unit)
    assert stolen.value.code == "not_assigned"
    with pytest.raises(ResultError) as unknown:
        services.result_submit(
            user=volunteer_user, work_unit_id=10**9, samples=1, loss=0.0, compute_ms=0, payload=b""
        )
    assert unknown.value.code == "unknown_work_unit"
    assert not Result.objects.exists() and not CreditEntry.objects.exists()


@pytest.mark.parametrize("poison", ["nan", "shape", "garbage", "samples"])
def test_bad_updates_are_rejected_without_credit_and_reissued(
    mlp_project: Project, volunteer_user: User, poison: str
) -> None:
    work_unit = services.work_unit_assign(user=volunteer_user)
    assert work_unit is not None
    payload, loss = honest_update(work_unit)
    grads = codecs.decode(payload)[0]
    name = next(iter(grads))
    samples = work_unit.count
    if poison == "nan":
        grads[name][0] = math.nan
        payload = codecs.encode(grads)
    elif poison == "shape":
        grads[name] = torch.zeros(3)
        payload = codecs.encode(grads)
    elif poison == "garbage":
        payload = b"\x00not safetensors"
    else:
        samples += 1
    outcome = services.result_submit(
        user=volunteer_user,
        work_unit_id=work_unit.pk,
        samples=samples,
        loss=loss,
        compute_ms=1,
        payload=payload,
    )
    assert not outcome.accepted and outcome.credit_flops == 0 and outcome.reason
    assert not CreditEntry.objects.exists()
    work_unit.refresh_from_db()
    assert work_unit.status == WorkUnit.Status.EXPIRED
    assert services.work_units_feed(project_id=mlp_project.pk) == 1  # the slice is handed out again


def test_full_round_steps_exactly_like_torch_sgd(
    mlp_project: Project, volunteer_user: User, other_volunteer: User
) -> None:
    v0 = mlp_project.current_version()
    grads = []
    for user in (volunteer_user, other_volunteer):
        work_unit = services.work_unit_assign(user=user)
        assert work_unit is not None
        payload, loss = honest_update(work_unit)
        grads.append((codecs.decode(payload)[0], work_unit.count))
        assert submit(user, work_unit, payload, loss).accepted
    v1 = ModelVersion.objects.get(project=mlp_project, number=1)  # eager Celery aggregated the full round

    params = {k: torch.nn.Parameter(v.clone()) for k, v in services.version_weights(version=v0).items()}
    optimizer = torch.optim.SGD(params.values(), lr=0.1, momentum=0.9)
    total = sum(n for _, n in grads)
    for name, param in params.items():
        param.grad = sum(g[name] * n for g, n in grads) / total  # type: ignore[assignment]
    optimizer.step()
    published = services.version_weights(version=v1)
    for name, param in params.items():
        torch.testing.assert_close(published[name], param.detach(), rtol=1e-6, atol=1e-7)
    assert v1.samples == total


def test_new_version_cancels_stale_work_and_late_results_earn_nothing(
    mlp_project: Project, volunteer_user: User, other_volunteer: User, researcher: User
) -> None:
    mlp_project.round_samples = 50
    mlp_project.save()
    late = services.work_unit_assign(user=other_volunteer)
    work_unit = services.work_unit_assign(user=volunteer_user)
    assert late and work_unit
    assert submit(volunteer_user, work_unit).accepted  # closes the 50-sample round
    late.refresh_from_db()
    assert late.status == WorkUnit.Status.CANCELLED
    outcome = submit(other_volunteer, late)
    assert not outcome.accepted and outcome.credit_flops == 0
    assert mlp_project.current_version().number == 1
    assert WorkUnit.objects.filter(version__number=1, status=WorkUnit.Status.READY).exists()


def test_expired_work_is_reissued(mlp_project: Project, volunteer_user: User) -> None:
    from datetime import timedelta

    from django.utils import timezone

    work_unit = services.work_unit_assign(user=volunteer_user)
    assert work_unit is not None
    WorkUnit.objects.filter(pk=work_unit.pk).update(deadline=timezone.now() - timedelta(seconds=1))
    assert services.work_units_expire() == [mlp_project.pk]
    work_unit.refresh_from_db()
    assert work_unit.status == WorkUnit.Status.EXPIRED
    assert not submit(volunteer_user, work_unit).accepted
    assert services.work_units_feed(project_id=mlp_project.pk) == 1


def test_released_work_goes_back_to_the_pool(
    mlp_project: Project, volunteer_user: User, other_volunteer: User
) -> None:
    work_unit = services.work_unit_assign(user=volunteer_user)
    assert work_unit is not None
    assert services.work_units_release(user=other_volunteer, work_unit_ids=[work_unit.pk]) == 0
    assert services.work_units_release(user=volunteer_user, work_unit_ids=[work_unit.pk]) == 1
    work_unit.refresh_from_db()
    assert work_unit.status == WorkUnit.Status.READY and work_unit.assigned_to is None


def test_pause_cancels_open_work_and_stops_assignment(mlp_project: Project, volunteer_user: User) -> None:
    services.project_pause(project=mlp_project)
    assert services.work_unit_assign(user=volunteer_user) is None
    assert not WorkUnit.objects.filter(status=WorkUnit.Status.READY).exists()


def test_evaluation_is_stored_once_per_version(mlp_project: Project) -> None:
    version = mlp_project.current_version()
    metrics = services.version_evaluate(version_id=version.pk)
    assert set(metrics) == {"test_loss", "test_accuracy"}
    assert 0.0 <= metrics["test_accuracy"] <= 0.3  # an untrained 10-class model
    assert services.version_evaluate(version_id=version.pk) == metrics
    assert version.metrics.count() == 2


def test_training_through_the_services_learns_digits(mlp_project: Project, volunteer_user: User) -> None:
    for _ in range(120):
        work_unit = services.work_unit_assign(user=volunteer_user)
        assert work_unit is not None
        assert submit(volunteer_user, work_unit).accepted
    version = mlp_project.current_version()
    assert version.number == 60
    assert services.version_evaluate(version_id=version.pk)["test_accuracy"] > 0.8
    ledger = sum(CreditEntry.objects.values_list("flops", flat=True))
    assert (
        ledger
        == Volunteer.objects.get(user=volunteer_user).total_flops
        == 120 * 50 * mlp_project.flops_per_sample
    )


def test_oversize_updates_are_refused_before_decoding(
    mlp_project: Project, volunteer_user: User, settings
) -> None:  # type: ignore[no-untyped-def]
    settings.CROWDTRAIN = {**settings.CROWDTRAIN, "MAX_RESULT_BYTES": 1000}
    work_unit = services.work_unit_assign(user=volunteer_user)
    assert work_unit is not None
    with pytest.raises(ResultError) as refused:
        submit(volunteer_user, work_unit)
    assert refused.value.code == "too_large"
    work_unit.refresh_from_db()
    assert work_unit.status == WorkUnit.Status.ASSIGNED and not Result.objects.exists()
