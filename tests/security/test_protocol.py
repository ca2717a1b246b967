"""The volunteer WebSocket under hostile input (issue 9, items 2, 4, 5 and 7), through the real ASGI stack on
PostgreSQL and Redis: no frame crashes the consumer (close 1011), cleanup runs whatever happened, result
frames are bounded per connection and in total, every browser is one Device, and connects are throttled."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from asgiref.sync import async_to_sync
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from channels_redis.core import RedisChannelLayer
from django.conf import settings
from django.contrib.auth.models import User
from django.core.cache import cache

from config.asgi import application
from engine import spec
from projects import notify
from projects.models import Blob, Project, Result, WorkUnit
from tests.integration.test_consumers import HELLO, send, session_headers
from tests.integration.volunteer import honest_update
from workers import limits, protocol
from workers.models import CreditEntry, Device

pytestmark = pytest.mark.django_db(transaction=True)

DEVICE_ID = "browser-0123456789abcdef"
HELLO_WITH_ID: dict[str, Any] = {**HELLO, "device": {**HELLO["device"], "id": DEVICE_ID}}
RESULT: dict[str, Any] = {
    "type": "result",
    "model_version": 0,
    "samples": 50,
    "loss": 2.3,
    "timings": {"download_ms": 1, "compute_ms": 2},
}


@pytest.fixture(autouse=True)
def fresh_counters(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Throttle counters live in Redis and outlive a test's database. The connect limiter's minute stands
    still: a window boundary passing mid-test (the run of connects is slow on a loaded machine) reset the
    counts and failed the test under load."""
    monkeypatch.setattr(limits, "current_window", lambda: 1)
    cache.clear()
    yield
    cache.clear()


async def open_socket(user: User, address: str | None = None) -> WebsocketCommunicator:
    headers = await database_sync_to_async(session_headers)(user)
    communicator = WebsocketCommunicator(application, "/ws/volunteer/", headers=headers)
    if address is not None:
        communicator.scope["client"] = (address, 50000)  # what daphne puts there (or --proxy-headers)
    connected, _ = await communicator.connect(timeout=10)
    assert connected
    return communicator


async def greeted(user: User) -> WebsocketCommunicator:
    communicator = await open_socket(user)
    assert (await send(communicator, HELLO_WITH_ID))["type"] == "welcome"
    return communicator


async def reply(communicator: WebsocketCommunicator, text: str) -> dict[str, Any]:
    await communicator.send_to(text_data=text)
    return json.loads(await communicator.receive_from(timeout=10))


async def still_usable(communicator: WebsocketCommunicator) -> None:
    """A valid message after the bad one is answered: the consumer is alive and not confused."""
    assert (await send(communicator, HELLO_WITH_ID))["type"] == "welcome"


def run(scenario: Any) -> None:
    async_to_sync(scenario)()


# --- item 2: nothing crashes the consumer ------------------------------------------------------------

DEEP = "[" * 5000 + "]" * 5000
FIELDS = '"model_version": 0, "samples": 1, "loss": 1'
CRASH_FRAMES = {
    "type is an object": '{"type": {}}',
    "type is a list": '{"type": []}',
    "a list": "[]",
    "a string": '"x"',
    "a number": "42",
    "null": "null",
    "deep nesting": '{"type": "hello", "junk": ' + DEEP + "}",
    "deep nesting alone": DEEP,
    "Infinity work unit": '{"type": "result", "work_unit": Infinity, ' + FIELDS + "}",
    "-Infinity samples": '{"type": "result", "work_unit": 1, "model_version": 0, "samples": -Infinity}',
    "NaN loss": '{"type": "result", "work_unit": 1, "model_version": 0, "samples": 1, "loss": NaN}',
    "1e400 work unit": '{"type": "result", "work_unit": 1e400, ' + FIELDS + "}",
    "1e400 loss": '{"type": "result", "work_unit": 1, "model_version": 0, "samples": 1, "loss": 1e400}',
    "2^63 work unit": json.dumps({**RESULT, "work_unit": 2**63}),
    "2^64 model version": json.dumps({**RESULT, "work_unit": 1, "model_version": 2**64}),
    "negative samples": json.dumps({**RESULT, "work_unit": 1, "samples": -1}),
    "bool work unit": json.dumps({**RESULT, "work_unit": True}),
    "float samples": json.dumps({**RESULT, "work_unit": 1, "samples": 1.5}),
    "string samples": json.dumps({**RESULT, "work_unit": 1, "samples": "50"}),
    "timings a list": json.dumps({**RESULT, "work_unit": 1, "timings": [1, 2]}),
    "compute_ms 2^63-1": json.dumps({**RESULT, "work_unit": 1, "timings": {"compute_ms": 2**63 - 1}}),
    "nested junk in a field": json.dumps({**RESULT, "work_unit": {"a": [{"b": [1, {"c": None}]}]}}),
    "progress fraction NaN": '{"type": "progress", "work_unit": 1, "fraction": NaN}',
    "progress work unit a string": json.dumps({"type": "progress", "work_unit": "x", "fraction": 0.5}),
    "hello NUL in backend": json.dumps({**HELLO, "device": {"backend": "web\x00gl", "gflops": 1}}),
    "hello NUL in user agent": json.dumps({**HELLO, "device": {"backend": "webgl", "user_agent": "a\x00b"}}),
    "hello lone surrogate": '{"type": "hello", "protocol": 1, "device": {"user_agent": "\\ud800"}}',
    "hello NUL in device id": json.dumps({**HELLO, "device": {"backend": "webgl", "id": "abcdefgh\x00"}}),
    "hello device id too short": json.dumps({**HELLO, "device": {"backend": "webgl", "id": "abc"}}),
    "hello device id with spaces": json.dumps({**HELLO, "device": {"backend": "webgl", "id": "a b c d e f"}}),
    "hello long backend": json.dumps({**HELLO, "device": {"backend": "w" * 5000}}),
    "hello device a list": json.dumps({**HELLO, "device": ["webgl"]}),
    "hello gflops 1e400": '{"type": "hello", "protocol": 1, "device": {"gflops": 1e400}}',
    "hello gflops Infinity": '{"type": "hello", "protocol": 1, "device": {"gflops": Infinity}}',
    "hello memory huge": json.dumps({**HELLO, "device": {"backend": "webgl", "memory_mb": 2**70}}),
    "hello protocol 2^64": json.dumps({**HELLO, "protocol": 2**64}),
    "hello protocol a dict": json.dumps({**HELLO, "protocol": {}}),
    "hello preferences junk": json.dumps({**HELLO, "preferences": {"max_work_units": [1]}}),
}


def test_hostile_text_frames_get_bad_message_and_the_socket_stays_usable(volunteer_user: User) -> None:
    """All on one connection, each followed by a valid hello: before the fix, the first crash (close 1011)
    left every later frame unanswered."""
    wrong: dict[str, Any] = {}

    async def scenario() -> None:
        communicator = await greeted(volunteer_user)
        for name, frame in CRASH_FRAMES.items():
            try:
                error = await reply(communicator, frame)
                readable = 0 < len(error.get("message", "")) < 1000
                if (error["type"], error.get("code")) != ("error", "bad_message") or not readable:
                    wrong[name] = error
                await still_usable(communicator)
            except Exception as exc:  # a crashed consumer: timeouts, or its own exception re-raised
                wrong[name] = repr(exc)
                return
        await communicator.disconnect()

    run(scenario)
    assert wrong == {}
    assert Device.objects.filter(volunteer__user=volunteer_user).count() == 1  # the valid hellos: one browser


@pytest.mark.parametrize("field", ["samples", "compute_ms", "download_ms", "model_version"])
def test_out_of_range_numbers_for_a_real_work_unit_are_refused_before_storing(
    mlp_project: Project, volunteer_user: User, field: str
) -> None:
    """samples / compute_ms >= 2^31 reached PostgreSQL (DataError, close 1011) with a held work unit. Now the
    message is refused, and the instance it answers is invalid at once: left in progress, a poisoning
    volunteer held a slice of every round until its deadline."""

    async def scenario() -> None:
        communicator = await greeted(volunteer_user)
        unit = (await send(communicator, {"type": "ready"}))["work_unit"]
        message: dict[str, Any] = {**RESULT, "work_unit": unit["id"], "timings": dict(RESULT["timings"])}
        if field in message["timings"]:
            message["timings"][field] = 2**31
        else:
            message[field] = 2**31
        error = await send(communicator, message)
        assert (error["code"], error["work_unit"]) == ("bad_message", unit["id"])
        verdict = await communicator.receive_json_from(timeout=10)
        assert (verdict["type"], verdict["work_unit"], verdict["status"]) == ("credit", unit["id"], "invalid")
        assert "the result message was refused: Malformed result" in verdict["reason"]
        await communicator.send_to(bytes_data=b"tensors")
        # Nothing is pending: the bytes are refused too.
        assert (await communicator.receive_json_from(timeout=10))["code"] == "bad_message"
        await still_usable(communicator)
        await communicator.disconnect()

    run(scenario)
    stored = Result.objects.select_related("work_unit").get(volunteer=volunteer_user)
    assert (stored.status, stored.validation, stored.blob_id) == ("received", "invalid", None)
    assert stored.work_unit.wanted == 1  # its slice is sent again at once
    assert not CreditEntry.objects.exists()


def test_a_malformed_result_for_work_not_held_changes_nothing(
    mlp_project: Project, volunteer_user: User, other_volunteer: User
) -> None:
    async def scenario() -> None:
        other = await greeted(other_volunteer)
        unit = (await send(other, {"type": "ready"}))["work_unit"]
        communicator = await greeted(volunteer_user)
        message = {**RESULT, "work_unit": unit["id"], "samples": -1}
        error = await send(communicator, message)
        assert (error["code"], error["work_unit"]) == ("bad_message", unit["id"])
        await still_usable(communicator)  # and no credit message came before the welcome
        await communicator.disconnect()
        await other.disconnect()

    run(scenario)
    assert not Result.objects.filter(validation=Result.Validation.INVALID).exists()


def test_an_oversized_text_frame_is_refused(volunteer_user: User) -> None:
    async def scenario() -> None:
        communicator = await greeted(volunteer_user)
        assert (await reply(communicator, json.dumps({"type": "progress", "x": "a" * 70_000})))["code"] == (
            "too_large"
        )
        await still_usable(communicator)
        await communicator.disconnect()

    run(scenario)


def _status(work_unit_id: int) -> str:
    return Result.objects.get(work_unit_id=work_unit_id).status


# --- item 2: cleanup runs whatever happened ----------------------------------------------------------


def _group_size(group: str) -> int:
    return int(redis.Redis.from_url(settings.REDIS_URL).zcard(f"asgi:group:{group}"))


def _connected_devices(user: User) -> int:
    return Device.objects.filter(volunteer__user=user, disconnected_at=None).count()


def _in_progress(user: User) -> int:
    return Result.objects.filter(volunteer=user, status=Result.Status.IN_PROGRESS).count()


def test_an_unexpected_exception_is_answered_logged_once_and_cleanup_still_runs(
    mlp_project: Project,
    volunteer_user: User,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Fault injection: a bug while building the reply to `ready`, after the work unit was handed out."""
    from workers import protocol

    def broken(result: Result, **why: Any) -> dict[str, Any]:
        raise RuntimeError("a bug")

    async def scenario() -> None:
        communicator = await greeted(volunteer_user)
        assert _group_size(notify.VOLUNTEERS_GROUP) == 1
        with monkeypatch.context() as patch:
            patch.setattr(protocol, "assign_message", broken)
            error = await send(communicator, {"type": "ready"})
        assert (error["type"], error["code"]) == ("error", "server_error")
        await still_usable(communicator)
        assert await database_sync_to_async(_in_progress)(volunteer_user) == 1
        await communicator.disconnect()  # the consumer is still alive: its disconnect runs

    with caplog.at_level(logging.ERROR, logger="workers.consumers"):
        run(scenario)
    assert [r.exc_info[0] for r in caplog.records if r.exc_info] == [RuntimeError]
    assert _in_progress(volunteer_user) == 0  # the work unit went back to the pool
    assert _connected_devices(volunteer_user) == 0
    assert _group_size(notify.VOLUNTEERS_GROUP) == 0
    assert _group_size(notify.user_group(volunteer_user.pk)) == 0


def test_each_cleanup_step_runs_even_when_an_earlier_one_fails(
    mlp_project: Project, volunteer_user: User, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def refuse(*args: Any, **kwargs: Any) -> None:
        raise ConnectionError("redis went away")

    async def scenario() -> None:
        communicator = await greeted(volunteer_user)
        assert (await send(communicator, {"type": "ready"}))["type"] == "assign"
        monkeypatch.setattr(RedisChannelLayer, "group_discard", refuse)
        await communicator.disconnect()

    run(scenario)
    assert _in_progress(volunteer_user) == 0
    assert _connected_devices(volunteer_user) == 0


# --- item 4: result frames are bounded ---------------------------------------------------------------


def _unit(work_unit_id: int) -> WorkUnit:
    return WorkUnit.objects.select_related("project", "version", "shard__blob").get(pk=work_unit_id)


async def held_unit(communicator: WebsocketCommunicator) -> tuple[dict[str, Any], bytes]:
    unit = (await send(communicator, {"type": "ready"}))["work_unit"]
    payload = await database_sync_to_async(honest_update)(await database_sync_to_async(_unit)(unit["id"]))
    return unit, payload


async def upload(communicator: WebsocketCommunicator, unit: dict[str, Any], payload: bytes) -> dict[str, Any]:
    await communicator.send_to(text_data=json.dumps({**RESULT, "work_unit": unit["id"]}))
    await communicator.send_to(bytes_data=payload)
    return json.loads(await communicator.receive_from(timeout=10))


def test_a_frame_over_the_result_limit_is_refused_without_storing(
    mlp_project: Project, volunteer_user: User, settings: Any
) -> None:
    async def scenario() -> None:
        communicator = await greeted(volunteer_user)
        unit, payload = await held_unit(communicator)
        blobs = await database_sync_to_async(Blob.objects.count)()
        settings.CROWDTRAIN = {**settings.CROWDTRAIN, "MAX_RESULT_BYTES": len(payload) - 1}
        assert (await upload(communicator, unit, payload))["code"] == "too_large"
        assert await database_sync_to_async(Blob.objects.count)() == blobs
        assert await database_sync_to_async(_status)(unit["id"]) == Result.Status.IN_PROGRESS
        settings.CROWDTRAIN = {**settings.CROWDTRAIN, "MAX_RESULT_BYTES": len(payload)}
        assert (await upload(communicator, unit, payload))["accepted"] is True
        await communicator.disconnect()

    run(scenario)
    assert limits.RESULT_BYTES.in_use == 0


def test_one_pending_result_per_connection(mlp_project: Project, volunteer_user: User) -> None:
    async def scenario() -> None:
        communicator = await greeted(volunteer_user)
        unit, payload = await held_unit(communicator)
        await communicator.send_to(bytes_data=payload)  # no result message before it
        assert (await communicator.receive_json_from(timeout=10))["code"] == "bad_message"
        message = {**RESULT, "work_unit": unit["id"]}
        await communicator.send_to(text_data=json.dumps(message))
        assert (await send(communicator, message))["code"] == "bad_message"  # a second one before the bytes
        await communicator.send_to(bytes_data=payload)  # both announcements were dropped
        assert (await communicator.receive_json_from(timeout=10))["code"] == "bad_message"
        assert await database_sync_to_async(_status)(unit["id"]) == Result.Status.IN_PROGRESS
        assert (await upload(communicator, unit, payload))["accepted"] is True
        await communicator.disconnect()

    run(scenario)


def test_frames_over_the_process_wide_budget_get_busy_instead_of_memory(
    mlp_project: Project, volunteer_user: User, settings: Any
) -> None:
    async def scenario() -> None:
        communicator = await greeted(volunteer_user)
        unit, payload = await held_unit(communicator)
        budget = len(payload) * 3 // 2
        settings.CROWDTRAIN = {**settings.CROWDTRAIN, "MAX_INFLIGHT_RESULT_BYTES": budget}
        assert limits.RESULT_BYTES.take(len(payload), limit=budget)  # another connection's frame, in flight
        try:
            busy = await upload(communicator, unit, payload)
        finally:
            limits.RESULT_BYTES.give_back(len(payload))
        assert (busy["code"], busy["work_unit"]) == ("busy", unit["id"])
        assert busy["message"] == "The server is busy with other uploads: retry later."
        assert await database_sync_to_async(_status)(unit["id"]) == Result.Status.IN_PROGRESS
        assert (await upload(communicator, unit, payload))["accepted"] is True  # the budget is back
        await communicator.disconnect()

    run(scenario)
    assert limits.RESULT_BYTES.in_use == 0


def test_the_budget_is_given_back_when_storing_fails(
    mlp_project: Project, volunteer_user: User, monkeypatch: pytest.MonkeyPatch
) -> None:
    from workers import arrivals

    def broken(**kwargs: Any) -> None:
        raise RuntimeError("disk full")

    async def scenario() -> None:
        communicator = await greeted(volunteer_user)
        unit, payload = await held_unit(communicator)
        # Both ways a web process stores a result: its batches, and one at a time when a batch fails.
        monkeypatch.setattr(arrivals, "results_receive", broken)
        monkeypatch.setattr(arrivals, "result_receive", broken)
        assert (await upload(communicator, unit, payload))["code"] == "server_error"
        assert limits.RESULT_BYTES.in_use == 0
        await still_usable(communicator)
        await communicator.disconnect()

    run(scenario)


# --- item 7: one Device per browser ------------------------------------------------------------------


async def hello_once(user: User, device: dict[str, Any]) -> None:
    communicator = await open_socket(user)
    assert (await send(communicator, {**HELLO, "device": device}))["type"] == "welcome"
    await communicator.disconnect()


def test_a_browser_keeps_its_device_across_reconnections(volunteer_user: User, other_volunteer: User) -> None:
    async def scenario() -> None:
        for _ in range(3):
            await hello_once(volunteer_user, HELLO_WITH_ID["device"])
        communicator = await greeted(volunteer_user)  # connected again: the same row, connected again
        assert await database_sync_to_async(_connected_devices)(volunteer_user) == 1
        await communicator.disconnect()
        await hello_once(other_volunteer, HELLO_WITH_ID["device"])  # ids are per volunteer

    run(scenario)
    (device,) = Device.objects.filter(volunteer__user=volunteer_user)
    assert (device.client_id, device.backend, device.gflops) == (DEVICE_ID, "webgl", 12.5)
    assert device.disconnected_at is not None
    assert Device.objects.filter(volunteer__user=other_volunteer, client_id=DEVICE_ID).count() == 1


def _ms(seconds: float) -> int:
    return int(seconds * 1000)


def test_connected_time_adds_up_over_sessions_of_one_device(volunteer_user: User) -> None:
    async def session() -> None:
        await hello_once(volunteer_user, HELLO_WITH_ID["device"])

    run(session)
    first = Device.objects.get(volunteer__user=volunteer_user)
    run(session)
    second = Device.objects.get(pk=first.pk)
    assert first.disconnected_at and second.disconnected_at and second.connected_at > first.disconnected_at
    sessions = _ms((first.disconnected_at - first.connected_at).total_seconds()) + _ms(
        (second.disconnected_at - second.connected_at).total_seconds()
    )
    # Both sessions count as connected time; the gap between them (the browser was away) does not.
    assert abs(second.connected_ms(now=second.disconnected_at) - sessions) <= 1
    assert second.connected_ms(now=second.disconnected_at) == second.connected_ms(now=second.last_seen)


def test_old_clients_share_one_device_per_backend(volunteer_user: User) -> None:
    async def scenario() -> None:
        for backend in ["webgl", "webgl", "wasm", "webgl"]:
            await hello_once(volunteer_user, {"backend": backend, "gflops": 3})

    run(scenario)
    devices = Device.objects.filter(volunteer__user=volunteer_user)
    assert sorted(devices.values_list("client_id", flat=True)) == ["unknown:wasm", "unknown:webgl"]


def test_fuzzed_hellos_cannot_grow_devices_without_bound(
    volunteer_user: User, monkeypatch: pytest.MonkeyPatch
) -> None:
    from workers import services

    monkeypatch.setattr(services, "MAX_DEVICES_PER_VOLUNTEER", 3)

    async def scenario() -> None:
        communicator = await open_socket(volunteer_user)
        for i in range(12):
            device = {"backend": f"fuzz{i}", "id": f"fuzzed-device-{i:04d}"}
            assert (await send(communicator, {**HELLO, "device": device}))["type"] == "welcome"
            assert (await send(communicator, {**HELLO, "device": {"backend": f"b{i}"}}))["type"] == "welcome"
        await communicator.disconnect()

    run(scenario)
    devices = Device.objects.filter(volunteer__user=volunteer_user)
    assert devices.count() == 3 + 1  # three identified browsers, then everything shares "unknown:other"
    assert devices.filter(client_id="unknown:other").count() == 1


# --- item 5: connect throttling ----------------------------------------------------------------------


async def refused(user: User, address: str | None = None) -> bool:
    """Accepted, told why, then closed with 4429 (a browser never sees a code for a refused handshake)."""
    communicator = await open_socket(user, address)
    first = await send(communicator, HELLO_WITH_ID)
    if first["type"] == "welcome":
        await communicator.disconnect()
        return False
    assert (first["type"], first["code"]) == ("error", "throttled"), first
    assert await communicator.receive_output(timeout=10) == {"type": "websocket.close", "code": 4429}
    await communicator.disconnect()
    return True


def test_connects_are_throttled_per_account(volunteer_user: User, settings: Any) -> None:
    settings.CROWDTRAIN = {**settings.CROWDTRAIN, "WS_CONNECTS_PER_MINUTE_USER": 3}

    async def scenario() -> None:
        for _ in range(3):
            communicator = await greeted(volunteer_user)
            await communicator.disconnect()
        assert await refused(volunteer_user)
        assert await refused(volunteer_user)  # and it stays refused within the minute

    run(scenario)
    assert _group_size(notify.VOLUNTEERS_GROUP) == 0  # a refused socket never joined


def test_connects_are_throttled_per_address(
    volunteer_user: User, other_volunteer: User, settings: Any
) -> None:
    settings.CROWDTRAIN = {**settings.CROWDTRAIN, "WS_CONNECTS_PER_MINUTE_IP": 4}

    async def scenario() -> None:
        for user in [volunteer_user, other_volunteer, volunteer_user, other_volunteer]:
            assert not await refused(user, "203.0.113.7")
        assert await refused(other_volunteer, "203.0.113.7")
        assert not await refused(other_volunteer, "198.51.100.1")  # another address is not affected

    run(scenario)


def test_the_schemas_are_the_spec_files_client_messages() -> None:
    assert set(protocol.SCHEMAS) == set(spec.PROTOCOL["client_messages"])
    credit = {"credit_flops": 0, "total_credit_flops": 0, "recent_credit": 0.0}
    event = {"work_unit": 1, "status": "valid", "reason": "", **credit}
    for message in (protocol.error_message("busy", "later"), protocol.credit_message(event)):
        assert message["type"] in spec.PROTOCOL["server_messages"]
