"""One web process's live volunteer connections: their channel-layer groups and devices, kept in step.

Group membership must not outlive a connection: every dead member of the `volunteers` group costs each
broadcast a write (19,371 of them made every one take 49 ms, issue 15). So:
- a connection that ends leaves synchronously here (`leave`, which no cancellation can cut half-way), and
  the process's loop removes departed members from Redis and disconnects their devices in batches, every
  FLUSH_SECONDS; daphne killing a consumer before its disconnect() ran no longer leaks anything;
- every SOCKET_HEARTBEAT_SECONDS the loop re-adds the live members (one pipelined ZADD per group) and stamps
  their devices' last_seen, so that the layer's group_expiry (SOCKET_STALE_SECONDS) drops the members of a
  process that died, and the beat sweep (workers/liveness.py) its devices;
- a process that exits removes its members (atexit), and one that starts drops members nobody refreshed
  (`groups_purge_stale`): a restart, even through Redis's snapshot, brings no dead member back.
The pipelined writes use channels-redis' own key and shard functions (`_group_key`, `consistent_hash`)."""

from __future__ import annotations

import asyncio
import atexit
import logging
import time
from collections import defaultdict
from collections.abc import Awaitable, Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import redis
from django.conf import settings
from django.utils import timezone

from config.db import database_sync_to_async
from workers.liveness import devices_depart, devices_touch

logger = logging.getLogger(__name__)
FLUSH_SECONDS = 1.0
CHUNK = 1000  # groups per pipeline
TOUCH_CHUNK = 10_000  # devices per heartbeat UPDATE
# Connections per heartbeat slice, and members per ZADD: the `volunteers` group's 50,000 in one command held
# daphne's loop ~100 ms while redis-py packed it (every page waited); slices take a few milliseconds each.
MEMBERS = 500


@dataclass
class Connection:
    groups: tuple[str, ...]
    device_id: int | None = None


@dataclass
class Departure:
    channel: str
    groups: tuple[str, ...]
    device_id: int | None
    at: datetime


class Presence:
    def __init__(self) -> None:
        self.live: dict[str, Connection] = {}
        self.departed: list[Departure] = []
        self.task: asyncio.Task[None] | None = None
        self.refreshed = time.monotonic()
        self.layer: Any = None

    async def join(self, layer: Any, channel: str, groups: Iterable[str]) -> None:
        """Registered first: if the consumer dies during the group_add, the flush still undoes it."""
        joining = self.live[channel] = Connection(tuple(groups))
        self._run(layer)
        for group in joining.groups:
            await layer.group_add(group, channel)
        if channel not in self.live:  # it left while these adds waited, maybe after its departure's flush
            await groups_discard(layer, {(group, channel) for group in joining.groups})

    async def group_join(self, layer: Any, channel: str, group: str) -> None:
        """A group a live connection joins later (and may leave again); it leaves it with the others."""
        connection = self.live.get(channel)
        if connection is None or group in connection.groups:
            return
        connection.groups += (group,)
        await layer.group_add(group, channel)
        if group not in self._groups(channel):  # it left the group, or ended, while the add waited
            await groups_discard(layer, {(group, channel)})

    async def group_leave(self, layer: Any, channel: str, group: str) -> None:
        connection = self.live.get(channel)
        if connection is None or group not in connection.groups:
            return
        connection.groups = tuple(g for g in connection.groups if g != group)
        await groups_discard(layer, {(group, channel)})

    def _groups(self, channel: str) -> tuple[str, ...]:
        connection = self.live.get(channel)
        return () if connection is None else connection.groups

    def device(self, channel: str, device_id: int) -> None:
        if channel in self.live:
            self.live[channel].device_id = device_id

    def leave(self, channel: str) -> None:
        """Synchronous: runs to the end even in a consumer being cancelled. Twice does nothing."""
        connection = self.live.pop(channel, None)
        if connection is not None:
            departure = Departure(channel, connection.groups, connection.device_id, timezone.now())
            self.departed.append(departure)

    def _run(self, layer: Any) -> None:
        if self.layer is None:
            atexit.register(self.exit)
        loop = asyncio.get_running_loop()
        if self.task is None or self.task.done() or self.task.get_loop() is not loop:
            self.layer = layer
            self.task = loop.create_task(self._loop(layer))

    async def _loop(self, layer: Any) -> None:
        while True:
            await asyncio.sleep(FLUSH_SECONDS)
            await self.flush(layer)
            if time.monotonic() - self.refreshed >= settings.SOCKET_HEARTBEAT_SECONDS:
                self.refreshed = time.monotonic()
                await _logged("refresh live connections", self.refresh(layer))

    async def flush(self, layer: Any) -> None:
        """Every departure so far, in one batch. A consumer's disconnect() awaits it (its departure may be
        in another's batch); if cancelled half-way, the loop redoes it (each step may run twice)."""
        gone, self.departed = self.departed, []
        if not gone:
            return
        try:
            pairs = {(group, d.channel) for d in gone for group in d.groups}
            await _logged("leave groups", groups_discard(layer, pairs))
            await _logged("disconnect devices", self._depart(gone))
        except asyncio.CancelledError:
            self.departed.extend(gone)
            raise

    async def _depart(self, gone: list[Departure]) -> None:
        still = {c.device_id for c in self.live.values()}  # the same browser in another tab stays connected
        left = [d for d in gone if d.device_id is not None and d.device_id not in still]
        for start in range(0, len(left), TOUCH_CHUNK):
            await database_sync_to_async(_devices_depart)(departures=left[start : start + TOUCH_CHUNK])

    async def refresh(self, layer: Any) -> None:
        """Slice after slice of the live connections: with 50,000 of them, gathering every group's members
        at once held daphne's loop ~200 ms (every page waited behind it)."""
        live, now = list(self.live.items()), time.time()
        for start in range(0, len(live), MEMBERS):
            members: dict[str, list[str]] = defaultdict(list)
            for channel, connection in live[start : start + MEMBERS]:
                for group in connection.groups:
                    members[group].append(channel)
            await groups_stamp(layer, members, now=now)
        greeted = [channel for channel, c in self.live.items() if c.device_id is not None]
        for start in range(0, len(greeted), TOUCH_CHUNK):  # PostgreSQL takes at most 65,535 parameters
            chunk = greeted[start : start + TOUCH_CHUNK]
            await database_sync_to_async(devices_touch)(connections=chunk, now=timezone.now())

    def exit(self) -> None:
        """At interpreter exit (daphne stopped): this process's members leave their groups."""
        if self.layer is None:
            return
        pairs = {(g, d.channel) for d in self.departed for g in d.groups}
        pairs |= {(g, channel) for channel, c in self.live.items() for g in c.groups}
        for index, chunk in _sharded(self.layer, pairs):
            client = redis.Redis.from_url(self.layer.hosts[index]["address"])
            with client.pipeline(transaction=False) as pipe:
                for group, channel in chunk:
                    pipe.zrem(self.layer._group_key(group), channel)
                pipe.execute()
        self.live, self.departed = {}, []


def _devices_depart(*, departures: list[Departure]) -> int:
    """Each device left by the connection that is still its current one (compared under its row lock)."""
    left: dict[int, datetime] = {}
    connections: dict[int, set[str]] = defaultdict(set)
    for d in departures:
        assert d.device_id is not None
        left[d.device_id] = max(d.at, left.get(d.device_id, d.at))
        connections[d.device_id].add(d.channel)
    return devices_depart(left=left, connections=connections)


async def _logged(what: str, step: Awaitable[None]) -> None:
    try:
        await step
    except Exception:
        logger.exception("presence: could not %s (group expiry and the device sweep will)", what)


def _sharded(layer: Any, items: Iterable[tuple[str, Any]]) -> Iterator[tuple[int, list[tuple[str, Any]]]]:
    """Items keyed by group, by the Redis shard that holds the group, in pipelines of at most CHUNK."""
    shards: dict[int, list[tuple[str, Any]]] = defaultdict(list)
    for item in items:
        shards[layer.consistent_hash(item[0])].append(item)
    for index, shard in shards.items():
        for start in range(0, len(shard), CHUNK):
            yield index, shard[start : start + CHUNK]


async def groups_discard(layer: Any, pairs: Iterable[tuple[str, str]]) -> None:
    for index, chunk in _sharded(layer, pairs):
        async with layer.connection(index).pipeline(transaction=False) as pipe:
            for group, channel in chunk:
                pipe.zrem(layer._group_key(group), channel)
            await pipe.execute()


async def groups_stamp(layer: Any, members: dict[str, list[str]], *, now: float) -> None:
    """Re-add live members with a fresh score (what group_add does), and keep their groups' keys alive."""
    for index, chunk in _sharded(layer, _sliced(members)):
        async with layer.connection(index).pipeline(transaction=False) as pipe:
            for group, channels in chunk:
                key = layer._group_key(group)
                pipe.zadd(key, dict.fromkeys(channels, now))
                pipe.expire(key, layer.group_expiry)
            await pipe.execute()


def _sliced(members: dict[str, list[str]]) -> Iterator[tuple[str, list[str]]]:
    for group, channels in members.items():
        for start in range(0, len(channels), MEMBERS):
            yield group, channels[start : start + MEMBERS]


def groups_purge_stale(layer: Any, *, older_than: float) -> int:
    """At a web process's start: members no live process refreshed for `older_than` seconds are dead."""
    removed = 0
    for host in layer.hosts:
        client = redis.Redis.from_url(host["address"])
        cutoff = time.time() - older_than
        for key in client.scan_iter(match=f"{layer.prefix}:group:*", count=1000):
            removed += int(client.zremrangebyscore(key, 0, cutoff))
    return removed


def groups_purge_at_start(layer: Any) -> None:
    """Members left by a process that died (kept through Redis's snapshot): live ones were re-added within
    two heartbeats by whichever web process holds them. Redis down: group expiry will do it later."""
    try:
        removed = groups_purge_stale(layer, older_than=2 * settings.SOCKET_HEARTBEAT_SECONDS)
    except (redis.RedisError, OSError):
        logger.warning("could not purge dead group members at start (Redis down?)")
        return
    if removed:
        logger.info("removed %d dead channel-layer group members left by an earlier process", removed)


PRESENCE = Presence()
