"""How many WebSocket connections one web process admits at once, from the handshake to the welcome.

A reconnect storm's hellos (the session lookup, the throttle, the group adds, three database calls each) all
ran at once: daphne's one event loop competed for the GIL with their threads, pages waited 2-27 s (p99), and
handshakes timed out and were retried (5,000 reconnects took 24,193 attempts, issue 15). Past
SOCKET_ADMISSIONS being admitted, a connection is accepted and closed at once with 4503 (try again later),
before any session, Redis or database work: the browser comes back after its jittered back-off
(frontend/static/frontend/backoff.js; the attempt counts as a failure, as its welcome never came), and the
loop's queue stays short. A slot is held until the welcome or ADMIT_SECONDS, whichever comes first: a client
that never says hello cannot hold it for long. Nor can one address hold more than PER_ADDRESS of them: the
bound comes before any login or throttle, so otherwise a few dozen silent sockets from one host, opened
again every ADMIT_SECONDS, would turn every volunteer of the process away."""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings

from workers.protocol import CLOSE_RETRY_LATER

# RFC 6455's 1013 ("try again later") is not one an application may send through daphne (autobahn allows
# 1000 and 3000-4999 only): 4503, as HTTP's 503, in the protocol's own range (engine/spec.json).
RETRY_LATER = CLOSE_RETRY_LATER
ADMIT_SECONDS = 30.0
PER_ADDRESS = 4  # slots one client address may hold at once (its address as the connect throttle sees it)


@dataclass
class Admission:
    limit: int
    admitting: int = 0
    per_address: int = PER_ADDRESS
    by_address: Counter[str | None] = field(default_factory=Counter)

    def ticket(self, address: str | None = None) -> Ticket | None:
        """A slot, or None when `limit` connections are being admitted already, or `per_address` of
        `address`'s."""
        if self.admitting >= self.limit or self.by_address[address] >= self.per_address:
            return None
        self.admitting += 1
        self.by_address[address] += 1
        return Ticket(self, address)


@dataclass
class Ticket:
    admission: Admission
    address: str | None = None
    held: bool = True
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)

    def done(self) -> None:
        """The connection is admitted (welcomed) or gone. Twice does nothing."""
        if self.held:
            self.held = False
            self.admission.admitting -= 1
            self.admission.by_address -= Counter({self.address: 1})  # drops the address at zero
            if self.timer is not None:
                self.timer.cancel()


class AdmissionMiddleware:
    """Outermost on the WebSocket route: a turned-away connection costs no session or database work."""

    def __init__(self, inner: Any, admission: Admission | None = None) -> None:
        self.inner = inner
        self.admission = admission or Admission(settings.SOCKET_ADMISSIONS)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        ticket = self.admission.ticket((scope.get("client") or [None])[0])
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
