"""The BOINC work-unit lifecycle on PostgreSQL: feeding, sending, receiving, releasing, timing out."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

import numpy as np
import pytest
from django.contrib.auth.models import User
from django.utils import timezone
from pytest_django.fixtures import Settings

from projects import lifecycle, training
from projects.datasets import dataset_load_split, shard_slices, slices_load, work_unit_slices
from projects.lifecycle import ResultError
from projects.models import ModelVersion, Project, Result, WorkUnit
from tests.integration.volunteer import assign, honest_update, judged, receive
from workers import fitting
from workers.models import CreditEntry, Device, Volunteer
from workers.protocol import assign_message

pytestmark = pytest.mark.django_db(transaction=True)


def test_feeder_fills_one_round_and_is_idempotent(mlp_project: Project) -> None:
    units = WorkUnit.objects.filter(project=mlp_project, status=WorkUnit.Status.OPEN)
    assert sum(u.count for u in units) == mlp_project.round_samples  # start() fed it
    assert lifecycle.work_units_feed(project_id=mlp_project.pk) == 0
    assert sorted((u.shard.index, u.offset, u.count) for u in units) == [(0, 0, 50), (0, 50, 50)]


def test_each_volunteer_gets_its_own_instance(
    mlp_project: Project, volunteer_user: User, other_volunteer: User
) -> None:
    first, second = assign(volunteer_user), assign(other_volunteer)
    assert first.work_unit_id != second.work_unit_id
    assert lifecycle.work_unit_assign(user=volunteer_user) is None  # the round is all handed out
    assert first.deadline > timezone.now() and first.status == Result.Status.IN_PROGRESS


def assign_to_slow_device(project: Project, user: User, samples_per_second: int) -> Result | None:
    """An instance for `user`'s device that computes `samples_per_second` of `project`'s samples (its units
    take a second)."""
    project.target_seconds = 1
    project.save()
    gflops = samples_per_second * project.flops_per_sample / 1e9
    device = Device.objects.create(
        volunteer=Volunteer.objects.create(user=user), backend="webgl", gflops=gflops
    )
    return lifecycle.work_unit_assign(user=user, device=device)


def test_slow_devices_get_smaller_work_units(mlp_project: Project, volunteer_user: User) -> None:
    result = assign_to_slow_device(mlp_project, volunteer_user, 20)
    assert result is not None and result.work_unit.count == 20
    rest = WorkUnit.objects.get(offset=20, count=30)
    assert rest.shard_id == result.work_unit.shard_id and rest.wanted == 1


def test_a_work_unit_larger_than_what_is_left_of_its_shard_runs_on_into_the_next(
    wide_units: Project, volunteer_user: User, other_volunteer: User
) -> None:
    units = list(WorkUnit.objects.filter(project=wide_units).order_by("pk"))
    assert [(u.shard.index, u.offset, u.count) for u in units] == [(0, 0, 400), (1, 100, 400), (2, 200, 400)]
    train_x, train_y = dataset_load_split(dataset=wide_units.dataset, split="train")
    order = np.r_[0:1000, 0:200]  # the third wraps round to the split's start
    for unit, start in zip(units, (0, 400, 800), strict=True):
        x, y = slices_load(work_unit_slices(work_unit=unit))
        np.testing.assert_array_equal(x, train_x[order[start : start + 400]])
        np.testing.assert_array_equal(y, train_y[order[start : start + 400]])

    users = (volunteer_user, other_volunteer, User.objects.create_user("carol", password="carol-pass-123"))
    results = sorted((assign(user) for user in users), key=lambda r: r.work_unit_id)
    parts = [
        [(p["url"].split("?")[0], p["offset"], p["count"]) for p in assign_message(r)["work_unit"]["shards"]]
        for r in results
    ]
    urls = {s.index: s.blob.url for s in wide_units.dataset.shards.filter(split="train")}
    assert parts == [
        [(urls[0], 0, 300), (urls[1], 0, 100)],
        [(urls[1], 100, 200), (urls[2], 0, 200)],
        [(urls[2], 200, 100), (urls[3], 0, 100), (urls[0], 0, 200)],
    ]
    assert {urls[2], urls[3], urls[0]} <= {
        f"/blobs/{sha}" for sha in fitting.work_unit_blobs(results[2].work_unit)
    }

    for result in results:
        receive(result.volunteer, result)
        assert judged(result).validation == Result.Validation.VALID
    training.project_step(project_id=wide_units.pk)
    assert wide_units.current_version().number == 1


def test_the_rest_of_a_unit_split_for_a_slow_device_starts_in_the_right_shard(
    wide_units: Project, volunteer_user: User
) -> None:
    result = assign_to_slow_device(wide_units, volunteer_user, 350)
    assert result is not None and (result.work_unit.offset, result.work_unit.count) == (0, 350)
    rest = WorkUnit.objects.get(project=wide_units, count=50)
    assert (rest.shard.index, rest.offset) == (1, 50)


def test_a_unit_that_wraps_past_the_splits_end_is_split_there_for_a_slower_device(
    wide_units: Project, volunteer_user: User
) -> None:
    """A crowd averaging unit may hold nearly the whole training split, and so read on past its end from its
    start. Cut for a slower device past that end, it raised "more than the split holds": shard_position
    counted on to the split's end only."""
    Project.objects.filter(pk=wide_units.pk).update(mode="averaging", crowd_rounds=True, target_seconds=40)
    project = Project.objects.get(pk=wide_units.pk)
    WorkUnit.objects.filter(project=project).delete()
    last = project.dataset.shards.get(split="train", index=3)  # 100 samples: the split's last
    WorkUnit.objects.create(
        project=project, version=project.current_version(), shard=last, offset=50, count=990
    )
    # A late round: units take a quarter of target_seconds, 10 s, however late (Project.unit_seconds).
    late = timezone.now() - timedelta(seconds=100)
    ModelVersion.objects.filter(pk=project.current_version().pk).update(created_at=late)
    whole = slices_load(shard_slices(first=last, offset=50, count=990))[0]
    gflops = 97.5 * project.flops_per_sample / 1e9  # 970 samples in 10 s: 50 + 970 > 1000
    device = Device.objects.create(volunteer=Volunteer.objects.create(user=volunteer_user), gflops=gflops)
    result = lifecycle.work_unit_assign(user=volunteer_user, device=device)
    assert result is not None and 950 < (front := result.work_unit.count) < 990
    rest = WorkUnit.objects.exclude(pk=result.work_unit.pk).get(project=project)
    assert (rest.shard.index, rest.offset, rest.count) == (3, front - 950, 990 - front)
    parts = [slices_load(work_unit_slices(work_unit=unit))[0] for unit in (result.work_unit, rest)]
    np.testing.assert_array_equal(np.concatenate(parts), whole)


def test_crowd_averaging_units_are_sized_by_time_not_by_shards(wide_units: Project) -> None:
    wide_units.mode, wide_units.crowd_rounds = Project.Mode.AVERAGING, True
    assert wide_units.max_unit_samples == 1000  # the training split, not a shard's 300
    assert wide_units.work_unit_samples(gflops=1e6) == 1000


def test_results_only_from_the_assigned_volunteer(
    mlp_project: Project, volunteer_user: User, other_volunteer: User
) -> None:
    result = assign(volunteer_user)
    with pytest.raises(ResultError) as stolen:
        receive(other_volunteer, result)
    assert stolen.value.code == "not_assigned"
    with pytest.raises(ResultError) as unknown:
        lifecycle.result_receive(
            user=volunteer_user, work_unit_id=10**9, samples=1, loss=0.0, compute_ms=0, payload=b""
        )
    assert unknown.value.code == "unknown_work_unit"
    assert Result.objects.get().status == Result.Status.IN_PROGRESS and not CreditEntry.objects.exists()


def test_oversize_updates_are_refused_before_anything_is_stored(
    mlp_project: Project, volunteer_user: User, settings: Settings
) -> None:
    settings.CROWDTRAIN = {**settings.CROWDTRAIN, "MAX_RESULT_BYTES": 1000}
    result = assign(volunteer_user)
    with pytest.raises(ResultError) as refused:
        receive(volunteer_user, result)
    assert refused.value.code == "too_large"
    result.refresh_from_db()
    assert result.status == Result.Status.IN_PROGRESS and result.blob is None


def test_duplicate_results_are_idempotent(mlp_project: Project, volunteer_user: User) -> None:
    result = assign(volunteer_user)
    payload = honest_update(result.work_unit)
    first = receive(volunteer_user, result, payload)
    again = receive(volunteer_user, result, payload)
    # The same outcome; the recent average only decayed in between (it is read as of each answer).
    assert first.status == "valid" and replace(again, recent_credit=first.recent_credit) == first
    assert again.recent_credit == pytest.approx(first.recent_credit, rel=1e-6)
    assert CreditEntry.objects.count() == 1


def test_released_work_goes_back_to_the_pool_without_penalty(
    mlp_project: Project, volunteer_user: User, other_volunteer: User
) -> None:
    result = assign(volunteer_user)
    assert lifecycle.results_release(user=other_volunteer, work_unit_ids=[result.work_unit_id]) == 0
    assert lifecycle.results_release(user=volunteer_user, work_unit_ids=[result.work_unit_id]) == 1
    work_unit = WorkUnit.objects.get(pk=result.work_unit_id)
    assert (work_unit.wanted, work_unit.error_results, work_unit.status) == (1, 0, WorkUnit.Status.OPEN)
    assert assign(other_volunteer).work_unit_id == work_unit.pk


def test_timed_out_work_is_resent_and_the_late_result_earns_nothing(
    mlp_project: Project, volunteer_user: User, other_volunteer: User
) -> None:
    result = assign(volunteer_user)
    Result.objects.filter(pk=result.pk).update(deadline=timezone.now() - timedelta(seconds=1))
    assert lifecycle.results_expire() == [mlp_project.pk]
    assert WorkUnit.objects.get(pk=result.work_unit_id).error_results == 1
    late = receive(volunteer_user, result)
    assert late.status == "late" and late.credit_flops == 0
    assert assign(other_volunteer).work_unit_id == result.work_unit_id


def test_work_that_keeps_failing_is_marked_errored(mlp_project: Project) -> None:
    work_unit = WorkUnit.objects.filter(project=mlp_project).first()
    assert work_unit is not None
    for attempt in range(work_unit.max_error_results):
        user = User.objects.create_user(f"flaky{attempt}")
        result = lifecycle.work_unit_assign(user=user)
        assert result is not None and result.work_unit_id == work_unit.pk
        Result.objects.filter(pk=result.pk).update(deadline=timezone.now() - timedelta(seconds=1))
        lifecycle.results_expire()
    work_unit.refresh_from_db()
    assert work_unit.status == WorkUnit.Status.ERRORED
    assert lifecycle.work_units_feed(project_id=mlp_project.pk) == 1  # its samples are fed anew


def test_pause_cancels_open_work_and_stops_sending(mlp_project: Project, volunteer_user: User) -> None:
    from projects.services import project_pause

    result = assign(volunteer_user)
    project_pause(project=mlp_project)
    assert lifecycle.work_unit_assign(user=volunteer_user) is None
    assert not WorkUnit.objects.filter(status=WorkUnit.Status.OPEN).exists()
    assert receive(volunteer_user, result).status == "late"
