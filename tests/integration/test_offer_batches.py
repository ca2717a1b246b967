"""Ready volunteers served in batches (lifecycle.work_units_offer) on PostgreSQL: the same work as one at a
time, one search for the batch, and over the socket a round's waiting volunteers served together."""

from __future__ import annotations

import dataclasses
import threading
from datetime import timedelta
from typing import Any

import pytest
from asgiref.sync import async_to_sync
from django.contrib.auth.models import User
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from projects import lifecycle
from projects.lifecycle import OfferRequest, work_units_offer
from projects.models import Project, Result, WorkUnit
from tests.integration.test_consumers import greet, send
from workers import offers
from workers.models import ComputingPreferences, DeviceDownload, Volunteer
from workers.preferences import DEFAULTS, preferences_effective
from workers.services import device_register

pytestmark = pytest.mark.django_db


def _crowd(count: int, prefix: str = "ready") -> list[User]:
    users = [User.objects.create_user(f"{prefix}-{i:03d}") for i in range(count)]
    for user in users:
        device_register(user=user, client_id=f"b-{user.pk}", backend="wasm", gflops=5.0, user_agent="")
    Volunteer.objects.update(consecutive_valid=1000)  # trusted: no replicas unless a test asks
    return users


def _requests(users: list[User], **changes: Any) -> list[OfferRequest]:
    requests = []
    for user in users:
        device = user.volunteer.devices.get()
        preferences = preferences_effective(volunteer_id=device.volunteer_id, device_id=device.pk)
        requests.append(OfferRequest(user=user, preferences=preferences, device=device, **changes))
    return requests


def _round_of(project: Project, units: int) -> list[int]:
    Project.objects.filter(pk=project.pk).update(
        batch_size=1, round_samples=units, crowd_rounds=False, spot_check_rate=0.0
    )
    WorkUnit.objects.filter(project=project).delete()
    lifecycle.work_units_feed(project_id=project.pk)
    return list(WorkUnit.objects.filter(project=project).order_by("id").values_list("pk", flat=True))


def test_a_batch_sends_each_volunteer_the_unit_one_at_a_time_would(mlp_project: Project) -> None:
    units = _round_of(mlp_project, 40)
    users = _crowd(12)
    offered = work_units_offer(requests=_requests(users))
    assert [o.result.work_unit_id for o in offered if o.result] == units[:12]  # oldest first, in their order
    assert all(o.why == "only" for o in offered)
    sent = Result.objects.filter(status="in_progress")
    assert sorted(sent.values_list("volunteer_id", flat=True)) == sorted(u.pk for u in users)
    assert WorkUnit.objects.filter(pk__in=units[:12], wanted=0, total_results=1).count() == 12
    # The devices' downloads are counted as one at a time counts them.
    assert all(u.volunteer.devices.get().downloads.get().work_units == 1 for u in users)
    # ... and the next volunteer, alone, gets the thirteenth.
    alone = lifecycle.work_unit_assign(user=_crowd(1, "late")[0])
    assert alone is not None and alone.work_unit_id == units[12]


@pytest.mark.parametrize("size", [4, 16])
def test_a_batch_costs_the_same_statements_whatever_its_size(mlp_project: Project, size: int) -> None:
    """Each `ready` compiled and ran the search for its unit, under locks: a third of daphne's CPU at 64
    volunteers (issue 15). A batch runs it once and charges its project's usage once; and it locks its
    devices' days, updates its units and their days and creates its instances in one statement each, where
    each send took four."""
    _round_of(mlp_project, 40)
    requests = _requests(_crowd(size))
    with CaptureQueriesContext(connection) as queries:
        offered = work_units_offer(requests=requests)
    assert sum(o.result is not None for o in offered) == size
    sql = [q["sql"].lstrip() for q in queries.captured_queries]
    assert sum("SKIP LOCKED" in s for s in sql) == 1
    for table in ("projects_projectusage", "workers_devicedownload", "projects_result"):
        assert sum(s.startswith(f'INSERT INTO "{table}"') for s in sql) == 1, table
    for table in ("projects_workunit", "workers_devicedownload"):
        assert sum(s.startswith(f'UPDATE "{table}"') for s in sql) == 1, table
    assert len(sql) <= 12, sql


def test_the_rest_of_a_batch_once_the_round_is_handed_out_costs_no_search(mlp_project: Project) -> None:
    """Readies outnumber the units left: those that find none left in the batch's complete list are told
    so, without searching the open units again or locking their devices' day (the batch locks as many
    devices' days as its list has instances)."""
    units = _round_of(mlp_project, 4)
    requests = _requests(_crowd(12))
    with CaptureQueriesContext(connection) as queries:
        offered = work_units_offer(requests=requests)
    assert [o.result.work_unit_id for o in offered if o.result] == units
    assert [o.why for o in offered[4:]] == ["no_work"] * 8
    sql = [q["sql"] for q in queries.captured_queries]
    assert sum("SKIP LOCKED" in s for s in sql) == 1
    assert sum(s.lstrip().startswith('INSERT INTO "workers_devicedownload"') for s in sql) == 1
    assert DeviceDownload.objects.count() == 4


def test_a_batch_follows_each_volunteers_choice_of_projects(
    mlp_project: Project, second_project: Project
) -> None:
    _round_of(mlp_project, 4)
    second = _round_of(second_project, 4)
    anyone, choosy = _requests(_crowd(2))
    only_second = dataclasses.replace(
        choosy.preferences,
        projects=ComputingPreferences.Projects.ONLY,
        chosen_projects=frozenset({second_project.pk}),
    )
    offered = work_units_offer(requests=[dataclasses.replace(choosy, preferences=only_second), anyone])
    assert offered[0].result is not None and offered[0].result.work_unit_id == second[0]
    assert offered[0].why == "choice"
    assert offered[1].result is not None


def test_a_batch_tells_who_is_held_back_and_who_finds_nothing(mlp_project: Project) -> None:
    _round_of(mlp_project, 1)
    held_back, first, second = _requests(_crowd(3))
    Volunteer.objects.filter(user=held_back.user).update(no_work_until=timezone.now() + timedelta(days=1))
    offered = work_units_offer(requests=[held_back, first, second])
    assert [o.result is not None for o in offered] == [False, True, False]
    assert [offered[0].why, offered[2].why] == ["backoff", "no_work"]
    # Nothing sendable at all: one EXISTS for the whole batch, and the volunteers' rows.
    with CaptureQueriesContext(connection) as queries:
        again = work_units_offer(requests=[held_back, second])
    assert [o.why for o in again] == ["backoff", "no_work"] and len(queries) == 2


def test_a_unit_wanted_twice_goes_to_two_volunteers_never_twice_to_one(mlp_project: Project) -> None:
    """Two devices of one volunteer in one batch: a replica compared by a quorum comes from someone else."""
    (unit,) = _round_of(mlp_project, 1)
    WorkUnit.objects.filter(pk=unit).update(wanted=2, target_results=2, min_quorum=2)
    user = _crowd(1)[0]
    device_register(user=user, client_id="second-browser", backend="wasm", gflops=5.0, user_agent="")
    other = _crowd(1, "other")[0]
    devices = list(user.volunteer.devices.order_by("pk"))
    twice = [OfferRequest(user=user, preferences=DEFAULTS, device=d) for d in devices]
    offered = work_units_offer(requests=[*twice, *_requests([other])])
    assert [o.result.volunteer_id if o.result else None for o in offered] == [user.pk, None, other.pk]
    assert WorkUnit.objects.get(pk=unit).wanted == 0


def test_a_device_the_first_unit_does_not_fit_gets_what_the_search_says(mlp_project: Project) -> None:
    _round_of(mlp_project, 4)
    (tiny,) = _requests(_crowd(1))
    offered = work_units_offer(requests=[dataclasses.replace(tiny, memory_mb=0.001)])
    alone = lifecycle.work_unit_offer(user=tiny.user, device=tiny.device, memory_mb=0.001)
    assert offered[0].result is None and offered[0].why == alone.why == "too_large"


def test_a_search_in_a_batch_reads_the_sends_before_it(
    mlp_project: Project, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batch writes its sends once, at its end: a volunteer for whom the first unit in line does not do
    searches the database, which must already show the units and instances sent before it."""
    units = _round_of(mlp_project, 4)
    first, tiny = _requests(_crowd(2))
    seen: list[tuple[int, int]] = []
    search = lifecycle._fitting_work_unit

    def watched(**kwargs: Any) -> tuple[WorkUnit | None, int, str]:
        seen.append((WorkUnit.objects.get(pk=units[0]).wanted, Result.objects.count()))
        return search(**kwargs)

    monkeypatch.setattr(lifecycle, "_fitting_work_unit", watched)
    offered = work_units_offer(requests=[first, dataclasses.replace(tiny, memory_mb=0.001)])
    assert offered[0].result is not None and offered[0].result.work_unit_id == units[0]
    assert offered[1].why == "too_large" and seen == [(0, 1)]


@pytest.mark.django_db(transaction=True)
def test_concurrent_batches_never_send_a_unit_twice(mlp_project: Project) -> None:
    _round_of(mlp_project, 40)
    users = _crowd(12)
    sent: list[int] = []

    def process(group: list[User]) -> None:
        try:
            requests = _requests(group)
            while offered := [o for o in work_units_offer(requests=requests) if o.result is not None]:
                sent.extend(o.result.work_unit_id for o in offered if o.result)
        finally:
            connection.close()

    threads = [threading.Thread(target=process, args=(users[i::3],)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert len(sent) == len(set(sent)) == 40
    assert Result.objects.filter(status="in_progress").count() == 40


@pytest.mark.django_db(transaction=True)
def test_a_ready_over_the_socket_is_served_by_the_web_processs_batches(
    mlp_project: Project, volunteer_user: User, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The consumer asks the batcher (workers/offers.py), which serves batches with work_units_offer; how
    readies share batches is tested there with stand-ins, and what a batch sends above."""
    sizes: list[int] = []
    serve = offers.work_units_offer

    def counted(*, requests: list[OfferRequest]) -> list[lifecycle.Offer]:
        sizes.append(len(requests))
        return serve(requests=requests)

    monkeypatch.setattr(offers, "work_units_offer", counted)

    async def scenario() -> dict[str, Any]:
        communicator = await greet(volunteer_user)
        assign = await send(communicator, {"type": "ready"})
        await communicator.disconnect()
        return assign

    assign = async_to_sync(scenario)()
    assert assign["type"] == "assign" and sizes == [1]
    sent = Result.objects.get(volunteer=volunteer_user)
    assert sent.work_unit_id == assign["work_unit"]["id"] and sent.status == "released"


@pytest.mark.parametrize(
    ("changes", "second"),
    [
        ({}, False),
        ({"overlap_rounds": True}, True),
        ({"mode": "sync_sgd"}, True),
    ],
)
@pytest.mark.parametrize("batched", [False, True])
def test_a_device_computing_a_unit_of_a_crowd_averaging_round_gets_no_second_one_of_it(
    mlp_project: Project, changes: dict[str, Any], second: bool, batched: bool
) -> None:
    """Its unit ends with the round, so a second (a browser's prefetch) would end after it and the round
    would wait for it: the heterogeneous benchmark's rounds at 64 took 55 s for units of 40 s. Where units do
    not end with their round (sync, overlapping rounds), the prefetch gets its unit."""
    Project.objects.filter(pk=mlp_project.pk).update(
        **{"mode": "averaging", "batch_size": 10, "round_samples": 40, "crowd_rounds": True, **changes}
    )
    WorkUnit.objects.filter(project=mlp_project).delete()
    users = _crowd(3)
    lifecycle.work_units_feed(project_id=mlp_project.pk)
    first = lifecycle.work_unit_assign(user=users[0], device=users[0].volunteer.devices.get())
    assert first is not None and first.status == Result.Status.IN_PROGRESS
    if batched:
        again = work_units_offer(requests=_requests(users[:2]))
        assert again[1].result is not None  # another device of the batch gets its unit of the round
        prefetched = again[0].result
    else:
        prefetched = lifecycle.work_unit_assign(user=users[0], device=users[0].volunteer.devices.get())
    assert (prefetched is not None) == second
    first.status = Result.Status.RECEIVED  # done computing: the device asks again and gets more of the round
    first.save(update_fields=["status"])
    assert lifecycle.work_unit_assign(user=users[0], device=users[0].volunteer.devices.get()) is not None
