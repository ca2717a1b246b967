"""config/admission.py through the real ASGI stack (session auth, Redis channel layer, PostgreSQL): past its
bound, a connection waits in line for a slot, and one that waited too long (or may not wait) is closed with
4503 and no work; a welcome or a departure frees a slot for the first in line."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
from asgiref.sync import async_to_sync
from channels.testing import WebsocketCommunicator
from django.contrib.auth.models import User
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect as ws_connect

from config import admission
from config.admission import RETRY_LATER, AdmissionMiddleware
from config.asgi import application
from config.management.commands.runplatform import daphne_listen
from tests.integration.test_consumers import HELLO, connect, send
from tests.integration.test_web_server import ROOT, free_port, listen_backlog

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def gate() -> Iterator[AdmissionMiddleware]:
    middleware = application.application_mapping["websocket"]
    assert isinstance(middleware, AdmissionMiddleware)
    limit, wait = middleware.admission.limit, middleware.wait
    middleware.admission.limit, middleware.wait = 2, 0.0  # no waiting in line, unless a test says so
    yield middleware
    middleware.admission.limit, middleware.wait = limit, wait


async def turned_away(communicator: WebsocketCommunicator) -> float:
    """Seconds from the handshake to the 4503 close (the handshake is accepted: browsers see the code)."""
    started = time.monotonic()
    connected, _ = await communicator.connect(timeout=5)
    assert connected
    closing: dict[str, Any] = await communicator.receive_output(timeout=5)
    assert closing == {"type": "websocket.close", "code": RETRY_LATER}
    return time.monotonic() - started


def test_over_the_bound_connections_get_4503_at_once_and_a_welcome_frees_a_slot(
    gate: AdmissionMiddleware, volunteer_user: User
) -> None:
    async def scenario() -> None:
        first, second = await connect(volunteer_user), await connect(volunteer_user)
        assert (await first.connect())[0] and (await second.connect())[0]
        assert gate.admission.admitting == 2
        assert await turned_away(await connect(volunteer_user)) < 1.0
        assert gate.admission.admitting == 2  # the bound held: the third took no slot
        assert (await send(first, HELLO))["type"] == "welcome"
        assert gate.admission.admitting == 1  # welcomed: admitted, its slot is free again
        third = await connect(volunteer_user)
        assert (await third.connect())[0]
        assert (await send(third, HELLO))["type"] == "welcome"
        for communicator in (first, second, third):
            await communicator.disconnect(timeout=10)
        assert gate.admission.admitting == 0

    async_to_sync(scenario)()


def test_a_connection_that_never_says_hello_gives_its_slot_back(
    gate: AdmissionMiddleware, volunteer_user: User, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(admission, "ADMIT_SECONDS", 0.2)

    async def scenario() -> None:
        silent = [await connect(volunteer_user) for _ in range(2)]
        for communicator in silent:
            assert (await communicator.connect())[0]
        assert await turned_away(await connect(volunteer_user)) < 1.0
        await communicator.receive_nothing(timeout=0.5)  # past ADMIT_SECONDS, still connected
        assert gate.admission.admitting == 0
        late = await connect(volunteer_user)
        assert (await late.connect())[0] and (await send(late, HELLO))["type"] == "welcome"
        for communicator in (*silent, late):
            await communicator.disconnect(timeout=10)

    async_to_sync(scenario)()


@pytest.mark.slow
def test_daphne_sends_the_retry_later_close_code_to_a_browser() -> None:
    """Through the real server: autobahn refuses RFC 6455's 1013 from an application (the first version
    sent it, and the socket hung until the client's timeout); 4503 reaches the client at once."""
    port = free_port()
    args = [
        sys.executable,
        "-m",
        "config.web_server",
        *daphne_listen("127.0.0.1", port),
        "config.asgi:application",
    ]
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "config.settings",
        "CROWDTRAIN_SOCKET_ADMISSIONS": "0",
        "CROWDTRAIN_SOCKET_ADMISSION_WAIT_SECONDS": "0",
    }
    daphne = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        listen_backlog(port)
        started = time.monotonic()
        url = f"ws://127.0.0.1:{port}/ws/volunteer/"
        with ws_connect(url, open_timeout=30) as socket, pytest.raises(ConnectionClosed) as closed:
            socket.recv(timeout=10)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == RETRY_LATER == 4503
        assert time.monotonic() - started < 5
    finally:
        daphne.terminate()
        daphne.wait(timeout=15)


def test_one_address_holds_at_most_its_share_of_the_slots() -> None:
    """Silent sockets from one host cannot take every slot: other addresses are still admitted, and the
    host gets its slots back as its connections end."""
    gate = admission.Admission(limit=32)
    held = [gate.ticket("203.0.113.9") for _ in range(admission.PER_ADDRESS)]
    assert all(held)
    assert gate.ticket("203.0.113.9") is None
    assert gate.ticket("198.51.100.7") is not None
    held[0].done()  # type: ignore[union-attr]
    held[0].done()  # type: ignore[union-attr]  # twice frees one slot, not two
    assert gate.ticket("203.0.113.9") is not None
    assert gate.ticket("203.0.113.9") is None
    assert gate.admitting == admission.PER_ADDRESS + 1


def test_past_the_bound_a_connection_waits_in_line_and_gets_the_next_free_slot(
    gate: AdmissionMiddleware, volunteer_user: User
) -> None:
    gate.wait = 10.0

    async def scenario() -> None:
        first, second = await connect(volunteer_user), await connect(volunteer_user)
        assert (await first.connect())[0] and (await second.connect())[0]
        third = await connect(volunteer_user)
        handshake = asyncio.ensure_future(third.connect(timeout=10))
        await asyncio.sleep(0.3)
        assert not handshake.done() and len(gate.admission.waiting) == 1  # in line, not turned away
        assert (await send(first, HELLO))["type"] == "welcome"  # frees a slot: the third gets it
        assert (await handshake)[0]
        assert gate.admission.admitting == 2 and not gate.admission.waiting
        assert (await send(third, HELLO))["type"] == "welcome"
        for communicator in (first, second, third):
            await communicator.disconnect(timeout=10)
        assert gate.admission.admitting == 0 and not gate.admission.by_address

    async_to_sync(scenario)()


def test_a_connection_that_waited_too_long_gets_4503(gate: AdmissionMiddleware, volunteer_user: User) -> None:
    gate.wait = 0.3

    async def scenario() -> None:
        held = [await connect(volunteer_user) for _ in range(2)]
        for communicator in held:
            assert (await communicator.connect())[0]
        waited = await turned_away(await connect(volunteer_user))
        assert 0.3 <= waited < 2.0
        assert gate.admission.admitting == 2 and not any(not s.done() for s in gate.admission.waiting)
        for communicator in held:
            await communicator.disconnect(timeout=10)

    async_to_sync(scenario)()


async def a_line(*addresses: str) -> tuple[admission.Admission, admission.Ticket, list[Any]]:
    """A gate of one slot, held, and a connection from each address waiting in line for it."""
    gate = admission.Admission(limit=1)
    first = gate.ticket("192.0.2.1")
    assert first is not None
    waiting = [asyncio.ensure_future(gate.wait_ticket(address, wait=5)) for address in addresses]
    await asyncio.sleep(0.05)
    return gate, first, waiting


def test_the_line_is_first_come_first_served_and_loses_no_slot() -> None:
    async def scenario() -> None:
        gate, first, (second, gone, third) = await a_line("192.0.2.2", "192.0.2.3", "192.0.2.4")
        assert gate.ticket("192.0.2.5") is None  # no jumping the line
        gone.cancel()  # a connection that went away while waiting
        first.done()
        ticket = await second
        assert ticket is not None and ticket.address == "192.0.2.2" and not third.done()
        ticket.done()
        last = await third
        assert last is not None and gate.admitting == 1
        last.done()
        assert gate.admitting == 0 and not gate.waiting and not gate.by_address

    asyncio.run(scenario())


def test_a_slot_handed_to_a_connection_that_just_went_away_goes_to_the_next() -> None:
    async def scenario() -> None:
        gate, first, (leaving, next_) = await a_line("192.0.2.2", "192.0.2.3")
        first.done()  # hands the slot to `leaving`...
        leaving.cancel()  # ...which is cancelled before it runs again
        try:
            kept = await leaving
        except asyncio.CancelledError:
            kept = None  # it gave the slot back
        if kept is not None:  # Python 3.11's wait_for returns what it was handed rather than raising
            kept.done()  # as AdmissionMiddleware's `finally` does
        ticket = await next_
        assert ticket is not None and gate.admitting == 1
        ticket.done()
        assert gate.admitting == 0 and not gate.by_address

    asyncio.run(scenario())


def test_past_the_line_limit_a_connection_is_turned_away_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A flood of connections from many addresses fills the line, not the process's memory."""
    monkeypatch.setattr(admission, "QUEUE_LIMIT", 1)

    async def scenario() -> None:
        gate, first, (waiting,) = await a_line("192.0.2.2")
        started = time.monotonic()
        assert await gate.wait_ticket("192.0.2.3", wait=5) is None
        assert time.monotonic() - started < 1.0 and not gate.by_address.get("192.0.2.3")
        first.done()
        ticket = await waiting
        assert ticket is not None
        ticket.done()

    asyncio.run(scenario())
