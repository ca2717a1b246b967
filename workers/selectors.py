"""Read-only queries over the credit ledger: totals, breakdowns, rates and the leaderboard."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db.models import Sum
from django.db.models.functions import TruncMinute
from django.utils import timezone

from workers.models import CreditEntry, Device


@dataclass(frozen=True)
class ProjectCredit:
    project_id: int
    name: str
    flops: int


@dataclass(frozen=True)
class VolunteerCredit:
    volunteer_id: int
    username: str
    flops: int


def credit_total() -> int:
    """All FLOPs ever granted: the sum of the ledger, not of the denormalised totals."""
    return int(CreditEntry.objects.aggregate(total=Sum("flops"))["total"] or 0)


def credit_volunteer_count() -> int:
    """How many volunteers have earned any credit."""
    return CreditEntry.objects.values("volunteer_id").distinct().count()


def credit_by_project() -> list[ProjectCredit]:
    rows = (
        CreditEntry.objects.values("project_id", "project__name")
        .annotate(total=Sum("flops"))
        .order_by("-total", "project__name")
    )
    return [ProjectCredit(row["project_id"], row["project__name"], int(row["total"])) for row in rows]


def credit_by_volunteer(*, limit: int = 50) -> list[VolunteerCredit]:
    rows = (
        CreditEntry.objects.values("volunteer_id", "volunteer__user__username")
        .annotate(total=Sum("flops"))
        .order_by("-total", "volunteer__user__username")[:limit]
    )
    return [
        VolunteerCredit(row["volunteer_id"], row["volunteer__user__username"], int(row["total"]))
        for row in rows
    ]


def credit_rate_series(*, minutes: int = 60) -> list[tuple[datetime, float]]:
    """FLOP/s per minute over the last `minutes` whole minutes (oldest first, empty minutes as 0)."""
    end = timezone.now().replace(second=0, microsecond=0) + timedelta(minutes=1)
    start = end - timedelta(minutes=minutes)
    rows = (
        CreditEntry.objects.filter(created_at__gte=start, created_at__lt=end)
        .annotate(minute=TruncMinute("created_at"))
        .values("minute")
        .annotate(total=Sum("flops"))
    )
    totals = {row["minute"]: int(row["total"]) for row in rows}
    buckets = [start + timedelta(minutes=i) for i in range(minutes)]
    return [(minute, totals.get(minute, 0) / 60.0) for minute in buckets]


def credit_since(*, volunteer_id: int, since: datetime) -> int:
    """FLOPs granted to a volunteer since `since` (the Contribute page's credit today)."""
    rows = CreditEntry.objects.filter(volunteer_id=volunteer_id, created_at__gte=since)
    return int(rows.aggregate(total=Sum("flops"))["total"] or 0)


def compute_share(*, hours: int = 24) -> float | None:
    """Share of connected time that volunteers' devices spent computing valid work (None: no devices).
    Devices are kept across reconnections, so recent ones are those seen lately, not created lately."""
    now = timezone.now()
    devices = Device.objects.filter(last_seen__gte=now - timedelta(hours=hours))
    connected = sum(device.connected_ms(now=now) for device in devices)
    return sum(device.compute_ms for device in devices) / connected if connected else None
