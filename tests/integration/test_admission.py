"""config/admission.py through the real ASGI stack (session auth, Redis channel layer, PostgreSQL): past its
bound, a connection is closed at once with 1013 and no work; a welcome or a departure frees a slot."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from asgiref.sync import async_to_sync
from channels.testing import WebsocketCommunicator
from django.contrib.auth.models import User

from config import admission
from config.admission import RETRY_LATER, AdmissionMiddleware
from config.asgi import application
from tests.integration.test_consumers import HELLO, connect, send

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def gate() -> Iterator[AdmissionMiddleware]:
    middleware = application.application_mapping["websocket"]
    assert isinstance(middleware, AdmissionMiddleware)
    limit = middleware.admission.limit
    middleware.admission.limit = 2
    yield middleware
    middleware.admission.limit = limit


async def turned_away(communicator: WebsocketCommunicator) -> float:
    """Seconds from the handshake to the 1013 close (the handshake is accepted: browsers see the code)."""
    started = time.monotonic()
    connected, _ = await communicator.connect(timeout=5)
    assert connected
    closing: dict[str, Any] = await communicator.receive_output(timeout=5)
    assert closing == {"type": "websocket.close", "code": RETRY_LATER}
    return time.monotonic() - started


def test_over_the_bound_connections_get_1013_at_once_and_a_welcome_frees_a_slot(
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
