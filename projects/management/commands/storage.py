"""`manage.py storage [--reclaim] [--grace-seconds N] [--json]`: what blob storage holds, by kind (weights,
results, references, shards, graphs) and per project, and with --reclaim what the beat task
(tasks.collect_storage) would reclaim, done now: updates of decided work units, old versions' weights
(every CROWDTRAIN["KEEP_EVERY_K_VERSIONS"]th, the best and the latest are kept) and unreferenced blobs."""

from __future__ import annotations

import json
from argparse import ArgumentParser
from dataclasses import asdict
from typing import Any

from django.core.management.base import BaseCommand, CommandError
from tqdm import tqdm

from projects.models import Project
from projects.storage import (
    KINDS,
    StorageReport,
    blobs_collect_garbage,
    storage_release_decided,
    storage_report,
)
from projects.storage import versions_prune as prune

MAX_GRACE_SECONDS = 10 * 365 * 86400


def human(size: int) -> str:
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:,.0f} {unit}" if unit == "B" else f"{value:,.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"  # unreachable: GiB returns above


class Command(BaseCommand):
    help = "Report blob storage by kind and project; --reclaim prunes and collects garbage now."

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("--reclaim", action="store_true", help="Release, prune and collect now.")
        parser.add_argument(
            "--grace-seconds",
            type=int,
            default=None,
            help="Collect unreferenced blobs last stored at least this long ago (default: the setting).",
        )
        parser.add_argument("--json", action="store_true", help="Print the report as JSON.")

    def handle(self, *args: Any, **options: Any) -> None:
        grace = options["grace_seconds"]
        if grace is not None and not 0 <= grace <= MAX_GRACE_SECONDS:
            raise CommandError(f"--grace-seconds must be between 0 and {MAX_GRACE_SECONDS}.")
        before = storage_report()
        if options["reclaim"]:
            self._reclaim(grace=grace)
        after = storage_report() if options["reclaim"] else before
        if options["json"]:
            self.stdout.write(json.dumps({"before": asdict(before), "after": asdict(after)}, indent=2))
            return
        self._print(after, title="after reclaiming" if options["reclaim"] else "now")
        if options["reclaim"]:
            freed = before.disk_bytes - after.disk_bytes
            self.stdout.write(
                f"freed {human(freed)} on disk ({human(before.disk_bytes)} -> {human(after.disk_bytes)})"
            )

    def _reclaim(self, *, grace: int | None) -> None:
        with tqdm(desc="releasing decided work units", unit="wu", disable=None) as bar:
            released = storage_release_decided(progress=bar.update)
        with tqdm(
            desc="pruning old versions", unit="project", total=Project.objects.count(), disable=None
        ) as bar:
            pruned = prune(progress=lambda _: bar.update(1))
        with tqdm(desc="collecting blobs", unit="blob", disable=None) as bar:
            collected = blobs_collect_garbage(grace_seconds=grace, progress=bar.update)
        self.stdout.write(
            f"released {released} work units' updates, pruned {pruned} versions, deleted {collected.blobs} "
            f"blobs ({human(collected.bytes)}) and {collected.orphan_files} orphan files "
            f"({human(collected.orphan_bytes)})"
        )

    def _print(self, report: StorageReport, *, title: str) -> None:
        names = dict(Project.objects.filter(pk__in=report.by_project).values_list("pk", "name"))
        kinds = list(KINDS)
        self.stdout.write(f"Blob storage ({title})")
        self.stdout.write(f"{'project':<32}" + "".join(f"{k:>14}" for k in kinds))
        for project_id, sizes in sorted(report.by_project.items()):
            label = f"{project_id} {names.get(project_id, '?')}"[:31]
            self.stdout.write(f"{label:<32}" + "".join(f"{human(sizes[k]):>14}" for k in kinds))
        self.stdout.write(
            f"{'all (distinct blobs)':<32}" + "".join(f"{human(report.totals[k]):>14}" for k in kinds)
        )
        self.stdout.write(
            f"unreferenced: {human(report.unreferenced_bytes)}; {report.blob_rows} blob rows; on disk: "
            f"{report.disk_files} files, {human(report.disk_bytes)}"
        )
