"""Teams' and devices' credit totals, the team on each ledger line, per-project credit rows (BOINC's
credit_user / credit_team), case-insensitive team names; then every total and recent average recomputed from
the ledger, in the order it was granted, as credit_grant would have kept them.

Lines granted before this migration get the volunteer's team of today: who was in which team when was not
recorded before."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import django.db.models.deletion
import django.db.models.functions.text
import django.utils.timezone
from django.db import migrations, models
from django.db.models import OuterRef, Subquery

from workers.credit import credit_from_flops, update_average


@dataclass
class _Sum:
    flops: int = 0
    results: int = 0
    avg: float = 0.0
    at: datetime | None = None
    since: datetime | None = None

    def add(self, *, flops: int, at: datetime) -> None:
        since = self.at.timestamp() if self.at else None
        self.avg = update_average(
            avg=self.avg, avg_time=since, credit=credit_from_flops(flops), now=at.timestamp()
        )
        self.flops, self.results, self.at = self.flops + flops, self.results + 1, max(at, self.at or at)
        self.since = self.since or at


def backfill(apps: Any, schema_editor: Any = None) -> None:
    """Every credit total and average from the ledger (one pass over it, a running sum per row)."""
    entry, volunteer = apps.get_model("workers", "CreditEntry"), apps.get_model("workers", "Volunteer")
    team_now = volunteer.objects.filter(pk=OuterRef("volunteer_id")).values("team_id")[:1]
    entry.objects.filter(team__isnull=True).update(team_id=Subquery(team_now))
    sums: dict[tuple[str, Any], _Sum] = defaultdict(_Sum)
    lines = entry.objects.order_by("created_at", "pk").values_list(
        "volunteer_id", "team_id", "project_id", "result__device_id", "flops", "created_at"
    )
    for volunteer_id, team_id, project_id, device_id, flops, at in lines.iterator(chunk_size=2000):
        keys = [
            ("volunteer", volunteer_id),
            ("device", device_id),
            ("volunteer_project", (volunteer_id, project_id)),
        ]
        if team_id is not None:
            keys += [("team", team_id), ("team_project", (team_id, project_id))]
        for key in keys:
            if key[1] is not None:
                sums[key].add(flops=flops, at=at)
    _store(apps, sums)


def _store(apps: Any, sums: dict[tuple[str, Any], _Sum]) -> None:
    for kind, model in (("volunteer", "Volunteer"), ("team", "Team"), ("device", "Device")):
        rows = apps.get_model("workers", model).objects
        for (of, pk), s in sums.items():
            if of == kind:
                rows.filter(pk=pk).update(total_flops=s.flops, expavg_credit=s.avg, expavg_time=s.at)
    apps.get_model("workers", "VolunteerProjectCredit").objects.bulk_create(
        apps.get_model("workers", "VolunteerProjectCredit")(
            volunteer_id=v,
            project_id=p,
            total_flops=s.flops,
            results=s.results,
            expavg_credit=s.avg,
            expavg_time=s.at,
            since=s.since,
        )
        for (of, (v, p)), s in ((k, s) for k, s in sums.items() if k[0] == "volunteer_project")
    )
    apps.get_model("workers", "TeamProjectCredit").objects.bulk_create(
        apps.get_model("workers", "TeamProjectCredit")(
            team_id=t, project_id=p, total_flops=s.flops, expavg_credit=s.avg, expavg_time=s.at
        )
        for (of, (t, p)), s in ((k, s) for k, s in sums.items() if k[0] == "team_project")
    )


class Migration(migrations.Migration):
    dependencies = [
        ("projects", "0011_storage_pruning_fair_share"),
        ("workers", "0007_computing_preferences"),
    ]

    operations = [
        migrations.CreateModel(
            name="TeamProjectCredit",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("total_flops", models.BigIntegerField(default=0)),
                ("expavg_credit", models.FloatField(default=0.0)),
                ("expavg_time", models.DateTimeField(blank=True, null=True)),
            ],
        ),
        migrations.CreateModel(
            name="VolunteerProjectCredit",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("total_flops", models.BigIntegerField(default=0)),
                ("results", models.PositiveIntegerField(default=0)),
                ("expavg_credit", models.FloatField(default=0.0)),
                ("expavg_time", models.DateTimeField(blank=True, null=True)),
                ("since", models.DateTimeField(default=django.utils.timezone.now)),
            ],
        ),
        migrations.AddField(
            model_name="creditentry",
            name="team",
            field=models.ForeignKey(
                blank=True,
                null=True,
                on_delete=django.db.models.deletion.SET_NULL,
                related_name="credit",
                to="workers.team",
            ),
        ),
        migrations.AddField(model_name="device", name="total_flops", field=models.BigIntegerField(default=0)),
        migrations.AddField(model_name="team", name="total_flops", field=models.BigIntegerField(default=0)),
        migrations.AddField(
            model_name="volunteer", name="team_joined_at", field=models.DateTimeField(blank=True, null=True)
        ),
        migrations.AddConstraint(
            model_name="team",
            constraint=models.UniqueConstraint(
                django.db.models.functions.text.Lower("name"), name="team_name_unique_ignoring_case"
            ),
        ),
        migrations.AddField(
            model_name="teamprojectcredit",
            name="project",
            field=models.ForeignKey(
                on_delete=django.db.models.deletion.CASCADE, related_name="team_credit", to="projects.project"
            ),
        ),
        migrations.AddField(
            model_name="teamprojectcredit",
            name="team",
            field=models.ForeignKey(
                on_delete=django.db.models.deletion.CASCADE, related_name="project_credit", to="workers.team"
            ),
        ),
        migrations.AddField(
            model_name="volunteerprojectcredit",
            name="project",
            field=models.ForeignKey(
                on_delete=django.db.models.deletion.CASCADE,
                related_name="volunteer_credit",
                to="projects.project",
            ),
        ),
        migrations.AddField(
            model_name="volunteerprojectcredit",
            name="volunteer",
            field=models.ForeignKey(
                on_delete=django.db.models.deletion.CASCADE,
                related_name="project_credit",
                to="workers.volunteer",
            ),
        ),
        migrations.AddConstraint(
            model_name="teamprojectcredit",
            constraint=models.UniqueConstraint(
                fields=("project", "team"), name="one_credit_row_per_team_project"
            ),
        ),
        migrations.AddConstraint(
            model_name="volunteerprojectcredit",
            constraint=models.UniqueConstraint(
                fields=("project", "volunteer"), name="one_credit_row_per_volunteer_project"
            ),
        ),
        migrations.RunPython(backfill, migrations.RunPython.noop),
    ]
