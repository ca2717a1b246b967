"""WebRTC signalling for pipeline mode's peer ring (docs/pipeline.md "Peer ring", docs/protocol.md `signal`).

A volunteer's browser sends an SDP offer or answer or an ICE candidate for another device; the server
forwards it, stamped with the sender's device, to that device's connections when `signalling_allowed` says
the pair may talk (the devices of adjacent stages of one step). A data channel shows each browser the
other's network addresses, so who may signal whom is the server's decision, never the client's. Peers are
named by Device id; the message goes through the recipient volunteer's group (every connection joins it) and
only connections of the named device pass it on.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from config.db import database_sync_to_async
from projects import notify
from projects.ring import ring_adjacent
from workers import protocol
from workers.models import Device
from workers.protocol import ProtocolError

SIGNALS_PER_MINUTE = 240  # per connection: a link takes an offer, an answer and a few candidates each way
SIGNAL_EVENT = "signal.deliver"


@dataclass(frozen=True)
class Peer:
    device_id: int
    user_id: int


def signalling_allowed(sender: Peer, recipient: Peer) -> bool:
    """Whether `sender` may open a link to `recipient` (both connected): only two devices of adjacent stages
    of one step of a project with the ring on, one of them computing (projects/ring.ring_adjacent)."""
    if sender.device_id == recipient.device_id:
        return False
    return ring_adjacent(device_id=sender.device_id, other_id=recipient.device_id)


def signal_recipient(*, sender: Peer, device_id: int) -> Peer | None:
    """The connected device `device_id` when `sender` may signal it, else None (either way: nothing more is
    told about devices one may not signal)."""
    user_id = (
        Device.objects.filter(pk=device_id, disconnected_at__isnull=True, forgotten_at__isnull=True)
        .values_list("volunteer__user_id", flat=True)
        .first()
    )
    if user_id is None:
        return None
    recipient = Peer(device_id=device_id, user_id=user_id)
    return recipient if signalling_allowed(sender, recipient) else None


class SignallingMixin:
    """The volunteer consumer's side: `signal` from its client, and signals addressed to its device."""

    signal_window: float = float("-inf")
    signal_count: int = 0

    if TYPE_CHECKING:
        device: Device | None
        user: Any
        channel_layer: Any

        async def send_json(self, message: dict[str, Any]) -> None: ...

    async def on_signal(self, message: protocol.Signal) -> None:
        assert self.device is not None  # the consumer lets nothing but hello through before hello
        self._signal_take()
        sender = Peer(device_id=self.device.pk, user_id=self.user.pk)
        find = database_sync_to_async(signal_recipient)
        recipient = await find(sender=sender, device_id=message.to)
        if recipient is None:
            raise ProtocolError("unknown_peer", f"No connected device {message.to} that you may signal.")
        forwarded = protocol.signal_message(message, sender=sender.device_id)
        event = {"type": SIGNAL_EVENT, "to": recipient.device_id, "message": forwarded}
        await self.channel_layer.group_send(notify.user_group(recipient.user_id), event)

    def _signal_take(self) -> None:
        now = time.monotonic()
        if now - self.signal_window >= 60.0:
            self.signal_window, self.signal_count = now, 0
        if self.signal_count >= SIGNALS_PER_MINUTE:
            raise ProtocolError("busy", f"At most {SIGNALS_PER_MINUTE} signals a minute: wait a little.")
        self.signal_count += 1

    async def signal_deliver(self, event: dict[str, Any]) -> None:
        """The volunteer's other devices hear the event too; only the one it names passes it on."""
        if self.device is not None and self.device.pk == event["to"]:
            await self.send_json(event["message"])
