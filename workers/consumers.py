"""The volunteer WebSocket: parse frames, call services, send replies. No training logic lives here.

Whatever a client sends, the consumer answers and stays up: a frame that breaks the protocol gets an
`error`, and so does one that hits a bug (logged once). A crash would skip disconnect(), leaving work units
held, the device "connected" and a dead channel in the broadcast group."""

from __future__ import annotations

import asyncio
import json
import logging
import random
from collections.abc import Awaitable
from typing import Any

from asgiref.sync import sync_to_async
from autobahn.exception import Disconnected
from channels.consumer import get_handler_name
from channels.generic.websocket import AsyncWebsocketConsumer
from django.conf import settings
from django.utils import timezone
from redis.exceptions import RedisError

from config.admission import admitted
from config.db import database_sync_to_async
from projects import notify
from projects.lifecycle import (
    MAX_IN_FLIGHT,
    Arrival,
    OfferRequest,
    ResultError,
    result_refuse,
    results_release,
)
from workers import arrivals, limits, offers, protocol
from workers.models import Device
from workers.preferences import DEFAULTS, Preferences, preferences_effective
from workers.presence import PRESENCE
from workers.protocol import ProtocolError, ResultMeta
from workers.ring import RelayMeta, RingMixin
from workers.services import device_disconnect, device_hello, device_pause
from workers.signalling import SignallingMixin

logger = logging.getLogger(__name__)
UNAUTHENTICATED = protocol.CLOSE_UNAUTHENTICATED
THROTTLED = protocol.CLOSE_THROTTLED


class VolunteerConsumer(SignallingMixin, RingMixin, AsyncWebsocketConsumer):  # the peer ring: signal, relay
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.assigned: set[int] = set()  # work units this connection holds; released if it drops
        self.round_bound: set[int] = set()  # those of them that end with their round (units_end_with_round)
        # A result whose tensors arrive in the next binary frame, or a relayed ring payload (workers/ring.py).
        self.pending: ResultMeta | RelayMeta | None = None
        self.greeted = False
        self.waiting = False
        self.refused = False
        self.device: Device | None = None
        self.memory_mb: float | None = None  # the browser's (hello): it bounds the work units it gets
        self.preferences: Preferences = DEFAULTS  # the device's computing preferences, from hello on

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            # Also when daphne cancels an instance that outlived its socket before disconnect() ran: the
            # process's presence loop then takes its groups and device out (workers/presence.py).
            if hasattr(self, "channel_name"):
                PRESENCE.leave(self.channel_name)

    async def connect(self) -> None:
        self.user = self.scope.get("user")  # read by config.websocket_auth off daphne's thread
        if self.user is None or not self.user.is_authenticated:
            await self.close(code=UNAUTHENTICATED)
            return
        # Accepted before anything else: daphne gives a handshake 5 s, and in a storm of reconnects every
        # round trip done before accepting queued behind the others' (72% of 2,000 failed, issue 15).
        await self.accept()
        if not await self._connect_allowed():
            await self._refuse()
            return
        await PRESENCE.join(self.channel_layer, self.channel_name, self._groups())

    async def _connect_allowed(self) -> bool:
        address = (self.scope.get("client") or [None])[0]
        try:
            allowed: bool = await sync_to_async(limits.connect_allowed, thread_sensitive=False)(
                user_id=self.user.pk, address=address
            )
        except (RedisError, OSError):
            # Redis is down: the channel layer fails on its own; the throttle does not lock everyone out.
            logger.warning("connect throttle unavailable (Redis down?); letting %s in", address)
            return True
        return allowed

    async def _refuse(self) -> None:
        # After the accept (connect): a browser sees no close code (only 1006) for a refused handshake.
        self.refused = True
        message = "Too many connections in the last minute; wait a minute before reconnecting."
        await self.send_json(protocol.error_message("throttled", message))
        await self.close(code=THROTTLED)

    async def disconnect(self, code: int) -> None:
        """Every step is tried whatever became of the others; running twice does nothing the second time."""
        held = list(self.assigned)
        self.device, self.assigned, self.pending = None, set(), None
        # Groups and device are left in batches (workers/presence.py): when thousands close at once, each
        # doing its own round trips took longer than daphne waits, and it killed them half-way.
        PRESENCE.leave(self.channel_name)
        await PRESENCE.flush(self.channel_layer)
        if held:
            await self._attempt("release work units", self._release(held))

    async def _release(self, work_unit_ids: list[int]) -> None:
        released = await database_sync_to_async(results_release)(user=self.user, work_unit_ids=work_unit_ids)
        if released:
            await self.channel_layer.group_send(notify.WAITING_GROUP, {"type": "work.available"})

    async def _wait(self, *, waiting: bool) -> None:
        """In the waiting group while told `idle`: only those connections hear work.available."""
        if waiting != self.waiting:
            self.waiting = waiting
            change = PRESENCE.group_join if waiting else PRESENCE.group_leave
            await change(self.channel_layer, self.channel_name, notify.WAITING_GROUP)

    async def _condemn(self, work_unit_id: int, *, reason: str) -> None:
        await database_sync_to_async(result_refuse)(user=self.user, work_unit_id=work_unit_id, reason=reason)
        self.assigned.discard(work_unit_id)

    async def _attempt(self, what: str, step: Awaitable[None]) -> None:
        try:
            await step
        except Exception:
            logger.exception("volunteer %s: could not %s on disconnect", self.user.pk, what)

    async def dispatch(self, message: dict[str, Any]) -> None:
        """Channels' dispatch, without its close of stale database connections before every frame and event:
        it ran in the one thread daphne keeps for synchronous code, so every message of every connection
        queued through that thread (a broadcast to 3,000 volunteers: 3,000 hops in a row, with pages and
        hellos waiting behind them, issue 15). Every database call here closes its own connections, in the
        thread pool (config/db.py)."""
        handler = getattr(self, get_handler_name(message), None)
        if handler is None:
            raise ValueError(f"No handler for message type {message['type']}")
        await handler(message)

    def _groups(self) -> list[str]:
        return [notify.VOLUNTEERS_GROUP, notify.user_group(self.user.pk)]

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        if self.refused:
            return
        if not await self._guarded(self._handle(text_data, bytes_data)):
            self.pending = None  # whatever it announced is void: its tensors will not be stored

    async def _handle(self, text_data: str | None, bytes_data: bytes | None) -> None:
        if bytes_data is not None:
            await self.on_tensors(bytes_data)
            return
        try:
            message = protocol.parse_message(text_data or "")
        except ProtocolError as exc:
            if exc.work_unit is not None and exc.work_unit in self.assigned:
                await self._condemn(exc.work_unit, reason=f"the result message was refused: {exc}")
            raise
        if message.type != "hello" and not self.greeted:
            raise ProtocolError("protocol", "Say hello first.")
        await getattr(self, f"on_{message.type}")(message)

    async def _guarded(self, step: Awaitable[None]) -> bool:
        """Run one frame's (or event's) handling; any failure becomes an `error` reply, never a crash."""
        try:
            await step
        except ProtocolError as exc:
            await self.send_json(protocol.error_message(exc.code, str(exc), work_unit=exc.work_unit))
        except Exception:
            logger.exception("volunteer %s: unexpected error while handling a message", self.user.pk)
            message = "The server failed to handle that message (it is logged); carry on with the next one."
            await self.send_json(protocol.error_message("server_error", message))
            return False
        return True

    async def send_json(self, message: dict[str, Any]) -> None:
        try:
            await self.send(text_data=json.dumps(message))
        except Disconnected:
            # The client went away while we answered: nobody to tell, and disconnect() follows to clean up.
            logger.debug("volunteer %s left before a reply could be sent", self.user.pk)

    # --- client messages --------------------------------------------------------------------------

    async def on_hello(self, message: protocol.Hello) -> None:
        info = protocol.hello_device(message)
        previous = self.device
        hello = await database_sync_to_async(device_hello)(
            user=self.user,
            client_id=info.id,
            backend=info.backend,
            gflops=info.gflops or 0.0,
            user_agent=info.user_agent,
            connection=self.channel_name,  # a departure disconnects only the device's current connection
        )
        self.device, self.preferences = hello.device, hello.preferences
        if previous is not None and previous.pk != self.device.pk:  # a second hello, as another device
            await database_sync_to_async(device_disconnect)(
                device_id=previous.pk, connection=self.channel_name
            )
        PRESENCE.device(self.channel_name, self.device.pk)
        volunteer = self.device.volunteer
        self.memory_mb = info.memory_mb
        self.greeted = True
        await self.send_json(
            protocol.welcome_message(
                username=self.user.get_username(),
                credit_flops=volunteer.total_flops,
                recent_credit=volunteer.recent_credit(now=timezone.now()),
                preferences=self.preferences,
            )
        )
        admitted(self.scope)  # the next connection may be admitted (config/admission.py)

    async def _preferences(self) -> Preferences:
        assert self.device is not None
        preferences: Preferences = await database_sync_to_async(preferences_effective)(
            volunteer_id=self.device.volunteer_id, device_id=self.device.pk
        )
        return preferences

    async def on_ready(self, message: protocol.Ready | None = None) -> None:
        if len(self.assigned) >= MAX_IN_FLIGHT:
            raise ProtocolError("busy", f"Finish a work unit first: at most {MAX_IN_FLIGHT} at a time.")
        request = OfferRequest(
            user=self.user, preferences=self.preferences, device=self.device, memory_mb=self.memory_mb
        )
        offer = await offers.batcher().ask(request)
        if offer.result is None:
            await self._wait(waiting=True)
            await self.send_json(protocol.idle_message(offer.why))
            return
        await self._wait(waiting=False)
        self.assigned.add(offer.result.work_unit_id)  # first: if the reply fails, disconnect releases it
        unit = offer.result.work_unit
        self.round_bound &= self.assigned  # bounded by what it holds (units cancelled or released leave)
        if unit.project.units_end_with_round:
            self.round_bound.add(unit.pk)
        # A stage unit's peer ring fields (projects/ring.py) and the following shards of a unit that runs on
        # past its first (datasets.shard_slices) are read from the database.
        if unit.stage_kind or unit.spans_shards:
            assign = await database_sync_to_async(protocol.assign_message)(offer.result, why=offer.why)
        else:
            assign = protocol.assign_message(offer.result, why=offer.why)
        await self.send_json(assign)

    async def on_progress(self, message: protocol.Progress) -> None:
        """Heartbeats keep the connection alive; deadlines are enforced by the transitioner."""

    async def on_result(self, message: protocol.ResultMessage) -> None:
        if self.pending is not None:
            self.pending = None
            raise ProtocolError(
                "bad_message", "Send each result's binary frame before the next result: both are dropped."
            )
        self.pending = protocol.result_meta(message)

    async def on_release(self, message: protocol.Release) -> None:
        """The browser paused with work it had not started: someone else may do it meanwhile."""
        held = [pk for pk in message.work_units if pk in self.assigned]
        self.assigned.difference_update(held)
        if held:
            await self._release(held)

    async def on_pause(self, message: protocol.Pause) -> None:
        assert self.device is not None  # greeted
        await database_sync_to_async(device_pause)(
            device_id=self.device.pk, paused=message.paused, connection=self.channel_name
        )

    async def on_bye(self, message: protocol.Bye) -> None:
        await self.close()

    async def on_tensors(self, payload: bytes) -> None:
        meta = self._claim_pending(len(payload))
        if isinstance(meta, RelayMeta):
            try:
                await self.on_relayed(meta, payload)
            finally:
                limits.RESULT_BYTES.give_back(len(payload))
            return
        try:
            outcome = await arrivals.batcher().ask(
                Arrival(
                    user=self.user,
                    work_unit_id=meta.work_unit,
                    samples=meta.samples,
                    loss=meta.loss,
                    compute_ms=meta.compute_ms,
                    download_ms=meta.download_ms,
                    payload=payload,
                    model_version=meta.model_version,
                    sent_digest=meta.sent_digest,
                )
            )
        except ResultError as exc:
            raise ProtocolError(exc.code, str(exc), work_unit=meta.work_unit) from exc
        finally:
            limits.RESULT_BYTES.give_back(len(payload))
        self.assigned.discard(meta.work_unit)
        await self.send_json(protocol.ack_message(outcome))
        if meta.work_unit in self.round_bound and self.waiting and not self.assigned:
            # Its `ready` is parked, maybe refused only while this unit was computed (a round whose units end
            # with it sends a device one unit at a time: lifecycle._not_computing_its_round); the rest of the
            # round would be news to no one. Only then: after every result (throughput benchmark at 64, sync
            # units) it cost daphne 8.7 ms of CPU a unit against 7.9.
            await self.on_ready()

    def _claim_pending(self, size: int) -> ResultMeta | RelayMeta:
        """The result these bytes belong to, once they fit this server's limits (then held in the budget)."""
        meta, self.pending = self.pending, None
        if meta is None:
            raise ProtocolError("bad_message", "A binary frame must follow a result message.")
        work_unit = meta.work_unit if isinstance(meta, ResultMeta) else None
        if size > settings.CROWDTRAIN["MAX_RESULT_BYTES"]:
            raise ProtocolError(
                "too_large", "The update is larger than this server accepts.", work_unit=work_unit
            )
        if not limits.result_bytes_take(size):
            raise ProtocolError(
                "busy", "The server is busy with other uploads: retry later.", work_unit=work_unit
            )
        return meta

    # --- channel-layer events ---------------------------------------------------------------------

    async def work_available(self, event: dict[str, Any]) -> None:
        if self.waiting:
            # Every waiting connection hears this at once, in the same order; a little jitter shares the
            # new work out instead of always serving the same volunteers first.
            await asyncio.sleep(random.uniform(0, 0.05))
            if self.waiting and len(self.assigned) < MAX_IN_FLIGHT:
                await self._guarded(self.on_ready())

    async def preferences_changed(self, event: dict[str, Any]) -> None:
        """The volunteer saved preferences: this browser gets its set at once, and new work if it may now."""
        if self.device is not None:  # else not greeted yet: the welcome will carry them
            await self._guarded(self._apply_preferences())

    async def _apply_preferences(self) -> None:
        self.preferences = await self._preferences()
        await self.send_json(protocol.preferences_message(self.preferences))
        if self.waiting and len(self.assigned) < MAX_IN_FLIGHT:
            await self.on_ready()

    async def result_decided(self, event: dict[str, Any]) -> None:
        await self.send_json(protocol.credit_message(event))

    async def work_cancel(self, event: dict[str, Any]) -> None:
        cancelled = [pk for pk in event["work_units"] if pk in self.assigned]
        self.assigned.difference_update(cancelled)
        if cancelled:
            await self.send_json({"type": "cancel", "work_units": cancelled, "reason": event["reason"]})
