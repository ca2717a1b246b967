"""The volunteer consumer's side of the peer ring's relay (projects/ring.py; docs/protocol.md "Peer ring").

A consumer that did not get a payload from its peer sends `fetch`; the server has it already (the consumer
then reads its unit's URL), or asks the producer's device with `upload`, or, the producer being gone,
reopens the producer's unit. The producer answers `upload` with `relay` and the payload in the next binary
frame (held to the same size and in-flight limits as results), or `relay` with `missing`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from config.db import database_sync_to_async
from projects import notify
from projects.ring import ring_fetch, ring_relay_missing, ring_relay_store
from workers import protocol
from workers.models import Device
from workers.protocol import ProtocolError

UPLOAD_EVENT = notify.RING_UPLOAD_EVENT


@dataclass(frozen=True)
class RelayMeta:
    """A `relay` whose payload arrives in the next binary frame."""

    digest: str


class RingMixin:
    if TYPE_CHECKING:
        device: Device | None
        user: Any
        channel_layer: Any
        pending: Any

        async def send_json(self, message: dict[str, Any]) -> None: ...

        def _signal_take(self) -> None: ...

    async def on_fetch(self, message: protocol.Fetch) -> None:
        self._signal_take()  # one budget with `signal`: each costs a few queries
        fetch = database_sync_to_async(ring_fetch)
        outcome = await fetch(user_id=self.user.pk, work_unit_id=message.work_unit, what=message.what)
        if outcome.status == "refused":
            raise ProtocolError(
                "not_assigned", f"You hold no work unit {message.work_unit} that reads a payload by the ring."
            )
        if outcome.status == "ask":
            event = {"type": UPLOAD_EVENT, "to": outcome.device_id, "digest": outcome.digest}
            await self.channel_layer.group_send(notify.user_group(outcome.user_id), event)

    async def on_relay(self, message: protocol.Relay) -> None:
        if message.missing:
            await database_sync_to_async(ring_relay_missing)(user_id=self.user.pk, digest=message.digest)
            return
        if self.pending is not None:
            self.pending = None
            raise ProtocolError("bad_message", "Send each frame announced before the next: both are dropped.")
        self.pending = RelayMeta(digest=message.digest)

    async def on_relayed(self, meta: RelayMeta, payload: bytes) -> None:
        store = database_sync_to_async(ring_relay_store)
        if not await store(user_id=self.user.pk, digest=meta.digest, payload=payload):
            raise ProtocolError("unknown_work_unit", "No open work unit reads that payload from you.")

    async def ring_upload(self, event: dict[str, Any]) -> None:
        """Every connection of the producer's volunteer hears it; only the device it names answers."""
        if self.device is not None and self.device.pk == event["to"]:
            await self.send_json(protocol.upload_message(event["digest"]))
