"""Celery tasks of the volunteers' side."""

from __future__ import annotations

from celery import shared_task
from django.conf import settings

from workers.liveness import devices_sweep_all
from workers.stats import stats_export


@shared_task(ignore_result=True)
def export_stats() -> dict[str, int]:
    """The daily statistics dumps (workers/stats.py); beat runs it (CELERY_BEAT_SCHEDULE)."""
    return stats_export()


@shared_task(ignore_result=True)
def sweep_devices() -> int:
    """Devices whose connection died uncleanly (workers/liveness.py); beat runs it every heartbeat, and it
    ends before the next run is due."""
    budget = settings.SOCKET_HEARTBEAT_SECONDS / 2
    return devices_sweep_all(stale_seconds=settings.SOCKET_STALE_SECONDS, budget_seconds=budget)
