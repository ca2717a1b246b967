"""Issue 15's hot path on PostgreSQL: deciding a round costs the same whatever its size, crowd-sized rounds
give every connected volunteer work, and the hot queries use indexes on tables never analyzed."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.db import DatabaseError, connection, transaction
from django.db.models import Q, Sum
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from projects import lifecycle, training, validation
from projects.models import DatasetShard, ModelVersion, Project, Result, WorkUnit
from projects.services import project_pause
from workers.models import Device, Volunteer
from workers.preferences import preferences_effective, preferences_save
from workers.services import device_pause, device_register

pytestmark = pytest.mark.django_db


def _pending_round(project: Project, *, results: int) -> ModelVersion:
    """`results` canonical valid results of one sample each on the current version, as verdicts leave them."""
    version = project.current_version()
    shard = DatasetShard.objects.filter(dataset=project.dataset, split="train").first()
    user = User.objects.create_user(f"crowd-{results}")
    units = WorkUnit.objects.bulk_create(
        [
            WorkUnit(project=project, version=version, shard=shard, offset=i % 100, count=1, wanted=0)
            for i in range(results)
        ]
    )
    deadline = timezone.now() + timedelta(minutes=5)
    rows = Result.objects.bulk_create(
        [
            Result(
                work_unit=unit,
                volunteer=user,
                deadline=deadline,
                status="received",
                validation="valid",
                samples=1,
                checked=True,
            )
            for unit in units
        ]
    )
    for unit, row in zip(units, rows, strict=True):
        unit.status, unit.canonical_result = WorkUnit.Status.VALIDATED, row
    WorkUnit.objects.bulk_update(units, ["status", "canonical_result"])
    ModelVersion.objects.filter(pk=version.pk).update(valid_samples=results)
    return version


def _result_rows_read() -> int:
    """Rows of projects_result this transaction has read so far (pg_stat_xact_* counts are immediate)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT coalesce(seq_tup_read, 0) + coalesce(idx_tup_fetch, 0) FROM pg_stat_xact_user_tables "
            "WHERE relname = 'projects_result'"
        )
        return int(cursor.fetchone()[0])


def _round_ready_cost(project: Project) -> tuple[int, int]:
    before = _result_rows_read()
    with CaptureQueriesContext(connection) as queries:
        assert training.round_ready(project_id=project.pk) is False  # the target is not met yet
    return len(queries), _result_rows_read() - before


def test_round_ready_costs_the_same_with_10_or_300_pending_results(mlp_project: Project) -> None:
    """Was 4 queries, but the third fetched every pending result of the round: a round of n results cost
    O(n) per verdict, O(n^2) in all. Now the round's valid samples are a counter on its version."""
    Project.objects.filter(pk=mlp_project.pk).update(round_samples=10_000)
    _pending_round(mlp_project, results=10)
    small = _round_ready_cost(mlp_project)
    _pending_round(mlp_project, results=290)
    large = _round_ready_cost(mlp_project)
    assert large[0] == small[0] <= 4
    assert large[1] == small[1] <= 2


def test_announcing_a_batch_of_verdicts_costs_the_queries_of_announcing_two(mlp_project: Project) -> None:
    """A validation batch announces its verdicts together (tasks.validate_result): each one's volunteer
    total was a query of its own."""
    Project.objects.filter(pk=mlp_project.pk).update(round_samples=10_000)
    _pending_round(mlp_project, results=12)
    ids = list(Result.objects.order_by("pk").values_list("pk", flat=True))

    def cost(result_ids: list[int]) -> int:
        with CaptureQueriesContext(connection) as queries:
            training.results_decided(result_ids=result_ids)
        return len(queries)

    assert cost(ids[:2]) == cost(ids) <= 7


@pytest.mark.django_db(transaction=True)
def test_a_verdict_counts_its_samples_on_the_round_and_round_ready_agrees_with_the_step(
    mlp_project: Project, volunteer_user: User, other_volunteer: User
) -> None:
    from tests.integration.volunteer import assign, receive

    Project.objects.filter(pk=mlp_project.pk).update(round_samples=100)
    first = assign(volunteer_user)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("projects.notify.step_wanted", lambda **_: None)
        assert receive(volunteer_user, first).status == "valid"
        assert mlp_project.current_version().valid_samples == 50
        assert training.round_ready(project_id=mlp_project.pk) is False
        assert receive(other_volunteer, assign(other_volunteer)).status == "valid"
    assert mlp_project.current_version().valid_samples == 100
    assert training.round_ready(project_id=mlp_project.pk) is True
    assert training.project_step(project_id=mlp_project.pk) is not None
    assert training.round_ready(project_id=mlp_project.pk) is False  # the new version counts from 0


# --- crowd-sized rounds --------------------------------------------------------------------------------


def _crowd(count: int) -> list[User]:
    users = [User.objects.create_user(f"device-{i:03d}") for i in range(count)]
    for user in users:
        device_register(user=user, client_id=f"browser-{user.pk}", backend="wasm", gflops=5.0, user_agent="")
    return users


@pytest.mark.parametrize("crowd", [False, True])
def test_a_sync_round_offers_work_to_every_connected_device(mlp_project: Project, crowd: bool) -> None:
    Project.objects.filter(pk=mlp_project.pk).update(batch_size=64, round_samples=256, crowd_rounds=crowd)
    WorkUnit.objects.filter(project=mlp_project).delete()
    users = _crowd(32)
    lifecycle.work_units_feed(project_id=mlp_project.pk)
    served = [lifecycle.work_unit_assign(user=user, device=user.volunteer.devices.get()) for user in users]
    given = [result for result in served if result is not None]
    assert len(given) == (32 if crowd else 4)
    # The researcher's target batch is unchanged: the crowd shares it.
    assert sum(result.work_unit.count for result in given) == 256
    # ... and stays the live round_samples, not a copy fixed at the first feed (a change mid-round applies).
    assert mlp_project.current_version().round_target is None


def test_crowd_averaging_units_take_target_seconds_on_the_device(mlp_project: Project) -> None:
    Project.objects.filter(pk=mlp_project.pk).update(
        mode="averaging", batch_size=10, round_samples=20, crowd_rounds=True, target_seconds=20
    )
    WorkUnit.objects.filter(project=mlp_project).delete()
    project = Project.objects.get(pk=mlp_project.pk)
    users = _crowd(4)
    fits = int(20 * 5.0e9 / project.flops_per_sample)  # what a 5-GFLOPS device computes in 20 s
    lifecycle.work_units_feed(project_id=project.pk)
    result = lifecycle.work_unit_assign(user=users[0], device=users[0].volunteer.devices.get())
    assert result is not None
    shard_samples = DatasetShard.objects.filter(dataset=project.dataset, split="train").get(index=0).count
    assert result.work_unit.count == min(fits, shard_samples) > project.batch_size
    assert project.current_version().round_target == 4 * min(fits, shard_samples)


def test_a_crowd_averaging_round_fed_before_any_device_connects_is_small(mlp_project: Project) -> None:
    """No speed is known: round_samples in units of batch_size, not units sized for a guessed device (which,
    up to the whole training split each, planned a first round no real fleet finished)."""
    Project.objects.filter(pk=mlp_project.pk).update(
        mode="averaging", batch_size=10, round_samples=20, crowd_rounds=True, target_seconds=100
    )
    WorkUnit.objects.filter(project=mlp_project).delete()
    lifecycle.work_units_feed(project_id=mlp_project.pk)
    assert list(WorkUnit.objects.filter(project=mlp_project).values_list("count", flat=True)) == [10, 10]
    assert mlp_project.current_version().round_target == 20


def test_crowd_averaging_sizes_each_unit_for_its_own_device(mlp_project: Project) -> None:
    """Speeds spread 10x: each device's unit takes target_seconds on that device, not on the median one, so
    the fast device is not left waiting for slow ones (the median's unit would be 60 samples for all)."""
    Project.objects.filter(pk=mlp_project.pk).update(
        mode="averaging", batch_size=10, round_samples=20, crowd_rounds=True, target_seconds=100
    )
    WorkUnit.objects.filter(project=mlp_project).delete()
    fps = Project.objects.get(pk=mlp_project.pk).flops_per_sample
    sizes = [200, 80, 40, 20]  # samples each device computes in 100 s; fastest asks first
    users = [User.objects.create_user(f"spread-{size}") for size in sizes]
    for user, size in zip(users, sizes, strict=True):
        gflops = (size + 0.5) * fps / 100e9
        device_register(
            user=user, client_id=f"browser-{user.pk}", backend="wasm", gflops=gflops, user_agent=""
        )
    lifecycle.work_units_feed(project_id=mlp_project.pk)
    ModelVersion.objects.filter(pk=mlp_project.current_version().pk).update(created_at=timezone.now())
    served = [lifecycle.work_unit_assign(user=user, device=user.volunteer.devices.get()) for user in users]
    assert [result.work_unit.count for result in served if result is not None] == sizes
    assert mlp_project.current_version().round_target == sum(sizes)


@pytest.mark.parametrize(
    ("age", "start_ms", "seconds"),
    [(0, 0, 40), (10, 0, 30), (35, 0, 10), (50, 0, 10), (0, 5000, 35), (10, 10000, 20), (0, 60000, 10)],
)
def test_a_crowd_averaging_unit_ends_with_the_rounds_target_seconds(
    mlp_project: Project, age: int, start_ms: int, seconds: int
) -> None:
    """A device asking `age` seconds into a round gets what is left of its 40 s (at least 10 s), so that one
    that started late or came back for more finishes with the others; past them the round is late, and
    what is left goes out in units of 10 s, not whole ones that would hold the round another 40 s. A device
    that starts computing `start_ms` after its unit is sent (Device.start_ms, observed) gets that much less:
    planned from the sending alone, units ended as late as their downloads took, and the round waited for
    them. The round's plan counts it too."""
    Project.objects.filter(pk=mlp_project.pk).update(
        mode="averaging", batch_size=10, round_samples=10, crowd_rounds=True, target_seconds=40
    )
    WorkUnit.objects.filter(project=mlp_project).delete()
    project = Project.objects.get(pk=mlp_project.pk)
    user = User.objects.create_user("late")
    gflops = 20.5 * project.flops_per_sample / 1e9  # 20 samples a second: 800 in 40 s (the shard has 1,000)
    device = device_register(
        user=user, client_id="browser-late", backend="wasm", gflops=gflops, user_agent=""
    )
    type(device).objects.filter(pk=device.pk).update(start_ms=start_ms)
    lifecycle.work_units_feed(project_id=project.pk)
    planned = project.work_unit_samples(gflops=gflops, seconds=max(10, 40 - start_ms / 1000))
    assert project.current_version().round_target == planned
    ModelVersion.objects.filter(pk=project.current_version().pk).update(
        created_at=timezone.now() - timedelta(seconds=age)
    )
    result = lifecycle.work_unit_assign(user=user, device=user.volunteer.devices.get())
    assert result is not None
    # (the second the test itself takes)
    fits = [project.work_unit_samples(gflops=gflops, seconds=s) for s in (seconds - 1, seconds)]
    assert fits[0] <= result.work_unit.count <= fits[1]


def _late_comer(project: Project, name: str, samples_per_second: float) -> User:
    user = User.objects.create_user(name)
    gflops = (samples_per_second + 0.5) * project.flops_per_sample / 1e9
    device_register(user=user, client_id=f"browser-{name}", backend="wasm", gflops=gflops, user_agent="")
    return user


def _round_started(project: Project, *, seconds_ago: float) -> None:
    ModelVersion.objects.filter(pk=project.current_version().pk).update(
        created_at=timezone.now() - timedelta(seconds=seconds_ago)
    )


def _crowd_averaging(project: Project, **fields: Any) -> Project:
    settings = {"mode": "averaging", "batch_size": 10, "round_samples": 10, "crowd_rounds": True}
    Project.objects.filter(pk=project.pk).update(**{**settings, "target_seconds": 40, **fields})
    WorkUnit.objects.filter(project=project).delete()
    return Project.objects.get(pk=project.pk)


def _unsent(project: Project) -> int:
    unsent = Sum("count", filter=Q(status="open", wanted__gt=0))
    return WorkUnit.objects.filter(project=project).aggregate(n=unsent)["n"] or 0


@pytest.mark.parametrize(("age", "seconds"), [(5, 35), (18, 22), (29, 11), (31, None), (50, None)])
def test_a_device_that_comes_mid_round_gets_a_unit_that_ends_with_it_and_the_round_waits_for_it(
    mlp_project: Project, age: int, seconds: int | None
) -> None:
    """The round's target is fixed when it is planned, so a device connecting later found no work and waited
    for the next round (at 64 volunteers signing in, 45 computed nothing for 41 s). Now the feeder gives it
    a unit of what is left of the round's 40 s, while a whole quarter is left (a unit sent later still takes
    10 s and would end after the round), and the round's target grows by it: outside the target, the round
    closed on its planned samples before such units ended, and cancelled them."""
    project = _crowd_averaging(mlp_project)
    first = _late_comer(project, "on-time", 100)  # its unit: the whole training split, so nothing is left
    lifecycle.work_units_feed(project_id=project.pk)
    assert lifecycle.work_unit_assign(user=first, device=first.volunteer.devices.get()) is not None
    target = project.current_version().round_target
    assert target is not None
    _round_started(project, seconds_ago=age)
    joiner = _late_comer(project, "late-comer", 10)
    created = lifecycle.work_units_feed(project_id=project.pk)
    added = _unsent(project)
    result = lifecycle.work_unit_assign(user=joiner, device=joiner.volunteer.devices.get())
    if seconds is None:
        assert (created, result, project.current_version().round_target) == (0, None, target)
        return
    assert created == 1 and result is not None
    # (the second the test itself takes)
    gflops = 10.5 * project.flops_per_sample / 1e9
    fits = [project.work_unit_samples(gflops=gflops, seconds=s) for s in (seconds - 1, seconds)]
    assert fits[0] <= result.work_unit.count <= fits[1]
    assert project.current_version().round_target == target + added
    assert training.round_close_samples(project=project, current=project.current_version()) > target


def test_late_comers_get_what_is_still_unsent_first(mlp_project: Project) -> None:
    """The feeder adds only what the devices without a unit of the round need beyond its unsent samples (a
    planned unit not sent yet, what a split left), the target grows by exactly what it adds, and nothing
    more is added when fed again; a device computing one of its units gets none (it ends with the round)."""
    project = _crowd_averaging(mlp_project)
    first, second = _late_comer(project, "first", 20), _late_comer(project, "second", 20)
    lifecycle.work_units_feed(project_id=project.pk)
    assert lifecycle.work_unit_assign(user=first, device=first.volunteer.devices.get()) is not None
    before, target = _unsent(project), project.current_version().round_target
    assert target is not None
    _round_started(project, seconds_ago=5)
    late = [_late_comer(project, f"late-{i}", 10) for i in range(3)]
    assert lifecycle.work_units_feed(project_id=project.pk) > 0
    assert lifecycle.work_units_feed(project_id=project.pk) == 0
    largest = project.work_unit_samples(gflops=20.5 * project.flops_per_sample / 1e9, seconds=35)
    need = largest + 3 * project.work_unit_samples(gflops=10.5 * project.flops_per_sample / 1e9, seconds=35)
    after = _unsent(project)
    assert before < need <= after < need + largest  # in units of the largest need: never one too many
    assert project.current_version().round_target == target + after - before
    served = [lifecycle.work_unit_assign(user=u, device=u.volunteer.devices.get()) for u in [second, *late]]
    assert all(result is not None for result in served)
    assert lifecycle.work_unit_assign(user=first, device=first.volunteer.devices.get()) is None


def test_devices_connected_before_the_round_began_do_not_grow_it(mlp_project: Project) -> None:
    """The round was planned for them: one that never takes a unit of it (busy with another project's
    work, say), its planned unit computed by another, must not add units to it at every beat of the
    feeder."""
    project = _crowd_averaging(mlp_project)
    working, _elsewhere = _late_comer(project, "working", 10), _late_comer(project, "elsewhere", 10)
    ModelVersion.objects.filter(pk=project.current_version().pk).update(created_at=timezone.now())
    lifecycle.work_units_feed(project_id=project.pk)
    assert lifecycle.work_unit_assign(user=working, device=working.volunteer.devices.get()) is not None
    assert lifecycle.work_unit_assign(user=User.objects.create_user("no-device")) is not None
    target, units = project.current_version().round_target, WorkUnit.objects.filter(project=project).count()
    for _ in range(3):
        assert lifecycle.work_units_feed(project_id=project.pk) == 0
    assert project.current_version().round_target == target
    assert WorkUnit.objects.filter(project=project).count() == units


def _choosing_only(user: User, project_id: int) -> None:
    """The volunteer chose only that project."""
    preferences_save(
        volunteer=user.volunteer, device=None, values={"projects": "only"}, chosen_projects=[project_id]
    )


def test_a_crowd_round_is_planned_for_the_devices_that_may_take_its_units(
    mlp_project: Project, second_project: Project
) -> None:
    """In a multi-project server, devices whose volunteers chose another project are not counted: a round
    planned for them had units nobody here would take (computed late as leftovers, or closed by its time)."""
    project = _crowd_averaging(mlp_project)
    here = [_late_comer(project, f"here-{i}", 10) for i in range(2)]
    for user in here:  # theirs whole (a device the other project may use too gives it its share of time)
        _choosing_only(user, project.pk)
    for i in range(3):
        _choosing_only(_late_comer(project, f"elsewhere-{i}", 10), second_project.pk)
    lifecycle.work_units_feed(project_id=project.pk)
    gflops = 10.5 * project.flops_per_sample / 1e9
    fits = [project.work_unit_samples(gflops=gflops, seconds=s) for s in (39, 40)]  # (the test's second)
    assert project.current_version().round_target == 2 * fits[1]
    assert WorkUnit.objects.filter(project=project).count() == 2
    served = [lifecycle.work_unit_assign(user=u, device=u.volunteer.devices.get()) for u in here]
    assert all(result and fits[0] <= result.work_unit.count <= fits[1] for result in served)


def _fits(project: Project, seconds: float) -> int:
    """Samples a _late_comer of 10 samples/s (10.5 counted, so that rounding never takes one off) computes
    in `seconds`."""
    return project.work_unit_samples(gflops=10.5 * project.flops_per_sample / 1e9, seconds=seconds)


def _shared_fleet(project: Project, other: Project) -> tuple[list[User], User]:
    """Two devices any running project may use, and one whose volunteer chose only `project`."""
    shared = [_late_comer(project, f"shared-{i}", 10) for i in range(2)]
    only = _late_comer(project, "only-here", 10)
    _choosing_only(only, project.pk)
    _choosing_only(_late_comer(project, "only-there", 10), other.pk)
    return shared, only


@pytest.mark.parametrize(("other_share", "shared_seconds"), [(100, 20), (300, 10), (0, 40)])
def test_a_crowd_round_plans_the_time_its_share_gives_it_on_devices_other_projects_use(
    mlp_project: Project, second_project: Project, other_share: int, shared_seconds: int
) -> None:
    """The fair-share order gives each running project a device's time in proportion to its resource
    share: a round planned for the whole of devices another project also ran waited for them twice as
    long with two equal shares. A share of 0 takes only what the others leave: nothing off the plan."""
    Project.objects.filter(pk=second_project.pk).update(resource_share=other_share)
    project = _crowd_averaging(mlp_project)
    shared, only = _shared_fleet(project, second_project)
    lifecycle.work_units_feed(project_id=project.pk)
    assert project.current_version().round_target == 2 * _fits(project, shared_seconds) + _fits(project, 40)
    for user in shared:
        result = lifecycle.work_unit_assign(user=user, device=user.volunteer.devices.get())
        assert result is not None
        assert _fits(project, shared_seconds - 1) <= result.work_unit.count <= _fits(project, shared_seconds)


@pytest.mark.parametrize(("age", "seconds"), [(10, 20), (25, 15), (35, 10)])
def test_a_device_another_project_uses_is_sent_its_share_of_the_round_or_the_rest_of_it(
    mlp_project: Project, second_project: Project, age: int, seconds: int
) -> None:
    """Its share of the round (20 of 40 s), or less if less is left: once it has computed the other
    project's unit, the rest of the round is this one's."""
    project = _crowd_averaging(mlp_project)
    shared, _ = _shared_fleet(project, second_project)
    lifecycle.work_units_feed(project_id=project.pk)
    _round_started(project, seconds_ago=age)
    result = lifecycle.work_unit_assign(user=shared[0], device=shared[0].volunteer.devices.get())
    assert result is not None
    assert _fits(project, seconds - 1) <= result.work_unit.count <= _fits(project, seconds)


def test_a_crowd_round_counts_whole_devices_once_the_other_project_stops(
    mlp_project: Project, second_project: Project
) -> None:
    project_pause(project=second_project)
    project = _crowd_averaging(mlp_project)
    _shared_fleet(project, second_project)
    lifecycle.work_units_feed(project_id=project.pk)
    assert project.current_version().round_target == 3 * _fits(project, 40)


def test_a_late_comer_another_project_may_use_joins_for_its_share_of_the_rest(
    mlp_project: Project, second_project: Project
) -> None:
    project = _crowd_averaging(mlp_project)
    first = _late_comer(project, "first", 100)  # its unit: the whole training split, so nothing is left
    _choosing_only(first, project.pk)
    lifecycle.work_units_feed(project_id=project.pk)
    assert lifecycle.work_unit_assign(user=first, device=first.volunteer.devices.get()) is not None
    target = project.current_version().round_target or 0
    _round_started(project, seconds_ago=10)  # 30 s left, and this project's share of a round is 20 s
    _late_comer(project, "late-shared", 10)
    assert lifecycle.work_units_feed(project_id=project.pk) == 1
    assert (project.current_version().round_target or 0) - target == _fits(project, 20)


def test_a_crowd_round_is_not_planned_for_paused_devices(mlp_project: Project) -> None:
    """A browser paused for a while (a hidden tab, a battery) says so (`pause`): it would take no unit."""
    project = _crowd_averaging(mlp_project)
    working, paused = _late_comer(project, "working", 10), _late_comer(project, "paused", 10)
    device = paused.volunteer.devices.get()
    device_pause(device_id=device.pk, paused=True, connection=device.connection)
    lifecycle.work_units_feed(project_id=project.pk)
    fits = project.work_unit_samples(gflops=10.5 * project.flops_per_sample / 1e9, seconds=40)
    assert project.current_version().round_target == fits
    assert lifecycle.work_unit_assign(user=working, device=working.volunteer.devices.get()) is not None


def _connected_long_ago() -> None:
    """Every device connected a minute ago: before any round the test plans."""
    Device.objects.update(connected_at=timezone.now() - timedelta(minutes=1))


def test_a_device_that_resumes_mid_round_joins_it(mlp_project: Project) -> None:
    """Left out of the round's plan while it was paused, a device that resumes is owed work as one that
    connected since would be: without it, it waited for the next round (or computed leftovers)."""
    project = _crowd_averaging(mlp_project)
    first = _late_comer(project, "first", 100)  # its unit: the whole training split, so nothing is left
    resuming = _late_comer(project, "resuming", 10)
    _connected_long_ago()
    device = resuming.volunteer.devices.get()
    device_pause(device_id=device.pk, paused=True, connection=device.connection)
    lifecycle.work_units_feed(project_id=project.pk)
    assert lifecycle.work_unit_assign(user=first, device=first.volunteer.devices.get()) is not None
    target = project.current_version().round_target or 0
    _round_started(project, seconds_ago=10)
    assert lifecycle.work_units_feed(project_id=project.pk) == 0  # still paused
    device_pause(device_id=device.pk, paused=False, connection=device.connection)
    assert lifecycle.work_units_feed(project_id=project.pk) == 1
    fits = _fits(project, 30)
    assert (project.current_version().round_target or 0) - target == fits
    result = lifecycle.work_unit_assign(user=resuming, device=device)
    assert result is not None and fits - 11 <= result.work_unit.count <= fits


def test_a_device_that_resumed_before_the_round_was_planned_is_no_joiner(mlp_project: Project) -> None:
    """The round was planned for it: its unit, computed by another, must not be planned again."""
    project = _crowd_averaging(mlp_project)
    working, resumed = _late_comer(project, "working", 10), _late_comer(project, "resumed", 10)
    _connected_long_ago()
    device = resumed.volunteer.devices.get()
    device_pause(device_id=device.pk, paused=True, connection=device.connection)
    device_pause(device_id=device.pk, paused=False, connection=device.connection)
    ModelVersion.objects.filter(pk=project.current_version().pk).update(created_at=timezone.now())
    lifecycle.work_units_feed(project_id=project.pk)
    assert project.current_version().round_target == 2 * _fits(project, 40)
    assert lifecycle.work_unit_assign(user=working, device=working.volunteer.devices.get()) is not None
    assert lifecycle.work_unit_assign(user=User.objects.create_user("no-device")) is not None
    assert lifecycle.work_units_feed(project_id=project.pk) == 0


def test_late_comers_who_chose_another_project_do_not_grow_the_round(
    mlp_project: Project, second_project: Project
) -> None:
    project = _crowd_averaging(mlp_project)
    first = _late_comer(project, "first", 100)  # its unit: the whole training split, so nothing is left
    lifecycle.work_units_feed(project_id=project.pk)
    assert lifecycle.work_unit_assign(user=first, device=first.volunteer.devices.get()) is not None
    target = project.current_version().round_target
    _round_started(project, seconds_ago=5)
    _choosing_only(_late_comer(project, "late-elsewhere", 10), second_project.pk)
    assert lifecycle.work_units_feed(project_id=project.pk) == 0
    assert project.current_version().round_target == target
    _late_comer(project, "late-here", 10)
    assert lifecycle.work_units_feed(project_id=project.pk) == 1


def test_late_comers_to_a_round_planned_before_any_device_wait_for_the_next(mlp_project: Project) -> None:
    """Planned with no device connected, a round has units of batch_size and closes within seconds: units
    given to late-comers were cancelled with it, computed for no credit (the heterogeneous benchmark's first
    round: ~60 of them). The next round is planned for them."""
    project = _crowd_averaging(mlp_project, round_samples=20)
    lifecycle.work_units_feed(project_id=project.pk)
    _round_started(project, seconds_ago=2)
    late = [_late_comer(project, f"late-{i}", 10) for i in range(3)]
    assert lifecycle.work_units_feed(project_id=project.pk) == 0
    served = [lifecycle.work_unit_assign(user=u, device=u.volunteer.devices.get()) for u in late]
    assert [result.work_unit.count if result else None for result in served] == [10, 10, None]
    assert project.current_version().round_target == 20


@pytest.mark.parametrize(("mode", "overlap"), [("sync", False), ("averaging", True)])
def test_late_comers_wait_where_units_do_not_end_with_the_round(
    mlp_project: Project, mode: str, overlap: bool
) -> None:
    """Sync rounds keep the researcher's round_samples; overlapping rounds already have a unit ready for
    each device that ends one before the round closes."""
    project = _crowd_averaging(mlp_project, mode=mode, overlap_rounds=overlap)
    _late_comer(project, "first", 20)
    lifecycle.work_units_feed(project_id=project.pk)
    units, target = WorkUnit.objects.filter(project=project).count(), project.current_version().round_target
    _round_started(project, seconds_ago=5)
    _late_comer(project, "late", 10)
    lifecycle.work_units_feed(project_id=project.pk)
    assert WorkUnit.objects.filter(project=project).count() == units
    assert project.current_version().round_target == target


@pytest.mark.parametrize("crowd", [False, True])
def test_a_crowd_averaging_round_closes_at_nine_tenths_of_its_plan(mlp_project: Project, crowd: bool) -> None:
    """Its units end together by design; the last tenth (late starters, a leaver's unit sent again) would
    hold every device of the round idle. Other rounds wait for all their samples."""
    Project.objects.filter(pk=mlp_project.pk).update(mode="averaging", crowd_rounds=crowd, round_samples=100)
    ModelVersion.objects.filter(pk=mlp_project.current_version().pk).update(round_target=100)
    _pending_round(mlp_project, results=89)
    assert training.round_ready(project_id=mlp_project.pk) is False
    _pending_round(mlp_project, results=90)
    assert training.round_ready(project_id=mlp_project.pk) is crowd


# --- indexes without statistics --------------------------------------------------------------------------


def _history(project: Project, *, units: int) -> None:
    """`units` validated work units with one valid result each, spread over 50 versions (the last one, of
    the same weights, is now the current one)."""
    shard = DatasetShard.objects.filter(dataset=project.dataset, split="train").first()
    current = project.current_version()
    versions = ModelVersion.objects.bulk_create(
        [
            ModelVersion(project=project, number=current.number + 1 + i, weights=current.weights)
            for i in range(50)
        ]
    )
    user = User.objects.create_user(f"history-{project.pk}")
    made = WorkUnit.objects.bulk_create(
        [
            WorkUnit(
                project=project,
                version=versions[i % 50],
                shard=shard,
                offset=0,
                count=1,
                wanted=0,
                status="validated",
                total_results=1,
            )
            for i in range(units)
        ]
    )
    deadline = timezone.now()
    Result.objects.bulk_create(
        [
            Result(
                work_unit=unit,
                volunteer=user,
                deadline=deadline,
                status="received",
                validation="valid",
                samples=1,
                checked=True,
                aggregated=True,
                update_norm=1.0,
                received_at=deadline,
                digest=f"{project.pk:08x}{i:056x}",
            )
            for i, unit in enumerate(made)
        ]
    )


def _forget_statistics() -> None:
    """The rows are this test's transaction's own: autovacuum cannot analyze them; older statistics go."""
    with connection.cursor() as cursor:
        for table in ("projects_result", "projects_workunit", "projects_modelversion", "projects_project"):
            cursor.execute(f"DELETE FROM pg_statistic WHERE starelid = '{table}'::regclass")


def _plans(queries: list[dict[str, Any]]) -> list[tuple[str, str]]:
    plans = []
    with connection.cursor() as cursor:
        for query in queries:
            sql = query["sql"]
            if sql.startswith("SELECT") and ("projects_result" in sql or "projects_workunit" in sql):
                cursor.execute(f"EXPLAIN {sql}")
                plans.append((sql, "\n".join(row[0] for row in cursor.fetchall())))
    return plans


def test_hot_queries_use_indexes_on_tables_never_analyzed(
    mlp_project: Project, second_project: Project, volunteer_user: User
) -> None:
    _history(mlp_project, units=3000)
    _history(second_project, units=3000)
    _forget_statistics()
    device = device_register(user=volunteer_user, client_id="b", backend="wasm", gflops=5.0, user_agent="")
    lifecycle.work_units_feed(project_id=mlp_project.pk)
    with CaptureQueriesContext(connection) as captured:
        result = lifecycle.work_unit_assign(user=volunteer_user, device=device)
        assert result is not None
        training.round_ready(project_id=mlp_project.pk)
        validation._norm_problem(result=result, norm=1.0)
        list(lifecycle.results_awaiting_quorum(work_unit_ids=[result.work_unit_id]))
        lifecycle.results_unvalidated()
        current = mlp_project.current_version()
        training._awaiting_validation(project=mlp_project, current=current)
        list(training._pending(project=mlp_project, current=current))
        training._hold_arrivals(project=mlp_project, current=current)
    with CaptureQueriesContext(connection) as batch:
        validation._batch_mates(first=result, limit=31)
    plans = _plans(captured.captured_queries)
    assert len(plans) >= 5
    for sql, plan in plans:
        assert "Seq Scan on projects_result" not in plan, f"{sql}\n{plan}"
        assert "Seq Scan on projects_workunit" not in plan, f"{sql}\n{plan}"
    # The batch's query reads the validation queue's index, not every result ever received by key.
    [(sql, plan)] = [(sql, plan) for sql, plan in _plans(batch.captured_queries) if "projects_result" in sql]
    assert "result_awaiting_validation" in plan and "projects_result_pkey" not in plan, f"{sql}\n{plan}"


def test_the_replay_check_reads_only_the_digests_index_however_long_the_history(
    mlp_project: Project, volunteer_user: User
) -> None:
    """It walked every work unit of the project (1,016 of them, 3 ms, the database's busiest statement at 64
    volunteers in issue 15's benchmark) and probed each one's results for the digest."""
    _history(mlp_project, units=3000)
    _forget_statistics()
    device = device_register(user=volunteer_user, client_id="b", backend="wasm", gflops=5.0, user_agent="")
    lifecycle.work_units_feed(project_id=mlp_project.pk)
    result = lifecycle.work_unit_assign(user=volunteer_user, device=device)
    assert result is not None
    replayed = Result.objects.exclude(pk=result.pk).filter(work_unit__project=mlp_project).last()
    assert replayed is not None
    result.digest, result.received_at = replayed.digest, timezone.now()
    with CaptureQueriesContext(connection) as captured:
        assert validation._replayed(result)  # the same bytes as a result of another slice, earlier
    plans = _plans(captured.captured_queries)
    assert plans
    for sql, plan in plans:
        assert "projects_workunit_project_id" not in plan and "Seq Scan" not in plan, f"{sql}\n{plan}"
    assert "digest" in plans[0][1], plans[0]


# --- no deadlocks ----------------------------------------------------------------------------------------


def _deadlocks() -> int:
    """PostgreSQL's own count for this database (every deadlock it detected and broke, whoever caught it)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()")
        return int(cursor.fetchone()[0])


@pytest.mark.django_db(transaction=True)
def test_a_refusal_does_not_lock_the_project_row(mlp_project: Project, volunteer_user: User) -> None:
    """A refused upload holds its result and locks its work unit: it locked the joined project's row too,
    which project_step holds while it waits for the round's arrivals (a lock cycle)."""
    from tests.integration.volunteer import assign

    result = assign(volunteer_user)
    outcome: list[str] = []

    def lock_project() -> None:
        try:
            with transaction.atomic():
                Project.objects.select_for_update(no_key=True, nowait=True).get(pk=mlp_project.pk)
            outcome.append("locked")
        except DatabaseError as exc:
            outcome.append(type(exc).__name__)
        finally:
            connection.close()

    with transaction.atomic():
        assert lifecycle.result_refuse(user=volunteer_user, work_unit_id=result.work_unit_id, reason="bad")
        thread = threading.Thread(target=lock_project)
        thread.start()
        thread.join(30)
    assert outcome == ["locked"]


# --- assignment and feeding: per-unit costs --------------------------------------------------------------


def _all_handed_out(project: Project, user: User) -> None:
    """The current round fed and every one of its units sent: what a volunteer returning a result meets."""
    lifecycle.work_units_feed(project_id=project.pk)
    WorkUnit.objects.filter(project=project).update(wanted=0)


def test_an_idle_ready_costs_two_queries_once_the_round_is_handed_out(
    mlp_project: Project, volunteer_user: User
) -> None:
    """Every volunteer that returns a result asks for more and, once the round is all sent, is told idle:
    it chose among the open units under locks (8 queries, and 2 more inserts and locks of its device's day)
    to learn that none was left. Now it is the volunteer's row and one EXISTS."""
    device = device_register(user=volunteer_user, client_id="b", backend="wasm", gflops=5.0, user_agent="")
    _all_handed_out(mlp_project, volunteer_user)
    with CaptureQueriesContext(connection) as queries:
        offer = lifecycle.work_unit_offer(user=volunteer_user, device=device)
    assert offer.result is None and offer.why == "no_work"
    assert len(queries) == 2, [q["sql"][:80] for q in queries.captured_queries]


def _feed_queries(project: Project, *, units: int) -> int:
    Project.objects.filter(pk=project.pk).update(batch_size=1, round_samples=units, crowd_rounds=False)
    WorkUnit.objects.filter(project=project).delete()
    with CaptureQueriesContext(connection) as queries:
        assert lifecycle.work_units_feed(project_id=project.pk) == units
    return len(queries)


def test_feeding_a_round_of_256_units_costs_the_queries_of_a_round_of_4(mlp_project: Project) -> None:
    """A crowd-sized round has a unit per volunteer; each cost two queries (its shard, its INSERT)."""
    few = _feed_queries(mlp_project, units=4)
    assert _feed_queries(mlp_project, units=256) == few
    offsets = list(
        WorkUnit.objects.filter(project=mlp_project).order_by("pk").values_list("offset", flat=True)
    )
    assert offsets == list(range(4, 260))  # consecutive slices from the data cursor on, as before


def _assignment_queries(user: User) -> list[str]:
    """The statements of one assignment as the consumer makes it (it holds the device and its preferences)."""
    device = user.volunteer.devices.get()
    preferences = preferences_effective(volunteer_id=device.volunteer_id, device_id=device.pk)
    with CaptureQueriesContext(connection) as queries:
        offer = lifecycle.work_unit_offer(user=user, device=device, preferences=preferences)
        assert offer.result is not None
    return [q["sql"] for q in queries.captured_queries]


def test_an_assignment_costs_the_same_queries_with_4_or_200_units_and_volunteers(
    mlp_project: Project,
) -> None:
    Project.objects.filter(pk=mlp_project.pk).update(batch_size=1, round_samples=4, crowd_rounds=False)
    WorkUnit.objects.filter(project=mlp_project).delete()
    lifecycle.work_units_feed(project_id=mlp_project.pk)
    users = _crowd(3)
    few = _assignment_queries(users[0])
    _crowd_more(200)
    Project.objects.filter(pk=mlp_project.pk).update(round_samples=204)
    lifecycle.work_units_feed(project_id=mlp_project.pk)
    many = _assignment_queries(users[1])
    assert len(many) == len(few)
    # The device's row of today is read (and locked) by one upsert, where it took an insert and a select.
    assert sum('"workers_devicedownload"' in sql for sql in many) == 2
    # Why this project: with one running, no other could have had work, so no EXISTS asks (the one left is
    # whether anything is sendable at all). 9 statements; 11 before (issue 15).
    assert sum(sql.startswith('SELECT 1 AS "a"') for sql in many) == 1
    assert len([sql for sql in many if not sql.startswith(("SAVEPOINT", "RELEASE"))]) == 9


def _crowd_more(count: int) -> None:
    users = User.objects.bulk_create([User(username=f"more-{i:03d}") for i in range(count)])
    for user in users:
        device_register(user=user, client_id=f"more-{user.pk}", backend="wasm", gflops=5.0, user_agent="")


@pytest.mark.django_db(transaction=True)
def test_an_assignment_leaves_the_project_usage_row_unlocked_until_its_last_statement(
    mlp_project: Project, volunteer_user: User, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every assignment charges its project's usage row (fair share). It read the row FOR UPDATE in the middle
    of the sending transaction, so each volunteer's assignment waited for the one before to commit. Now the
    charge is one statement, the last: while the unit is chosen, fitted and recorded, the row is free."""
    from projects.models import ProjectUsage

    ProjectUsage.objects.create(project=mlp_project)
    lifecycle.work_units_feed(project_id=mlp_project.pk)
    outcome: list[str] = []
    choose = lifecycle._why_chosen

    def lock_usage() -> None:
        try:
            with transaction.atomic():
                ProjectUsage.objects.select_for_update(nowait=True).get(project=mlp_project)
            outcome.append("free")
        except DatabaseError as exc:
            outcome.append(type(exc).__name__)
        finally:
            connection.close()

    def chosen_while_probing(**kwargs: Any) -> str:
        thread = threading.Thread(target=lock_usage)
        thread.start()
        thread.join(30)
        return choose(**kwargs)

    monkeypatch.setattr(lifecycle, "_why_chosen", chosen_while_probing)
    result = lifecycle.work_unit_assign(user=volunteer_user)
    assert result is not None and outcome == ["free"]
    assert ProjectUsage.objects.get(project=mlp_project).recent_flops > 0  # charged all the same


@pytest.mark.django_db(transaction=True)
def test_concurrent_assignments_never_send_a_unit_twice(mlp_project: Project) -> None:
    Project.objects.filter(pk=mlp_project.pk).update(batch_size=1, round_samples=40, crowd_rounds=False)
    WorkUnit.objects.filter(project=mlp_project).delete()
    lifecycle.work_units_feed(project_id=mlp_project.pk)
    users = _crowd(12)
    Volunteer.objects.update(consecutive_valid=1000)  # trusted: no replicas asked for
    Project.objects.filter(pk=mlp_project.pk).update(spot_check_rate=0.0)
    sent: list[int] = []

    def volunteer(user: User) -> None:
        try:
            device = user.volunteer.devices.get()
            while (result := lifecycle.work_unit_assign(user=user, device=device)) is not None:
                sent.append(result.work_unit_id)
        finally:
            connection.close()

    threads = [threading.Thread(target=volunteer, args=(user,)) for user in users]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert len(sent) == len(set(sent)) == 40
    assert Result.objects.filter(status="in_progress").count() == 40


def _rows_read(table: str) -> int:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT coalesce(seq_tup_read, 0) + coalesce(idx_tup_fetch, 0) FROM pg_stat_xact_user_tables "
            "WHERE relname = %s",
            [table],
        )
        return int(cursor.fetchone()[0])


def _norm_check_reads(project: Project) -> int:
    before = _rows_read("projects_workunit") + _rows_read("projects_result")
    assert len(validation._recent_norms(project=project)) == validation.NORM_HISTORY
    return _rows_read("projects_workunit") + _rows_read("projects_result") - before


def test_the_norm_history_reads_the_same_rows_after_2000_or_20000_results(
    mlp_project: Project, second_project: Project
) -> None:
    """Every validation reads the project's last 20 valid norms. Joined to the work units in SQL, PostgreSQL
    without fresh statistics walked all the project's work units for each of the 20: 85% of the database's
    time at 32 volunteers after ten minutes of the throughput benchmark."""
    _history(mlp_project, units=2000)
    _forget_statistics()
    small = _norm_check_reads(mlp_project)
    _history(second_project, units=20000)
    _forget_statistics()
    large = _norm_check_reads(second_project)
    assert large <= small <= 3 * validation.NORM_SCAN, (small, large)
