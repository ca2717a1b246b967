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

from datetime import datetime

from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone

from projects.models import Project, ProjectUsage


def decayed(*, flops: float, since: datetime, now: datetime) -> float:
    """`flops` recorded at `since`, as they count at `now`."""
    age = max(0.0, (now - since).total_seconds())
    return flops * 0.5 ** (age / float(settings.CROWDTRAIN["SHARE_HALF_LIFE_SECONDS"]))


def shares_order() -> list[int]:
    """Ids of the running projects, furthest below their resource share first."""
    now = timezone.now()
    rows = Project.objects.filter(status=Project.Status.RUNNING).values_list(
        "pk", "resource_share", "usage__recent_flops", "usage__updated_at"
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
    return [pk for *_, pk in sorted(ranked)]


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
