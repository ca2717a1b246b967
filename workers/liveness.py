"""Which devices are connected: stamped by their web process's heartbeat (workers/presence.py), disconnected
when their connection ends (cleanly or not), and swept by beat when their process died with them.

A consumer that daphne kills before its disconnect() runs (5,000 volunteers closing at once did that to
4,937 of them) left its device "connected" and its work units held until their deadline; here the
process's next flush disconnects it, and if the process itself died, the sweep does."""

from __future__ import annotations

import time
from collections import defaultdict
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


def devices_touch(*, device_ids: list[int], now: datetime) -> int:
    """The heartbeat: these devices' connections are alive."""
    return Device.objects.filter(pk__in=device_ids, disconnected_at__isnull=True).update(last_seen=now)


def devices_depart(*, left: dict[int, datetime]) -> int:
    """Connections that ended, by device and when: each device is disconnected as of then, unless it
    connected again since (a new connection's hello may come before the old one's departure is written),
    and serves no pipeline stage any more (projects/swarms.py)."""
    with transaction.atomic():
        devices = Device.objects.select_for_update(no_key=True).filter(
            pk__in=list(left), disconnected_at__isnull=True
        )
        gone = [device for device in devices.order_by("pk") if device.connected_at <= left[device.pk]]
        for device in gone:
            device.disconnect(now=left[device.pk])
        Device.objects.bulk_update(gone, ["online_ms", "disconnected_at"], batch_size=BATCH)
        stage_members_leave(device_ids=[device.pk for device in gone])
    return len(gone)


def devices_sweep(*, stale_seconds: int, now: datetime | None = None) -> int:
    """Connected devices not heard from for `stale_seconds` (their web process died, or daphne lost their
    consumer): disconnected as of their last heartbeat, and the work units they held released."""
    cutoff = (now or timezone.now()) - timedelta(seconds=stale_seconds)
    stale = Device.objects.filter(disconnected_at__isnull=True, last_seen__lt=cutoff).order_by("pk")
    last_seen = dict(stale.values_list("pk", "last_seen")[:SWEEP_BATCH])
    if not last_seen:
        return 0
    devices_depart(left=last_seen)
    if devices_release(device_ids=list(last_seen)):
        notify.work_available()
    return len(last_seen)


def devices_sweep_all(*, stale_seconds: int, budget_seconds: float) -> int:
    """Batch after batch (each short, in its own transaction) until no device is stale or the budget is
    spent: one batch a run left a dead web process's 50,000 devices "connected" for 50 runs (25 minutes)."""
    deadline = time.monotonic() + budget_seconds
    total = swept = devices_sweep(stale_seconds=stale_seconds)
    while swept == SWEEP_BATCH and time.monotonic() < deadline:
        swept = devices_sweep(stale_seconds=stale_seconds)
        total += swept
    return total


def devices_release(*, device_ids: list[int]) -> int:
    """The work units these devices hold, given back through the lifecycle (as a clean disconnect does)."""
    held: dict[int, list[int]] = defaultdict(list)
    in_progress = Result.objects.filter(device_id__in=device_ids, status=Result.Status.IN_PROGRESS)
    for user_id, work_unit_id in in_progress.values_list("volunteer_id", "work_unit_id"):
        held[user_id].append(work_unit_id)
    users = User.objects.in_bulk(list(held))
    return sum(results_release(user=users[pk], work_unit_ids=ids) for pk, ids in held.items())
