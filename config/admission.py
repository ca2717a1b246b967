"""How many WebSocket connections one web process admits at once, from the handshake to the welcome.

A reconnect storm's hellos (the session lookup, the throttle, the group adds, three database calls each) all
ran at once: daphne's one event loop competed for the GIL with their threads, pages waited 2-27 s (p99), and
handshakes timed out and were retried (5,000 reconnects took 24,193 attempts, issue 15). Past
SOCKET_ADMISSIONS being admitted, a connection is accepted and closed at once with 4503 (try again later),
before any session, Redis or database work: the browser comes back after its jittered back-off
(frontend/static/frontend/backoff.js; the attempt counts as a failure, as its welcome never came), and the
loop's queue stays short. A slot is held until the welcome or ADMIT_SECONDS, whichever comes first: a client
that never says hello cannot hold it."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings

from workers.protocol import CLOSE_RETRY_LATER

# RFC 6455's 1013 ("try again later") is not one an application may send through daphne (autobahn allows
# 1000 and 3000-4999 only): 4503, as HTTP's 503, in the protocol's own range (engine/spec.json).
RETRY_LATER = CLOSE_RETRY_LATER
ADMIT_SECONDS = 30.0


@dataclass
class Admission:
    limit: int
    admitting: int = 0

    def ticket(self) -> Ticket | None:
        """A slot, or None when `limit` connections are being admitted already."""
        if self.admitting >= self.limit:
            return None
        self.admitting += 1
        return Ticket(self)


@dataclass
class Ticket:
    admission: Admission
    held: bool = True
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)

    def done(self) -> None:
        """The connection is admitted (welcomed) or gone. Twice does nothing."""
        if self.held:
            self.held = False
            self.admission.admitting -= 1
            if self.timer is not None:
                self.timer.cancel()


class AdmissionMiddleware:
    """Outermost on the WebSocket route: a turned-away connection costs no session or database work."""

    def __init__(self, inner: Any, admission: Admission | None = None) -> None:
        self.inner = inner
        self.admission = admission or Admission(settings.SOCKET_ADMISSIONS)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        ticket = self.admission.ticket()
        if ticket is None:
            await turn_away(receive, send)
            return
        ticket.timer = asyncio.get_running_loop().call_later(ADMIT_SECONDS, ticket.done)
        try:
            await self.inner({**scope, "admission": ticket}, receive, send)
        finally:
            ticket.done()


async def turn_away(receive: Any, send: Any) -> None:
    """Accepted, then closed: a browser sees no close code (only 1006) for a refused handshake."""
    message = await receive()
    if message["type"] == "websocket.connect":
        await send({"type": "websocket.accept"})
        await send({"type": "websocket.close", "code": RETRY_LATER})


def admitted(scope: dict[str, Any]) -> None:
    """The consumer's welcome went out: its slot goes to the next connection."""
    ticket = scope.get("admission")
    if isinstance(ticket, Ticket):
        ticket.done()
