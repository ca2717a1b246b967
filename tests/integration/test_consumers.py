"""The volunteer WebSocket through the real ASGI stack: session auth, Redis channel layer, PostgreSQL."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import channels.consumer
import pytest
import redis
from asgiref.sync import async_to_sync
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.conf import settings
from django.contrib.auth.models import User
from django.test import Client
from django.utils import timezone

from config.asgi import application
from projects import notify
from projects.lifecycle import results_release
from projects.models import Project, WorkUnit
from projects.tasks import feed_work_units
from tests.integration.volunteer import honest_update
from workers import consumers, services
from workers.models import Device, Volunteer
from workers.preferences import preferences_save
from workers.services import device_register, volunteer_ensure

pytestmark = pytest.mark.django_db(transaction=True)
HELLO: dict[str, Any] = {"type": "hello", "protocol": 1, "device": {"backend": "webgl", "gflops": 12.5}}


def session_headers(user: User) -> list[tuple[bytes, bytes]]:
    client = Client()
    client.force_login(user)
    cookie = f"{settings.SESSION_COOKIE_NAME}={client.cookies[settings.SESSION_COOKIE_NAME].value}"
    return [(b"cookie", cookie.encode()), (b"origin", b"http://localhost"), (b"host", b"localhost")]


async def connect(user: User | None) -> WebsocketCommunicator:
    anonymous = [(b"origin", b"http://localhost")]
    headers = await database_sync_to_async(session_headers)(user) if user else anonymous
    communicator = WebsocketCommunicator(application, "/ws/volunteer/", headers=headers)
    return communicator


async def send(communicator: WebsocketCommunicator, message: dict[str, Any]) -> dict[str, Any]:
    await communicator.send_to(text_data=json.dumps(message))
    return json.loads(await communicator.receive_from(timeout=10))


async def greet(user: User) -> WebsocketCommunicator:
    communicator = await connect(user)
    connected, _ = await communicator.connect()
    assert connected
    welcome = await send(communicator, HELLO)
    assert welcome["type"] == "welcome" and welcome["volunteer"]["username"] == user.username
    return communicator


def test_anonymous_connections_are_refused(db: None) -> None:
    async def scenario() -> None:
        communicator = await connect(None)
        connected, code = await communicator.connect()
        assert not connected and code == 4401

    async_to_sync(scenario)()


def test_frames_and_events_do_not_queue_through_the_one_thread_for_synchronous_code(
    mlp_project: Project, volunteer_user: User, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Channels closed stale database connections before every frame and event in daphne's single thread
    for synchronous code: a broadcast to 3,000 volunteers queued 3,000 hops there, and pages waited behind."""
    hops: list[int] = []

    async def counted() -> None:
        hops.append(1)

    monkeypatch.setattr(channels.consumer, "aclose_old_connections", counted)

    async def scenario() -> None:
        communicator = await greet(volunteer_user)
        assert (await send(communicator, {"type": "ready"}))["type"] == "assign"
        await database_sync_to_async(_announce_work)()
        await communicator.disconnect()

    async_to_sync(scenario)()
    assert hops == []


def test_a_hello_is_one_trip_to_the_database_threads(
    mlp_project: Project, volunteer_user: User, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a reconnect storm 32 hellos are in flight, each holding an admission slot until its welcome: the
    device, the blobs its browser had and its preferences are one call (three before, each a pool thread
    and a pooled connection of its own)."""
    calls: list[str] = []
    wrap = consumers.database_sync_to_async

    def counted(func: Any) -> Any:
        calls.append(func.__name__)
        return wrap(func)

    monkeypatch.setattr(consumers, "database_sync_to_async", counted)
    volunteer = volunteer_ensure(user=volunteer_user)
    preferences_save(volunteer=volunteer, device=None, values={"duty_cycle": 50}, chosen_projects=[])

    async def scenario() -> None:
        communicator = await connect(volunteer_user)
        await communicator.connect()
        welcome = await send(communicator, HELLO)
        assert welcome["type"] == "welcome"
        assert welcome["preferences"]["duty_cycle"] == 50 and welcome["preferences"]["source"] == "volunteer"
        await communicator.disconnect()

    async_to_sync(scenario)()
    assert calls == ["device_hello"]


def _announce_work() -> None:
    from projects import notify

    notify.work_available()


def test_assign_result_ack_over_the_socket(mlp_project: Project, volunteer_user: User) -> None:
    async def scenario() -> None:
        communicator = await greet(volunteer_user)
        assign = await send(communicator, {"type": "ready"})
        assert assign["type"] == "assign"
        unit = assign["work_unit"]
        assert unit["weights_url"].startswith("/blobs/") and unit["shards"][0]["count"] == 50
        assert (unit["task"], unit["codec"]) == ("gradient", "int8")
        work_unit = await database_sync_to_async(
            WorkUnit.objects.select_related("project", "version", "shard__blob").get
        )(pk=unit["id"])
        payload, loss = await database_sync_to_async(honest_update)(work_unit), 2.3
        await communicator.send_to(
            text_data=json.dumps(
                {
                    "type": "result",
                    "work_unit": unit["id"],
                    "model_version": unit["model_version"],
                    "samples": 50,
                    "loss": loss,
                    "timings": {"download_ms": 1, "compute_ms": 2},
                }
            )
        )
        await communicator.send_to(bytes_data=payload)
        ack = json.loads(await communicator.receive_from(timeout=10))
        assert ack["type"] == "ack" and ack["accepted"] is True
        # Validation runs in Celery (eagerly here) and its verdict is pushed through the channel layer.
        credit = json.loads(await communicator.receive_from(timeout=10))
        assert credit["type"] == "credit" and credit["status"] == "valid", credit
        assert credit["credit_flops"] == 50 * mlp_project.flops_per_sample == credit["total_credit_flops"]
        # The recent average as the server keeps it (the Contribute page shows it live), decayed to now.
        volunteer = await database_sync_to_async(Volunteer.objects.get)(user=volunteer_user)
        recent = volunteer.recent_credit(now=timezone.now())
        assert credit["recent_credit"] == pytest.approx(recent, rel=1e-4) and recent > 0
        await communicator.disconnect()

    async_to_sync(scenario)()


def test_a_unit_running_across_shards_is_assigned_over_the_socket(
    wide_units: Project, volunteer_user: User
) -> None:
    """Its following shards are read from the database, which the event loop may not do itself."""

    async def scenario() -> None:
        communicator = await greet(volunteer_user)
        assign = await send(communicator, {"type": "ready"})
        assert assign["type"] == "assign", assign
        parts = [(part["offset"], part["count"]) for part in assign["work_unit"]["shards"]]
        assert parts == [(0, 300), (0, 100)]  # the first unit: shard 0, then shard 1
        await communicator.disconnect()

    async_to_sync(scenario)()


def test_malformed_frames_get_errors_and_the_socket_survives(
    mlp_project: Project, volunteer_user: User
) -> None:
    async def scenario() -> None:
        communicator = await connect(volunteer_user)
        await communicator.connect()
        assert (await send(communicator, {"type": "ready"}))["code"] == "protocol"  # no hello yet
        await communicator.send_to(text_data="{not json")
        assert json.loads(await communicator.receive_from(timeout=10))["code"] == "bad_message"
        assert (await send(communicator, {"type": "launch_missiles"}))["code"] == "bad_message"
        assert (await send(communicator, {**HELLO, "protocol": 99}))["code"] == "protocol"
        await send(communicator, HELLO)
        await communicator.send_to(bytes_data=b"\x00" * 10)
        assert json.loads(await communicator.receive_from(timeout=10))["code"] == "bad_message"
        bad = {"type": "result", "work_unit": "x", "model_version": 0, "samples": 1, "loss": 1.0}
        assert (await send(communicator, bad))["code"] == "bad_message"
        unknown = {**bad, "work_unit": 999999}
        await communicator.send_to(text_data=json.dumps(unknown))
        await communicator.send_to(bytes_data=b"x")
        assert json.loads(await communicator.receive_from(timeout=10))["code"] == "unknown_work_unit"
        assert (await send(communicator, {"type": "ready"}))["type"] == "assign"  # still alive
        await communicator.disconnect()

    async_to_sync(scenario)()


def test_disconnect_releases_work_and_waiting_volunteers_get_work_pushed(
    mlp_project: Project, volunteer_user: User, other_volunteer: User
) -> None:
    async def scenario() -> None:
        first = await greet(volunteer_user)
        assert (await send(first, {"type": "ready"}))["type"] == "assign"
        assert (await send(first, {"type": "ready"}))["type"] == "assign"
        second = await greet(other_volunteer)
        assert (await send(second, {"type": "ready"}))["type"] == "idle"  # the round is all handed out
        await first.disconnect()
        pushed = json.loads(await second.receive_from(timeout=10))
        assert pushed["type"] == "assign"
        await second.disconnect()

    async_to_sync(scenario)()


def test_a_departure_noticed_after_the_same_devices_next_hello_leaves_it_connected(
    mlp_project: Project, volunteer_user: User, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reconnect storms (issue 15): connection A's departure was noticed after connection B of the same
    browser had said hello (B's row written, B not yet known to the process), and it marked the live device
    disconnected. Here A's disconnect runs exactly then: between B's device_register and B's welcome."""
    hello = {**HELLO, "device": {**HELLO["device"], "id": "browser-storm-1"}}
    registered, proceed, calls = threading.Event(), threading.Event(), []

    def register_then_wait(**kwargs: Any) -> Device:
        device = device_register(**kwargs)
        calls.append(kwargs["connection"])
        if len(calls) == 2:  # B's hello: its row is written; hold B there until A's disconnect is done
            registered.set()
            proceed.wait(10)
        return device

    monkeypatch.setattr(services, "device_register", register_then_wait)  # as device_hello calls it

    async def scenario() -> None:
        first = await connect(volunteer_user)
        await first.connect()
        assert (await send(first, hello))["type"] == "welcome"
        second = await connect(volunteer_user)
        await second.connect()
        await second.send_to(text_data=json.dumps(hello))
        assert await asyncio.to_thread(registered.wait, 10)
        await first.disconnect(timeout=10)  # A's departure, flushed while B's hello is half done
        proceed.set()
        assert json.loads(await second.receive_from(timeout=10))["type"] == "welcome"
        device = await database_sync_to_async(Device.objects.get)(client_id="browser-storm-1")
        assert device.disconnected_at is None and device.connection == calls[1] != calls[0]
        await second.disconnect(timeout=10)
        device = await database_sync_to_async(Device.objects.get)(pk=device.pk)
        assert device.disconnected_at is not None  # B was the current one: its departure counts

    async_to_sync(scenario)()


def test_a_waiting_volunteer_that_missed_the_news_gets_work_at_the_next_feeder_beat(
    mlp_project: Project, volunteer_user: User, other_volunteer: User
) -> None:
    """`idle` promises an assign. When the one `work.available` for it is lost (it expired in the channel
    layer behind a busy connection), the feeder's beat announces the unsent work again."""

    async def scenario() -> None:
        first = await greet(volunteer_user)
        held = [(await send(first, {"type": "ready"}))["work_unit"]["id"] for _ in range(2)]
        second = await greet(other_volunteer)
        assert (await send(second, {"type": "ready"}))["type"] == "idle"
        # Reopened with no announcement: as if the consumer's broadcast never reached `second`.
        await database_sync_to_async(results_release)(user=volunteer_user, work_unit_ids=held)
        assert await second.receive_nothing(timeout=0.5)
        await database_sync_to_async(feed_work_units)()  # the beat, run in place
        pushed = json.loads(await second.receive_from(timeout=10))
        assert pushed["type"] == "assign" and pushed["work_unit"]["id"] in held
        await first.disconnect()
        await second.disconnect()

    async_to_sync(scenario)()


def _waiting_members() -> set[str]:
    store = redis.Redis.from_url(settings.REDIS_URL)
    return {member.decode() for member in store.zrange(f"asgi:group:{notify.WAITING_GROUP}", 0, -1)}


def test_only_volunteers_told_idle_hear_that_work_is_available(
    mlp_project: Project, volunteer_user: User, other_volunteer: User
) -> None:
    """Broadcast to every connection, each beat's work.available woke all 19,000 idle consumers of a web
    process; a volunteer computing or not asking needs none."""

    async def scenario() -> None:
        first = await greet(volunteer_user)
        held = [(await send(first, {"type": "ready"}))["work_unit"]["id"] for _ in range(2)]
        second = await greet(other_volunteer)
        assert await database_sync_to_async(_waiting_members)() == set()  # greeted, not asking
        assert (await send(second, {"type": "ready"}))["type"] == "idle"
        assert len(await database_sync_to_async(_waiting_members)()) == 1  # the second alone
        await database_sync_to_async(results_release)(user=volunteer_user, work_unit_ids=held)
        await database_sync_to_async(_announce_work)()
        pushed = json.loads(await second.receive_from(timeout=10))
        assert pushed["type"] == "assign" and pushed["work_unit"]["id"] in held
        assert await first.receive_nothing(timeout=0.3)  # not waiting: told nothing
        assert await database_sync_to_async(_waiting_members)() == set()  # assigned: out of the group
        await first.disconnect()
        await second.disconnect()

    async_to_sync(scenario)()


def test_cancel_reaches_the_volunteer_holding_stale_work(mlp_project: Project, volunteer_user: User) -> None:
    async def scenario() -> None:
        communicator = await greet(volunteer_user)
        assign = await send(communicator, {"type": "ready"})
        await database_sync_to_async(_pause)(mlp_project)
        cancel = json.loads(await communicator.receive_from(timeout=10))
        assert cancel == {
            "type": "cancel",
            "work_units": [assign["work_unit"]["id"]],
            "reason": "project paused",
        }
        await communicator.disconnect()

    async_to_sync(scenario)()


def _pause(project: Project) -> None:
    from projects.services import project_pause

    project_pause(project=project)


def test_a_replica_is_pushed_to_a_waiting_volunteer_and_both_hear_the_verdict_once_they_agree(
    mlp_project: Project, volunteer_user: User, other_volunteer: User
) -> None:
    def only_one_unit_later() -> WorkUnit:
        Project.objects.filter(pk=mlp_project.pk).update(spot_check_by=Project.SpotCheckBy.REPLICA)
        first, *rest = WorkUnit.objects.filter(project=mlp_project).order_by("pk")
        WorkUnit.objects.filter(pk__in=[w.pk for w in rest]).update(status=WorkUnit.Status.CANCELLED)
        WorkUnit.objects.filter(pk=first.pk).update(wanted=0)  # nothing to send yet
        return first

    async def result(communicator: WebsocketCommunicator, unit: dict[str, Any]) -> dict[str, Any]:
        work_unit = await database_sync_to_async(
            WorkUnit.objects.select_related("project", "version", "shard__blob").get
        )(pk=unit["id"])
        meta = {
            "type": "result",
            "work_unit": unit["id"],
            "model_version": unit["model_version"],
            "samples": 50,
            "loss": 2.3,
            "timings": {"download_ms": 1, "compute_ms": 2},
        }
        await communicator.send_to(text_data=json.dumps(meta))
        await communicator.send_to(bytes_data=await database_sync_to_async(honest_update)(work_unit))
        return json.loads(await communicator.receive_from(timeout=10))

    async def scenario() -> None:
        unit = await database_sync_to_async(only_one_unit_later)()
        checked, replica = await greet(volunteer_user), await greet(other_volunteer)
        assert (await send(replica, {"type": "ready"}))["type"] == "idle"
        await database_sync_to_async(WorkUnit.objects.filter(pk=unit.pk).update)(wanted=1)
        sent = await send(checked, {"type": "ready"})  # untrusted: its work unit is replicated
        pushed = json.loads(await replica.receive_from(timeout=10))
        assert pushed["type"] == "assign" and pushed["work_unit"]["id"] == sent["work_unit"]["id"] == unit.pk

        ack = await result(checked, sent["work_unit"])
        assert (ack["type"], ack["accepted"], ack["status"]) == ("ack", True, "pending")
        assert await checked.receive_nothing(timeout=0.5)  # no verdict before the replica is in
        ack = await result(replica, pushed["work_unit"])
        assert (ack["status"], ack["credit_flops"]) == ("valid", 50 * mlp_project.flops_per_sample)
        for communicator in (checked, replica):
            credit = json.loads(await communicator.receive_from(timeout=10))
            assert (credit["type"], credit["status"]) == ("credit", "valid"), credit
            assert credit["credit_flops"] == 50 * mlp_project.flops_per_sample
        await checked.disconnect()
        await replica.disconnect()

    async_to_sync(scenario)()


def test_a_prefetch_refused_during_a_crowd_averaging_round_is_served_once_the_unit_is_in(
    mlp_project: Project, volunteer_user: User
) -> None:
    """A device computing a unit of a round whose units end with it gets no second one of it
    (lifecycle._not_computing_its_round): its prefetch `ready` is parked. Once its result is in, that
    parked `ready` gets the rest of the round it may take, without waiting for the next round's news."""
    Project.objects.filter(pk=mlp_project.pk).update(
        mode="averaging", batch_size=10, round_samples=40, crowd_rounds=True, spot_check_rate=0.0
    )
    WorkUnit.objects.filter(project=mlp_project).delete()

    async def scenario() -> None:
        communicator = await greet(volunteer_user)
        await database_sync_to_async(feed_work_units)()  # the round, planned for the connected device
        assign = await send(communicator, {"type": "ready"})
        assert assign["type"] == "assign"
        assert (await send(communicator, {"type": "ready"}))["type"] == "idle"  # its prefetch, parked
        unit = assign["work_unit"]
        work_unit = await database_sync_to_async(
            WorkUnit.objects.select_related("project", "version", "shard__blob").get
        )(pk=unit["id"])
        await communicator.send_to(text_data=json.dumps(_result(unit, samples=work_unit.count)))
        await communicator.send_to(bytes_data=await database_sync_to_async(honest_update)(work_unit))
        kinds = [json.loads(await communicator.receive_from(timeout=10))["type"] for _ in range(3)]
        assert sorted(kinds) == ["ack", "assign", "credit"], kinds
        await communicator.disconnect()

    async_to_sync(scenario)()


def _result(unit: dict[str, Any], *, samples: int) -> dict[str, Any]:
    return {
        "type": "result",
        "work_unit": unit["id"],
        "model_version": unit["model_version"],
        "samples": samples,
        "loss": 2.3,
        "timings": {"download_ms": 1, "compute_ms": 2},
    }
