"""Which devices are connected: stamped by their web process's heartbeat (workers/presence.py), disconnected
when their connection ends (cleanly or not), and swept by beat when their process died with them.

A consumer that daphne kills before its disconnect() runs (5,000 volunteers closing at once did that to
4,937 of them) left its device "connected" and its work units held until their deadline; here the
process's next flush disconnects it, and if the process itself died, the sweep does."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Collection, Mapping
from datetime import datetime, timedelta

from django.contrib.auth.models import User
from django.db import transaction
from django.utils import timezone

from projects import notify
from projects.lifecycle import results_release
from projects.models import Result
from projects.swarms import stage_members_leave
from workers.models import Device

SWEEP_BATCH = 1000  # devices per sweep: a backlog is worked off over the next runs, each one short
BATCH = 1000  # rows per UPDATE statement


def devices_touch(*, connections: list[str], now: datetime) -> int:
    """The heartbeat: these connections are alive, so their devices are connected. Keyed by connection, not
    device: a device whose current connection lives here but which a late departure or a lagging heartbeat
    let the sweep disconnect is connected again (as of now), instead of shown disconnected until its next
    hello. A device that has moved on to a newer connection elsewhere is that connection's process's."""
    current = Device.objects.filter(connection__in=connections)
    current.filter(disconnected_at__isnull=False).update(connected_at=now, disconnected_at=None)
    return current.update(last_seen=now)


def devices_depart(
    *, left: dict[int, datetime], connections: Mapping[int, Collection[str]] | None = None
) -> int:
    """Connections that ended, by device and when (and, given, which): each device is disconnected as of
    then, unless it connected again since (a new connection's hello may come before the old one's departure
    is noticed), and serves no pipeline stage any more (projects/swarms.py)."""
    return len(_devices_gone(left=left, connections=connections or {}))


def _devices_gone(
    *, left: dict[int, datetime], connections: Mapping[int, Collection[str]]
) -> dict[int, datetime]:
    with transaction.atomic():
        devices = Device.objects.select_for_update(no_key=True).filter(
            pk__in=list(left), disconnected_at__isnull=True
        )
        gone = [device for device in devices.order_by("pk") if _still_theirs(device, left, connections)]
        for device in gone:
            device.disconnect(now=left[device.pk])
        Device.objects.bulk_update(gone, ["online_ms", "disconnected_at"], batch_size=BATCH)
        stage_members_leave(device_ids=[device.pk for device in gone])
    return {device.pk: left[device.pk] for device in gone}


def _still_theirs(
    device: Device, left: dict[int, datetime], connections: Mapping[int, Collection[str]]
) -> bool:
    """Read under the row lock: the departed connection is still the device's current one."""
    if device.pk in connections and device.connection not in connections[device.pk]:
        return False
    return device.connected_at <= left[device.pk]


def devices_sweep(*, stale_seconds: int, now: datetime | None = None) -> int:
    """Connected devices not heard from for `stale_seconds` (their web process died, or daphne lost their
    consumer): disconnected as of their last heartbeat, and the work units they held released. One that said
    hello again between the read and the lock keeps its connection and the work it got."""
    cutoff = (now or timezone.now()) - timedelta(seconds=stale_seconds)
    stale = Device.objects.filter(disconnected_at__isnull=True, last_seen__lt=cutoff).order_by("pk")
    rows = list(stale.values_list("pk", "last_seen", "connection")[:SWEEP_BATCH])
    if not rows:
        return 0
    left, decided = {pk: seen for pk, seen, _ in rows}, timezone.now()
    gone = _devices_gone(left=left, connections={pk: {connection} for pk, _, connection in rows})
    if devices_release(device_ids=list(gone), sent_before=decided):
        notify.work_available()
    return len(rows)


def devices_sweep_all(*, stale_seconds: int, budget_seconds: float) -> int:
    """Batch after batch (each short, in its own transaction) until no device is stale or the budget is
    spent: one batch a run left a dead web process's 50,000 devices "connected" for 50 runs (25 minutes)."""
    deadline = time.monotonic() + budget_seconds
    total = swept = devices_sweep(stale_seconds=stale_seconds)
    while swept == SWEEP_BATCH and time.monotonic() < deadline:
        swept = devices_sweep(stale_seconds=stale_seconds)
        total += swept
    return total


def devices_release(*, device_ids: list[int], sent_before: datetime) -> int:
    """The work units these devices were sent before they were found gone, given back through the lifecycle
    (as a clean disconnect does); any sent since went to a newer connection of theirs and stay with it."""
    held: dict[int, list[int]] = defaultdict(list)
    in_progress = Result.objects.filter(
        device_id__in=device_ids, status=Result.Status.IN_PROGRESS, sent_at__lte=sent_before
    )
    for user_id, work_unit_id in in_progress.values_list("volunteer_id", "work_unit_id"):
        held[user_id].append(work_unit_id)
    users = User.objects.in_bulk(list(held))
    return sum(results_release(user=users[pk], work_unit_ids=ids) for pk, ids in held.items())
