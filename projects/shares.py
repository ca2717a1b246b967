"""Fair share between running projects, as BOINC's resource shares: over a window, each running project gets
volunteer compute in proportion to its `resource_share` (set by staff, never by the project's researcher).

What is measured: the FLOPs of the work sent to volunteers (flops_per_sample x samples, the server's own
count, the same number that credits the result once it is valid), charged when an instance is sent, like
BOINC's "recent estimated credit". Charging at sending rather than at crediting keeps the work in flight in
the books: a scheduler that waited for credit would overshoot by every instance still being computed.

The window: each project's recent FLOPs decay exponentially with a half-life of
CROWDTRAIN["SHARE_HALF_LIFE_SECONDS"] (one row per project, ProjectUsage, updated by one statement at the end
of the sending transaction), so choosing a project reads one small row per running project and never scans
the history.

The choice: the running project with the least recent FLOPs per unit of share (furthest below its share)
first, then the next, and so on; the scheduler takes the first project in that order that has work to send,
so a project without work never holds the others up. A share of 0 gets work only when no other project has
any.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from django.conf import settings
from django.db import connection, transaction
from django.db.models import QuerySet
from django.utils import timezone

from projects.models import Project, ProjectUsage
from workers.models import Device
from workers.preferences import devices_allowing


def decayed(*, flops: float, since: datetime, now: datetime) -> float:
    """`flops` recorded at `since`, as they count at `now`."""
    age = max(0.0, (now - since).total_seconds())
    return flops * 0.5 ** (age / float(settings.CROWDTRAIN["SHARE_HALF_LIFE_SECONDS"]))


@dataclass(frozen=True)
class Order:
    """The running projects, furthest below their resource share first (`ids`), and their `shares`."""

    ids: list[int]
    shares: dict[int, int]

    def fraction(self, *, project_id: int, allows: Callable[[int], bool]) -> float | None:
        """The fraction of a device's time this order gives a project, of the running projects the device
        `allows` (its preferences): the project's share over theirs, as the order hands a device's requests
        to each in proportion to its share. A crowd round planned for whole devices that two projects
        shared ran twice its target_seconds. None (the whole device) when no other project it allows has a
        share, or when this one has none: it gets only what the others leave. Per device, where the order
        balances the whole fleet: a device only one project may use gives it more when the others lean on
        the devices they share."""
        own = self.shares.get(project_id, 0)
        total = sum(share for pk, share in self.shares.items() if share and allows(pk))
        return own / total if own and total > own else None


def shares_order() -> Order:
    """The running projects, furthest below their resource share first."""
    now = timezone.now()
    rows = list(
        Project.objects.filter(status=Project.Status.RUNNING).values_list(
            "pk", "resource_share", "usage__recent_flops", "usage__updated_at"
        )
    )
    ranked = [
        (
            share == 0,
            _per_share(flops=decayed(flops=flops or 0.0, since=at or now, now=now), share=share),
            -share,
            pk,
        )
        for pk, share, flops, at in rows
    ]
    return Order(ids=[pk for *_, pk in sorted(ranked)], shares={pk: share for pk, share, *_ in rows})


def device_fractions(*, project_id: int, devices: QuerySet[Device]) -> dict[int, float]:
    """{device id: Order.fraction} for each of `devices` (which allow the project) that gives the project
    less than all its time, in SQL (workers.preferences.devices_allowing) rather than from each device's
    preferences: a query per running project with a share, none when this project runs alone."""
    order = shares_order()
    if order.fraction(project_id=project_id, allows=lambda pk: True) is None:
        return {}
    shared = [pk for pk, share in order.shares.items() if share]
    allowing = {pk: _ids(devices_allowing(devices=devices, project_id=pk)) for pk in shared}
    fractions: dict[int, float] = {}
    for device_id in allowing[project_id]:
        allowed = {pk for pk in shared if device_id in allowing[pk]}
        if (share := order.fraction(project_id=project_id, allows=allowed.__contains__)) is not None:
            fractions[device_id] = share
    return fractions


def _ids(devices: QuerySet[Device]) -> set[int]:
    return set(devices.values_list("pk", flat=True))


def _per_share(*, flops: float, share: int) -> float:
    return flops / share if share else flops


# One statement: the row is locked only while it runs (and until the caller commits, which it does next),
# where SELECT ... FOR UPDATE then UPDATE held it through the rest of the sending transaction, so every
# volunteer's assignment queued behind the others' on this one hot row (issue 15).
_CHARGE = """
INSERT INTO {table} AS u (project_id, recent_flops, updated_at) VALUES (%(project)s, %(flops)s, %(now)s)
ON CONFLICT (project_id) DO UPDATE SET
    recent_flops = u.recent_flops
        * power(0.5, greatest(0, extract(epoch FROM EXCLUDED.updated_at - u.updated_at)) / %(half_life)s)
        + EXCLUDED.recent_flops,
    updated_at = greatest(u.updated_at, EXCLUDED.updated_at)
"""


def usage_charge(*, project_id: int, flops: int) -> None:
    """Count `flops` sent to volunteers for the project now. Inside the sending transaction (an assignment
    rolled back is not charged), as its last statement: the usage row stays locked until the commit."""
    now = timezone.now()
    if connection.vendor != "postgresql":
        # The embedded SQLite of `make run` has neither power() nor extract(): one process, no contention.
        _charge_locked(project_id=project_id, flops=flops, now=now)
        return
    with connection.cursor() as cursor:
        cursor.execute(
            _CHARGE.format(table=connection.ops.quote_name(ProjectUsage._meta.db_table)),
            {
                "project": project_id,
                "flops": float(flops),
                "now": now,
                "half_life": float(settings.CROWDTRAIN["SHARE_HALF_LIFE_SECONDS"]),
            },
        )


def _charge_locked(*, project_id: int, flops: int, now: datetime) -> None:
    with transaction.atomic():
        ProjectUsage.objects.bulk_create(
            [ProjectUsage(project_id=project_id, updated_at=now)], ignore_conflicts=True
        )
        usage = ProjectUsage.objects.select_for_update().get(project_id=project_id)
        usage.recent_flops = decayed(flops=usage.recent_flops, since=usage.updated_at, now=now) + flops
        usage.updated_at = max(usage.updated_at, now)
        usage.save(update_fields=["recent_flops", "updated_at"])


def usage_split() -> dict[int, float]:
    """{running project id: its fraction of all running projects' recent FLOPs} (for pages and tests)."""
    now = timezone.now()
    usages = ProjectUsage.objects.filter(project__status=Project.Status.RUNNING)
    recent = {u.project_id: decayed(flops=u.recent_flops, since=u.updated_at, now=now) for u in usages}
    total = sum(recent.values())
    return {pk: (flops / total if total else 0.0) for pk, flops in recent.items()}
