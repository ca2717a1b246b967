"""How many WebSocket connections one web process admits at once, from the handshake to the welcome.

A reconnect storm's hellos (the session lookup, the throttle, the group adds, three database calls each) all
ran at once: daphne's one event loop competed for the GIL with their threads, pages waited 2-27 s (p99), and
handshakes timed out and were retried (5,000 reconnects took 24,193 attempts, issue 15). Past
SOCKET_ADMISSIONS being admitted, a connection waits in line, in order of arrival, for up to
SOCKET_ADMISSION_WAIT_SECONDS (well inside daphne's 30 s handshake limit); one still waiting then, or one past
QUEUE_LIMIT waiting, is accepted and closed with 4503 (try again later), before any session, Redis or database
work: the browser comes back after its jittered back-off (frontend/static/frontend/backoff.js; the attempt
counts as a failure, as its welcome never came). Turning every connection past the bound away at once cost a
storm more than it saved: a turned-away attempt costs daphne a TCP and WebSocket handshake as an admitted one
does, 3 of 4 attempts were turned away, and each came back no sooner than 5 s later. A connection waiting
costs a file descriptor and a parsed request, no CPU. A slot is held until the welcome or ADMIT_SECONDS,
whichever comes first: a client that never says hello cannot hold it for long. Nor can one address hold more
than PER_ADDRESS of them: the bound comes before any login or throttle, so otherwise a few dozen silent
sockets from one host, opened again every ADMIT_SECONDS, would turn every volunteer of the process away."""

from __future__ import annotations

import asyncio
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings

from workers.protocol import CLOSE_RETRY_LATER

# RFC 6455's 1013 ("try again later") is not one an application may send through daphne (autobahn allows
# 1000 and 3000-4999 only): 4503, as HTTP's 503, in the protocol's own range (engine/spec.json).
RETRY_LATER = CLOSE_RETRY_LATER
ADMIT_SECONDS = 30.0
PER_ADDRESS = 4  # slots one client address may hold or wait for at once (as the connect throttle sees it)
QUEUE_LIMIT = 8192  # connections waiting for a slot at once; more are turned away at once


@dataclass
class Admission:
    limit: int
    admitting: int = 0
    per_address: int = PER_ADDRESS
    by_address: Counter[str | None] = field(default_factory=Counter)
    # Connections waiting for a slot, first come first served; one that gave up stays, done, until it is
    # at the head (removing it from the middle would cost O(n)).
    waiting: deque[asyncio.Future[None]] = field(default_factory=deque)

    def ticket(self, address: str | None = None) -> Ticket | None:
        """A slot now, or None when `limit` connections are being admitted already (or others wait for
        one), or `per_address` of `address`'s are."""
        if self.by_address[address] >= self.per_address or not self._free():
            return None
        self.admitting += 1
        return self._issue(address)

    async def wait_ticket(self, address: str | None, *, wait: float) -> Ticket | None:
        """A slot now, or after waiting in line for up to `wait` seconds; None if none came."""
        ticket = self.ticket(address)
        if ticket is not None or self.by_address[address] >= self.per_address:
            return ticket
        self.by_address[address] += 1  # waiting counts against its address too
        try:
            handed = len(self.waiting) < QUEUE_LIMIT and await self._wait_for_slot(wait)
        finally:
            self.forget(address)
        return self._issue(address) if handed else None

    def release(self) -> None:
        """A slot is free: it goes to the first connection still waiting, else back to the pool."""
        while self.waiting:
            slot = self.waiting.popleft()
            if not slot.done():
                slot.set_result(None)
                return
        self.admitting -= 1

    def forget(self, address: str | None) -> None:
        """One slot or place in line fewer for `address` (dropped at zero: O(1), not a Counter subtraction,
        which copies every address)."""
        self.by_address[address] -= 1
        if self.by_address[address] <= 0:
            del self.by_address[address]

    def _free(self) -> bool:
        while self.waiting and self.waiting[0].done():
            self.waiting.popleft()
        return self.admitting < self.limit and not self.waiting

    async def _wait_for_slot(self, wait: float) -> bool:
        """In line until a slot is handed over (True) or `wait` seconds pass (False)."""
        slot: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiting.append(slot)
        try:
            await asyncio.wait_for(asyncio.shield(slot), wait)
        except TimeoutError:
            pass
        except asyncio.CancelledError:  # gone while waiting: a slot handed over meanwhile is not lost
            if not slot.cancel():
                self.release()
            raise
        return not slot.cancel()  # cancel() is False once the slot was handed over

    def _issue(self, address: str | None) -> Ticket:
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
            self.admission.release()
            self.admission.forget(self.address)
            if self.timer is not None:
                self.timer.cancel()


class AdmissionMiddleware:
    """Outermost on the WebSocket route: a turned-away connection costs no session or database work."""

    def __init__(self, inner: Any, admission: Admission | None = None) -> None:
        self.inner = inner
        self.admission = admission or Admission(settings.SOCKET_ADMISSIONS)
        self.wait = settings.SOCKET_ADMISSION_WAIT_SECONDS

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        address = (scope.get("client") or [None])[0]
        ticket = await self.admission.wait_ticket(address, wait=self.wait)
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
