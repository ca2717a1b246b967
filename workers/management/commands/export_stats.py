"""`manage.py export_stats`: write the statistics dumps now (the beat task does it daily)."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand

from workers.stats import stats_export


class Command(BaseCommand):
    help = (
        "Write the BOINC-style statistics dumps (user.gz, team.gz, host.gz, tables.xml, JSON) to STATS_ROOT."
    )

    def handle(self, *args: Any, **options: Any) -> None:
        counts = stats_export()
        listed = ", ".join(f"{count} {name}s" for name, count in counts.items())
        self.stdout.write(f"Wrote {listed} to {settings.STATS_ROOT}")
