"""The volunteer WebSocket: parse frames, call services, send replies. No training logic lives here."""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

from channels.generic.websocket import AsyncWebsocketConsumer

from crowdtrain.db import database_sync_to_async
from projects import notify
from projects.lifecycle import (
    MAX_IN_FLIGHT,
    ResultError,
    result_receive,
    results_release,
    work_unit_assign,
)
from workers import protocol
from workers.models import Device
from workers.protocol import ProtocolError, ResultMeta
from workers.services import device_disconnect, device_register

UNAUTHENTICATED = 4401


class VolunteerConsumer(AsyncWebsocketConsumer):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.assigned: set[int] = set()  # work units this connection holds; released if it drops
        self.pending: ResultMeta | None = None  # a result whose tensors arrive in the next binary frame
        self.greeted = False
        self.waiting = False
        self.joined = False
        self.device: Device | None = None

    async def connect(self) -> None:
        self.user = self.scope.get("user")
        if self.user is None or not self.user.is_authenticated:
            await self.close(code=UNAUTHENTICATED)
            return
        for group in self._groups():
            await self.channel_layer.group_add(group, self.channel_name)
        self.joined = True
        await self.accept()

    async def disconnect(self, code: int) -> None:
        if not self.joined:
            return
        for group in self._groups():
            await self.channel_layer.group_discard(group, self.channel_name)
        if self.device is not None:
            await database_sync_to_async(device_disconnect)(device_id=self.device.pk)
        released = await database_sync_to_async(results_release)(
            user=self.user, work_unit_ids=list(self.assigned)
        )
        if released:
            await self.channel_layer.group_send(notify.VOLUNTEERS_GROUP, {"type": "work.available"})

    def _groups(self) -> list[str]:
        return [notify.VOLUNTEERS_GROUP, notify.user_group(self.user.pk)]

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        try:
            if bytes_data is not None:
                await self.on_tensors(bytes_data)
                return
            message = protocol.parse_message(text_data or "")
            if message["type"] != "hello" and not self.greeted:
                raise ProtocolError("protocol", "Say hello first.")
            await getattr(self, f"on_{message['type']}")(message)
        except ProtocolError as exc:
            await self.send_json(protocol.error_message(exc.code, str(exc)))

    async def send_json(self, message: dict[str, Any]) -> None:
        await self.send(text_data=json.dumps(message))

    # --- client messages --------------------------------------------------------------------------

    async def on_hello(self, message: dict[str, Any]) -> None:
        device = protocol.parse_hello(message)
        self.device = await database_sync_to_async(device_register)(user=self.user, device=device)
        volunteer = self.device.volunteer
        self.greeted = True
        await self.send_json(
            {
                "type": "welcome",
                "protocol": protocol.PROTOCOL_VERSION,
                "volunteer": {"username": self.user.get_username(), "credit_flops": volunteer.total_flops},
            }
        )

    async def on_ready(self, message: dict[str, Any]) -> None:
        if len(self.assigned) >= MAX_IN_FLIGHT:
            raise ProtocolError("busy", f"Finish a work unit first: at most {MAX_IN_FLIGHT} at a time.")
        result = await database_sync_to_async(work_unit_assign)(user=self.user, device=self.device)
        if result is None:
            self.waiting = True
            await self.send_json({"type": "idle"})
            return
        self.waiting = False
        self.assigned.add(result.work_unit_id)
        await self.send_json(protocol.assign_message(result))

    async def on_progress(self, message: dict[str, Any]) -> None:
        """Heartbeats keep the connection alive; deadlines are enforced by the transitioner."""

    async def on_result(self, message: dict[str, Any]) -> None:
        self.pending = protocol.parse_result(message)

    async def on_bye(self, message: dict[str, Any]) -> None:
        await self.close()

    async def on_tensors(self, payload: bytes) -> None:
        meta, self.pending = self.pending, None
        if meta is None:
            raise ProtocolError("bad_message", "A binary frame must follow a result message.")
        try:
            outcome = await database_sync_to_async(result_receive)(
                user=self.user,
                work_unit_id=meta.work_unit,
                samples=meta.samples,
                loss=meta.loss,
                compute_ms=meta.compute_ms,
                download_ms=meta.download_ms,
                payload=payload,
            )
        except ResultError as exc:
            raise ProtocolError(exc.code, str(exc)) from exc
        self.assigned.discard(meta.work_unit)
        await self.send_json(protocol.ack_message(outcome))

    # --- channel-layer events ---------------------------------------------------------------------

    async def work_available(self, event: dict[str, Any]) -> None:
        if self.waiting:
            # Every waiting connection hears this at once, in the same order; a little jitter shares the
            # new work out instead of always serving the same volunteers first.
            await asyncio.sleep(random.uniform(0, 0.05))
            if self.waiting and len(self.assigned) < MAX_IN_FLIGHT:
                await self.on_ready({})

    async def result_decided(self, event: dict[str, Any]) -> None:
        await self.send_json(protocol.credit_message(event))

    async def work_cancel(self, event: dict[str, Any]) -> None:
        cancelled = [pk for pk in event["work_units"] if pk in self.assigned]
        self.assigned.difference_update(cancelled)
        if cancelled:
            await self.send_json({"type": "cancel", "work_units": cancelled, "reason": event["reason"]})
