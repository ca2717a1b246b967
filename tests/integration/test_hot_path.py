"""Issue 15's hot path on PostgreSQL: deciding a round costs the same whatever its size, crowd-sized rounds
give every connected volunteer work, and the hot queries use indexes on tables never analyzed."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.db import DatabaseError, connection, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from projects import lifecycle, training, validation
from projects.models import DatasetShard, ModelVersion, Project, Result, WorkUnit
from workers.services import device_register

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


@pytest.mark.parametrize(("age", "seconds"), [(0, 40), (10, 30), (35, 10), (50, 40)])
def test_a_crowd_averaging_unit_ends_with_the_rounds_target_seconds(
    mlp_project: Project, age: int, seconds: int
) -> None:
    """A device asking `age` seconds into a round gets what is left of its 40 s (at least 10 s), so that one
    that started late or came back for more finishes with the others; past them, a full unit."""
    Project.objects.filter(pk=mlp_project.pk).update(
        mode="averaging", batch_size=10, round_samples=10, crowd_rounds=True, target_seconds=40
    )
    WorkUnit.objects.filter(project=mlp_project).delete()
    project = Project.objects.get(pk=mlp_project.pk)
    fps = project.flops_per_sample
    user = User.objects.create_user("late")
    gflops = 20.5 * fps / 1e9  # 20 samples a second: 800 in 40 s (the digits' shard has 1,000)
    device_register(user=user, client_id="browser-late", backend="wasm", gflops=gflops, user_agent="")
    lifecycle.work_units_feed(project_id=project.pk)
    ModelVersion.objects.filter(pk=project.current_version().pk).update(
        created_at=timezone.now() - timedelta(seconds=age)
    )
    result = lifecycle.work_unit_assign(user=user, device=user.volunteer.devices.get())
    assert result is not None
    # (the second the test itself takes)
    fits = [project.work_unit_samples(gflops=gflops, seconds=s) for s in (seconds - 1, seconds)]
    assert fits[0] <= result.work_unit.count <= fits[1]


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
            )
            for unit in made
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
        training._awaiting_validation(current)
        list(training._pending(project=mlp_project, current=current))
        training._hold_arrivals(project=mlp_project, current=current)
    plans = _plans(captured.captured_queries)
    assert len(plans) >= 5
    for sql, plan in plans:
        assert "Seq Scan on projects_result" not in plan, f"{sql}\n{plan}"
        assert "Seq Scan on projects_workunit" not in plan, f"{sql}\n{plan}"


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
