"""`signal` messages (workers/signalling.py) through the real ASGI stack on PostgreSQL and Redis: forwarded,
stamped with the sender's device, to the named connected device only, when signalling_allowed lets the pair
talk; hostile ones get an `error` and the connection stays usable."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import pytest
from asgiref.sync import async_to_sync
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.contrib.auth.models import User
from django.core.cache import cache

from config.asgi import application
from engine import spec
from tests.integration.test_consumers import HELLO, send, session_headers
from workers import limits, protocol, signalling
from workers.models import Device

pytestmark = pytest.mark.django_db(transaction=True)

OFFER = "v=0\r\no=- 4611731400430051336 2 IN IP4 127.0.0.1\r\ns=-\r\nt=0 0\r\n"


@pytest.fixture(autouse=True)
def adjacent(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every pair computes adjacent stages here: which pairs do is projects/ring.ring_adjacent's, tested with
    the lifecycle (tests/integration/test_ring_lifecycle.py); the hook's wiring is tested below."""
    monkeypatch.setattr(signalling, "ring_adjacent", lambda *, device_id, other_id: True)


@pytest.fixture(autouse=True)
def fresh_counters(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The connect throttle counts in Redis, which outlives a test's database."""
    monkeypatch.setattr(limits, "current_window", lambda: 1)
    cache.clear()
    yield
    cache.clear()


async def greeted(user: User, device: str) -> tuple[WebsocketCommunicator, int]:
    """A connection of `user` from browser `device`, and that device's id (its peer id)."""
    headers = await database_sync_to_async(session_headers)(user)
    communicator = WebsocketCommunicator(application, "/ws/volunteer/", headers=headers)
    connected, _ = await communicator.connect(timeout=10)
    assert connected
    hello = {**HELLO, "device": {**HELLO["device"], "id": device}}
    assert (await send(communicator, hello))["type"] == "welcome"
    row = await database_sync_to_async(Device.objects.get)(volunteer__user=user, client_id=device)
    return communicator, row.pk


def signal(to: int, **fields: Any) -> dict[str, Any]:
    return {"type": "signal", "to": to, "kind": "offer", "data": OFFER, "link": "stage0-1", **fields}


async def signal_sent(communicator: WebsocketCommunicator, message: dict[str, Any]) -> None:
    await communicator.send_to(text_data=json.dumps(message))


async def received(communicator: WebsocketCommunicator) -> dict[str, Any]:
    message: dict[str, Any] = json.loads(await communicator.receive_from(timeout=10))
    return message


async def still_usable(communicator: WebsocketCommunicator) -> None:
    assert (await send(communicator, {"type": "ready"}))["type"] in ("idle", "assign")


async def departed(device_id: int) -> None:
    """Until the device is marked disconnected: the consumer may leave in a batch (workers/presence.py)."""
    for _ in range(100):
        row = await database_sync_to_async(Device.objects.get)(pk=device_id)
        if row.disconnected_at is not None:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"device {device_id} is still connected")


def run(scenario: Any) -> None:
    async_to_sync(scenario)()


def test_a_signal_reaches_the_named_device_stamped_with_the_senders(
    volunteer_user: User, other_volunteer: User
) -> None:
    async def scenario() -> None:
        alice, alice_id = await greeted(volunteer_user, "alice-browser-1")
        bob, bob_id = await greeted(other_volunteer, "bob-browser-01")
        await signal_sent(alice, signal(bob_id))
        assert await received(bob) == {
            "type": "signal",
            "from": alice_id,
            "link": "stage0-1",
            "kind": "offer",
            "data": OFFER,
        }
        await signal_sent(bob, signal(alice_id, kind="answer", data="v=0 answer"))
        answer = await received(alice)
        assert (answer["from"], answer["kind"], answer["data"]) == (bob_id, "answer", "v=0 answer")
        assert await alice.receive_nothing() and await bob.receive_nothing()  # no echo, no reply
        await alice.disconnect()
        await bob.disconnect()

    run(scenario)


def test_only_the_named_device_of_a_volunteer_hears_it(volunteer_user: User, other_volunteer: User) -> None:
    async def scenario() -> None:
        alice, _ = await greeted(volunteer_user, "alice-browser-1")
        bob_laptop, laptop_id = await greeted(other_volunteer, "bob-laptop-001")
        bob_phone, _ = await greeted(other_volunteer, "bob-phone-0001")
        await signal_sent(alice, signal(laptop_id, kind="candidate", data='{"candidate":""}'))
        assert (await received(bob_laptop))["kind"] == "candidate"
        assert await bob_phone.receive_nothing()
        for communicator in (alice, bob_laptop, bob_phone):
            await communicator.disconnect()

    run(scenario)


def test_unknown_departed_and_own_devices_are_refused(volunteer_user: User, other_volunteer: User) -> None:
    async def scenario() -> None:
        alice, alice_id = await greeted(volunteer_user, "alice-browser-1")
        bob, bob_id = await greeted(other_volunteer, "bob-browser-01")
        await bob.disconnect()
        await departed(bob_id)
        for to in (bob_id, alice_id, 2**31 - 1):
            error = await send(alice, signal(to))
            assert (error["type"], error["code"]) == ("error", "unknown_peer")
            assert str(to) in error["message"]
        await still_usable(alice)
        await alice.disconnect()

    run(scenario)


def test_pairs_the_hook_refuses_are_not_forwarded(
    volunteer_user: User, other_volunteer: User, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: list[tuple[signalling.Peer, signalling.Peer]] = []

    def refuse(sender: signalling.Peer, recipient: signalling.Peer) -> bool:
        asked.append((sender, recipient))
        return False

    monkeypatch.setattr(signalling, "signalling_allowed", refuse)

    async def scenario() -> None:
        alice, alice_id = await greeted(volunteer_user, "alice-browser-1")
        bob, bob_id = await greeted(other_volunteer, "bob-browser-01")
        assert (await send(alice, signal(bob_id)))["code"] == "unknown_peer"
        assert await bob.receive_nothing()
        assert asked == [
            (signalling.Peer(alice_id, volunteer_user.pk), signalling.Peer(bob_id, other_volunteer.pk))
        ]
        await alice.disconnect()
        await bob.disconnect()

    run(scenario)


HOSTILE = {
    "oversize data": {"data": "a" * (spec.PROTOCOL["signal"]["max_data"] + 1)},
    "to as a string": {"to": "1"},
    "to as a bool": {"to": True},
    "to negative": {"to": -1},
    "to a float": {"to": 1.0},
    "unknown kind": {"kind": "hangup"},
    "data a number": {"data": 5},
    "data with NUL": {"data": "v=0\x00"},
    "data a lone surrogate": {"data": "\ud800"},
    "link with a slash": {"link": "a/b"},
    "link too long": {"link": "x" * 65},
    "no data": {"data": None},
}


def test_hostile_signals_get_an_error_and_reach_no_one(volunteer_user: User, other_volunteer: User) -> None:
    async def scenario() -> None:
        alice, _ = await greeted(volunteer_user, "alice-browser-1")
        bob, bob_id = await greeted(other_volunteer, "bob-browser-01")
        for name, fields in HOSTILE.items():
            message = {key: value for key, value in {**signal(bob_id), **fields}.items() if value is not None}
            error = await send(alice, message)
            assert (error["type"], error["code"]) == ("error", "bad_message"), name
        assert await bob.receive_nothing()
        await still_usable(alice)
        await alice.disconnect()
        await bob.disconnect()

    run(scenario)


def test_a_signal_before_hello_is_refused(volunteer_user: User) -> None:
    async def scenario() -> None:
        headers = await database_sync_to_async(session_headers)(volunteer_user)
        communicator = WebsocketCommunicator(application, "/ws/volunteer/", headers=headers)
        assert (await communicator.connect(timeout=10))[0]
        assert (await send(communicator, signal(1)))["code"] == "protocol"
        await communicator.disconnect()

    run(scenario)


def test_signals_are_bounded_per_connection(
    volunteer_user: User, other_volunteer: User, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(signalling, "SIGNALS_PER_MINUTE", 3)

    async def scenario() -> None:
        alice, _ = await greeted(volunteer_user, "alice-browser-1")
        bob, bob_id = await greeted(other_volunteer, "bob-browser-01")
        for _ in range(3):
            await signal_sent(alice, signal(bob_id, kind="candidate"))
            assert (await received(bob))["kind"] == "candidate"
        error = await send(alice, signal(bob_id))
        assert (error["code"], "3 signals a minute" in error["message"]) == ("busy", True)
        assert await bob.receive_nothing()
        await alice.disconnect()
        await bob.disconnect()

    run(scenario)


def test_the_signal_schema_is_the_spec_files() -> None:
    kinds = protocol.Signal.model_fields["kind"].annotation.__args__  # type: ignore[union-attr]
    assert list(kinds) == spec.PROTOCOL["signal"]["kinds"]
    assert "signal" in spec.PROTOCOL["client_messages"] and "signal" in spec.PROTOCOL["server_messages"]
