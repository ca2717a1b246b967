"""Results received in batches (lifecycle.results_receive) on PostgreSQL: what one at a time would store, at
a cost that does not grow with the batch, what it cannot handle left to result_receive, and over the socket
a connection's result served through its web process's batches (workers/arrivals.py)."""

from __future__ import annotations

import hashlib
import json
import threading
from typing import Any

import pytest
from asgiref.sync import async_to_sync
from channels.db import database_sync_to_async
from django.contrib.auth.models import User
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext
from pytest_django.fixtures import Settings

from projects import lifecycle, notify
from projects.lifecycle import Arrival, ResultError, results_receive
from projects.models import Project, Result, WorkUnit
from tests.integration.test_consumers import greet, send
from tests.integration.test_offer_batches import _crowd, _round_of
from tests.integration.volunteer import assign, honest_update
from workers import arrivals
from workers.models import CreditEntry

pytestmark = pytest.mark.django_db(transaction=True)


def _assigned(project: Project, count: int, prefix: str = "arrive") -> list[Result]:
    _round_of(project, count)
    return [assign(user) for user in _crowd(count, prefix)]


def _arrival(result: Result, payload: bytes | None = None, **changes: Any) -> Arrival:
    work_unit = result.work_unit
    fields: dict[str, Any] = {
        "user": result.volunteer,
        "work_unit_id": work_unit.pk,
        "samples": work_unit.count,
        "loss": 1.0,
        "compute_ms": 5,
        "download_ms": 1,
        "payload": honest_update(work_unit) if payload is None else payload,
    }
    return Arrival(**{**fields, **changes})


def test_a_batch_stores_and_validates_each_result_as_one_at_a_time_would(mlp_project: Project) -> None:
    arrived = [_arrival(result) for result in _assigned(mlp_project, 6)]
    outcomes = results_receive(arrivals=arrived)
    assert [o.status if o else None for o in outcomes] == ["valid"] * 6  # Celery runs eagerly here
    assert [o.work_unit_id for o in outcomes if o] == [a.work_unit_id for a in arrived]
    assert all(o.credit_flops > 0 and o.total_credit_flops == o.credit_flops for o in outcomes if o)
    for arrival in arrived:
        result = Result.objects.get(work_unit_id=arrival.work_unit_id, volunteer=arrival.user)
        assert result.status == "received" and result.samples == arrival.samples and result.compute_ms == 5
        assert result.digest == hashlib.sha256(arrival.payload).hexdigest() == result.blob_id
    assert CreditEntry.objects.count() == 6


def _receive_counted(arrived: list[Arrival], monkeypatch: pytest.MonkeyPatch) -> tuple[int, list[list[int]]]:
    told: list[list[int]] = []
    monkeypatch.setattr(notify, "results_received", lambda *, result_ids: told.append(result_ids))
    with CaptureQueriesContext(connection) as queries:
        outcomes = results_receive(arrivals=arrived)
    assert all(o is not None and o.status == "pending" for o in outcomes)
    return len(queries), told


def test_a_batch_costs_the_same_queries_and_one_task_with_3_or_12_results(
    mlp_project: Project, monkeypatch: pytest.MonkeyPatch
) -> None:
    results = _assigned(mlp_project, 15)
    few, told_few = _receive_counted([_arrival(r) for r in results[:3]], monkeypatch)
    many, told_many = _receive_counted([_arrival(r) for r in results[3:]], monkeypatch)
    assert few == many
    assert told_few == [[r.pk for r in results[:3]]] and told_many == [[r.pk for r in results[3:]]]


def test_what_a_batch_cannot_handle_is_left_to_result_receive(
    mlp_project: Project, other_volunteer: User, settings: Settings
) -> None:
    first, second, third, fourth = _assigned(mlp_project, 4)
    lifecycle.result_receive(**vars(_arrival(fourth)))  # already received: a duplicate now
    settings.CROWDTRAIN = {**settings.CROWDTRAIN, "MAX_RESULT_BYTES": 10**6}
    arrived = [
        _arrival(first),
        _arrival(first),  # the same result twice in one batch
        _arrival(second, model_version=99),
        _arrival(third, payload=b"x" * (10**6 + 1)),
        _arrival(fourth),
        _arrival(first, user=other_volunteer),
        _arrival(first, work_unit_id=10**9),
    ]
    outcomes = results_receive(arrivals=arrived)
    assert outcomes[0] is not None and outcomes[0].status == "valid"
    assert outcomes[1:] == [None] * 6
    # result_receive's own answers for them: a duplicate's outcome, the version refused, errors.
    assert lifecycle.result_receive(**vars(arrived[1])).status == "valid"
    assert lifecycle.result_receive(**vars(arrived[2])).status == "invalid"
    assert lifecycle.result_receive(**vars(arrived[4])).status == "valid"
    for arrival, code in [(arrived[3], "too_large"), (arrived[5], "not_assigned"), (arrived[6], "unknown")]:
        with pytest.raises(ResultError) as refused:
            lifecycle.result_receive(**vars(arrival))
        assert refused.value.code.startswith(code)
    assert Result.objects.get(pk=third.pk).status == "in_progress"


def test_a_result_another_transaction_holds_is_left_without_waiting(mlp_project: Project) -> None:
    held, free = _assigned(mlp_project, 2)
    locked, release = threading.Event(), threading.Event()

    def hold() -> None:
        with transaction.atomic():
            Result.objects.select_for_update().get(pk=held.pk)
            locked.set()
            release.wait(30)
        connection.close()

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert locked.wait(30)
        outcomes = results_receive(arrivals=[_arrival(held), _arrival(free)])
    finally:
        release.set()
        holder.join(30)
    assert outcomes[0] is None and outcomes[1] is not None and outcomes[1].status == "valid"
    assert Result.objects.get(pk=held.pk).status == "in_progress"


def test_a_result_over_the_socket_is_served_by_the_web_processs_batches(
    mlp_project: Project, volunteer_user: User, monkeypatch: pytest.MonkeyPatch
) -> None:
    sizes: list[int] = []
    serve = arrivals.results_receive

    def counted(*, arrivals: list[Arrival]) -> list[lifecycle.ResultOutcome | None]:
        sizes.append(len(arrivals))
        return serve(arrivals=arrivals)

    monkeypatch.setattr(arrivals, "results_receive", counted)

    async def scenario() -> dict[str, Any]:
        communicator = await greet(volunteer_user)
        assign = await send(communicator, {"type": "ready"})
        unit = assign["work_unit"]
        work_unit = await database_sync_to_async(
            WorkUnit.objects.select_related("project", "version", "shard__blob").get
        )(pk=unit["id"])
        meta = {"type": "result", "work_unit": unit["id"], "model_version": unit["model_version"]}
        meta |= {"samples": work_unit.count, "loss": 1.0, "timings": {"download_ms": 1, "compute_ms": 2}}
        await communicator.send_to(text_data=json.dumps(meta))
        await communicator.send_to(bytes_data=await database_sync_to_async(honest_update)(work_unit))
        ack = json.loads(await communicator.receive_from(timeout=30))
        await communicator.disconnect()
        return {"assign": assign, "ack": ack}

    answers = async_to_sync(scenario)()
    assert answers["assign"]["type"] == "assign" and sizes == [1]
    assert answers["ack"]["type"] == "ack" and answers["ack"]["status"] == "valid"
    assert Result.objects.get(volunteer=volunteer_user).validation == "valid"
