"""Storage that does not grow forever.

Three sweeps, run by a Celery beat task (tasks.collect_storage) and by `manage.py storage --reclaim`:

1. `storage_release_decided`: a work unit's updates (its results' blobs) and its server reference are
   released (their foreign keys set to NULL) once it is decided, no instance of it is still out or waiting
   for a verdict, and its canonical result was aggregated or never will be (a superseded round). A result
   keeps its update's SHA-256 in `digest`, so replays are still caught (validation._replayed). A pipeline
   stage unit's activation, output gradient, stage graph and stage weights are released once its step is
   over (its version superseded: a backward unit reads its forward unit's input until then) and no
   instance of it is out or awaiting a verdict.
2. `versions_prune`: a version's weights, optimizer state and wire weights are released, except for every
   Kth version (CROWDTRAIN["KEEP_EVERY_K_VERSIONS"]), the best by the project's target metric, the latest,
   versions that still have open work (async rounds), and versions due an evaluation that has not run yet.
   The row and its metrics stay, with `pruned_at` set.
3. `blobs_collect_garbage`: deletes the blobs no row references. Blobs are content-addressed, so one blob
   may be referenced by many rows of several kinds; the references are every foreign key to Blob found in
   the models (`blob_references`), never a guess from where a blob came from.

Why the collector never deletes a blob someone is about to reference:
- It only takes rows stored before its grace period (`Blob.stored_at`, CROWDTRAIN["BLOB_GC_GRACE_SECONDS"])
  and locks them FOR UPDATE SKIP LOCKED. blob_put upserts the row first, which refreshes `stored_at` and
  keeps the row locked until the caller's transaction commits, so a blob stored by a transaction still
  open is neither old nor lockable. The grace period also covers code that stores a blob in one
  transaction and references it in a later one.
- The database itself refuses a dangling reference: every foreign key to Blob is checked at commit (KEY
  SHARE on the blob's row). A transaction referencing an old blob without blob_put while the collector
  deletes it fails at commit, or the collector's DELETE fails at its commit; never both succeed.
- Files are moved aside (renamed within their directory) before the DELETE commits and unlinked only after
  it committed; if the commit fails they are moved back. blob_put, blocked on the row lock meanwhile,
  finds no file once the collector committed and writes it again. Content addressing makes every such
  write identical, so which one lands last never matters. (Blobs in a bucket: projects/blob_store.py.)
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path

from django.conf import settings
from django.db import models, transaction
from django.db.models import Exists, OuterRef, ProtectedError, Q, Subquery
from django.utils import timezone

from projects import blob_store
from projects.blobs import blob_references
from projects.models import Blob, DatasetShard, Metric, ModelVersion, Project, Result, WorkUnit
from projects.selectors import version_best

Progress = Callable[[int], None]  # told how many items each step handled (a tqdm bar's update)
DECIDED = (WorkUnit.Status.VALIDATED, WorkUnit.Status.CANCELLED, WorkUnit.Status.ERRORED)
# A version due an evaluation (every EVAL_EVERY_VERSIONS) keeps its weights until it is evaluated, or until
# this long after it was published (the evaluation task was lost): its metric may make it the best one.
EVALUATION_GRACE = timedelta(hours=1)
# The latest versions keep their weights: the newest one is trained on, and volunteers may still be
# downloading the one before for work the new version just cancelled.
KEEP_LATEST = 2
TRASH = blob_store.TRASH  # files moved aside by the collector: <sha>.gc-<random>
# A file whose row is not committed yet looks like an orphan (blob_put writes the file inside the caller's
# transaction): only files older than any transaction runs are swept, whatever the blobs' grace period.
ORPHAN_FILE_AGE = timedelta(hours=6)


def _setting(name: str) -> int:
    return int(settings.CROWDTRAIN[name])


# --- 1. updates and references of decided work units ----------------------------------------------


def storage_release_decided(*, batch: int = 500, progress: Progress | None = None) -> int:
    """Release the update and reference blobs of decided work units, and the stage blobs of stage units whose
    step is over, `batch` work units per transaction. Returns how many work units were released. Only rows
    still holding a blob are looked at (partial indexes), so the sweep costs what is left to release, not
    the history."""
    released = 0
    for holding, release in ((_holding_blobs, _release), (_holding_stage_blobs, _release_stage_blobs)):
        while ids := holding(batch=batch):
            done = release(work_unit_ids=ids)
            released += done
            if progress:
                progress(done)
            if done == 0 or len(ids) < batch:
                break
    return released


def _holding_blobs(*, batch: int) -> list[int]:
    results = Result.objects.filter(blob__isnull=False).values("work_unit_id")
    references = WorkUnit.objects.filter(reference__isnull=False).values("pk")
    candidates = WorkUnit.objects.filter(Q(pk__in=results) | Q(pk__in=references), status__in=DECIDED)
    return list(_releasable(candidates).order_by("pk").values_list("pk", flat=True)[:batch])


def _releasable(work_units: models.QuerySet[WorkUnit]) -> models.QuerySet[WorkUnit]:
    """Decided work units whose updates nobody reads again: no instance out or awaiting a verdict (a late
    replica is judged against the canonical update), and the canonical update aggregated or superseded (a
    synchronous round never aggregates an older version's results; async and overlapping rounds do)."""
    # Overlapping rounds fold units still in flight into a later round, as async does (training._round_units).
    overlapping = Q(
        project__overlap_rounds=True, project__crowd_rounds=True, project__mode=Project.Mode.AVERAGING
    )
    superseded = _superseded() & ~Q(project__mode=Project.Mode.ASYNC_SGD) & ~overlapping
    settled = Q(canonical_result__isnull=True) | Q(canonical_result__aggregated=True) | superseded
    return work_units.filter(settled, status__in=DECIDED).exclude(Exists(_busy()))


def _busy() -> models.QuerySet[Result]:
    """The work unit's instances still out or awaiting a verdict (correlated on the outer work unit)."""
    return Result.objects.filter(work_unit=OuterRef("pk")).filter(
        Q(status=Result.Status.IN_PROGRESS)
        | Q(status=Result.Status.RECEIVED, validation=Result.Validation.PENDING)
    )


def _superseded() -> Q:
    """The work unit's version is not its project's newest."""
    newest = ModelVersion.objects.filter(project=OuterRef("project")).order_by("-number").values("number")[:1]
    return Q(version__number__lt=Subquery(newest))


def _release(*, work_unit_ids: list[int]) -> int:
    with transaction.atomic():
        # Work units before their results, as lifecycle.py locks them; busy ones are skipped, not waited for.
        locked = WorkUnit.objects.select_for_update(skip_locked=True, no_key=True, of=("self",))
        ids = list(_releasable(locked.filter(pk__in=work_unit_ids)).values_list("pk", flat=True))
        Result.objects.filter(work_unit_id__in=ids, blob__isnull=False).update(blob=None)
        WorkUnit.objects.filter(pk__in=ids, reference__isnull=False).update(reference=None)
    return len(ids)


# A stage unit holds its stage weights (and graph) from its creation until these are released, all four
# together: `stage_weights` not null is the partial index's condition (WorkUnit.Meta, workunit_stage_blobs).
STAGE_BLOBS = ("input_blob", "grad_blob", "stage_graph", "stage_weights")


def _stage_releasable(work_units: models.QuerySet[WorkUnit]) -> models.QuerySet[WorkUnit]:
    return work_units.filter(_superseded(), status__in=DECIDED).exclude(Exists(_busy()))


def _holding_stage_blobs(*, batch: int) -> list[int]:
    holding = WorkUnit.objects.filter(stage_weights__isnull=False)
    return list(_stage_releasable(holding).order_by("pk").values_list("pk", flat=True)[:batch])


def _release_stage_blobs(*, work_unit_ids: list[int]) -> int:
    with transaction.atomic():
        locked = WorkUnit.objects.select_for_update(skip_locked=True, no_key=True, of=("self",))
        ids = list(_stage_releasable(locked.filter(pk__in=work_unit_ids)).values_list("pk", flat=True))
        WorkUnit.objects.filter(pk__in=ids).update(**dict.fromkeys(STAGE_BLOBS))
    return len(ids)


# --- 2. old versions' weights ---------------------------------------------------------------------


def versions_prune(*, project_id: int | None = None, progress: Progress | None = None) -> int:
    """Prune the weights of every project's versions but the kept ones (see the module's docstring).
    Returns how many versions were pruned."""
    projects = Project.objects.all() if project_id is None else Project.objects.filter(pk=project_id)
    pruned = 0
    for project in projects.only("pk", "target_metric"):
        done = _prune(project=project)
        pruned += done
        if progress:
            progress(done)
    return pruned


def versions_kept(*, project: Project) -> set[int]:
    """Ids of the versions whose weights stay whatever their age: every Kth, the best and the latest."""
    every = max(1, _setting("KEEP_EVERY_K_VERSIONS"))
    versions = ModelVersion.objects.filter(project=project)
    kept = set(versions.annotate(rest=models.F("number") % every).filter(rest=0).values_list("pk", flat=True))
    latest = set(versions.order_by("-number").values_list("pk", flat=True)[:KEEP_LATEST])
    best = version_best(project=project)
    return kept | latest | ({best.pk} if best is not None else set())


def _prune(*, project: Project) -> int:
    kept = versions_kept(project=project)
    open_work = WorkUnit.objects.filter(version=OuterRef("pk"), status=WorkUnit.Status.OPEN)
    every = max(1, _setting("EVAL_EVERY_VERSIONS"))
    due = Q(rest=0, created_at__gt=timezone.now() - EVALUATION_GRACE) & ~Exists(
        Metric.objects.filter(version=OuterRef("pk"))
    )
    with transaction.atomic():
        candidates = (
            ModelVersion.objects.select_for_update(skip_locked=True, no_key=True)
            .filter(project=project, pruned_at=None)
            .exclude(pk__in=kept)
            .annotate(rest=models.F("number") % every)
            .exclude(Exists(open_work))
            .exclude(due)
        )
        ids = list(candidates.values_list("pk", flat=True))
        return ModelVersion.objects.filter(pk__in=ids).update(
            weights=None, optimizer_state=None, wire_weights=None, wire_delta=None, pruned_at=timezone.now()
        )


# --- 3. blobs no row references -------------------------------------------------------------------


@dataclass
class Collected:
    blobs: int = 0
    bytes: int = 0
    orphan_files: int = 0
    orphan_bytes: int = 0


def blobs_unreferenced() -> models.QuerySet[Blob]:
    """Blobs no row refers to, through any foreign key to Blob in any model."""
    unreferenced = Blob.objects.all()
    for model, name in blob_references():
        unreferenced = unreferenced.exclude(Exists(model._default_manager.filter(**{name: OuterRef("pk")})))
    return unreferenced


def blobs_collect_garbage(
    *, grace_seconds: int | None = None, batch: int = 200, progress: Progress | None = None
) -> Collected:
    """Delete the blobs (rows and files) no row references and nobody stored within the grace period, then
    files with no row at all (left by transactions that rolled back after writing them). Race-safe against
    concurrent blob_put and references: see the module's docstring."""
    grace = timedelta(seconds=_setting("BLOB_GC_GRACE_SECONDS") if grace_seconds is None else grace_seconds)
    collected = Collected()
    while True:
        blobs, size = _collect_batch(before=timezone.now() - grace, batch=batch)
        collected.blobs, collected.bytes = collected.blobs + blobs, collected.bytes + size
        if progress:
            progress(blobs)
        if blobs < batch:
            break
    orphan_age = max(grace, ORPHAN_FILE_AGE)
    collected.orphan_files, collected.orphan_bytes = _sweep_orphan_files(before=timezone.now() - orphan_age)
    return collected


def _collect_batch(*, before: datetime, batch: int) -> tuple[int, int]:
    moved: list[Moved] = []
    try:
        with transaction.atomic():
            candidates = blobs_unreferenced().filter(stored_at__lt=before).order_by("stored_at")
            blobs = list(candidates.select_for_update(skip_locked=True)[:batch])
            moved = [Moved.aside(blob.sha256) for blob in blobs]
            # Django checks the PROTECT references once more, in a statement of its own: a reference that
            # committed after the query above began (which its snapshot missed) stops the batch here.
            Blob.objects.filter(pk__in=[blob.pk for blob in blobs]).delete()
    except ProtectedError:
        _restore(moved)
        return 0, 0  # the next sweep takes the others
    except BaseException:
        _restore(moved)
        raise
    for item in moved:
        item.discard()
    return len(blobs), sum(blob.size for blob in blobs)


@dataclass(frozen=True)
class Moved:
    """A collected blob's bytes, moved where no reader finds them until its row's DELETE commits: a file
    renamed in its directory, or an object copied aside in the bucket (projects/blob_store.py)."""

    sha256: str
    trash: str

    @classmethod
    def aside(cls, sha256: str) -> Moved:
        if blob_store.remote():
            return cls(sha256, blob_store.move_aside(sha=sha256))
        return cls(sha256, str(_move_aside(_blob_path(sha256))[1]))

    def restore(self) -> None:
        if blob_store.remote():
            blob_store.move_back(sha=self.sha256, trash=self.trash)
        else:
            _move_back(_blob_path(self.sha256), Path(self.trash))

    def discard(self) -> None:
        if blob_store.remote():
            blob_store.discard(trash=self.trash)
        else:
            Path(self.trash).unlink(missing_ok=True)


def _blob_path(sha256: str) -> Path:
    return Path(settings.BLOB_ROOT) / sha256[:2] / sha256


def _restore(moved: list[Moved]) -> None:
    for item in moved:
        item.restore()


def _move_aside(path: Path) -> tuple[Path, Path]:
    trash = path.with_name(f"{path.name}{TRASH}{uuid.uuid4().hex[:8]}")
    with contextlib.suppress(FileNotFoundError):
        os.replace(path, trash)
    return path, trash


def _move_back(path: Path, trash: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.replace(trash, path)  # the same bytes as any blob_put may have written meanwhile


def _sweep_orphan_files(*, before: datetime) -> tuple[int, int]:
    """Files under BLOB_ROOT older than `before` (ORPHAN_FILE_AGE at least) whose blob has no row: blob_put
    wrote them in a transaction that rolled back (a refused dataset, a failed project creation). blob_put
    touches an existing file, and a file found fresh once moved aside is moved back, so bytes being stored
    again are never swept."""
    if blob_store.remote():
        return blob_store.orphans_remove(before=before)
    cutoff = before.timestamp()
    files = [(p, stat) for p, stat in _blob_files() if stat.st_mtime < cutoff]
    known = set(Blob.objects.filter(pk__in=[p.name for p, _ in files]).values_list("pk", flat=True))
    count = size = 0
    for path, stat in files:
        if path.name not in known and _remove_if_stale(path, cutoff):
            count, size = count + 1, size + stat.st_size
    return count, size


def _remove_if_stale(path: Path, cutoff: float) -> bool:
    path, trash = _move_aside(path)
    if not trash.exists():
        return False
    if trash.stat().st_mtime >= cutoff or Blob.objects.filter(pk=path.name).exists():
        _move_back(path, trash)
        return False
    trash.unlink(missing_ok=True)
    return True


def _blob_files() -> list[tuple[Path, os.stat_result]]:
    """Blob files, and leftovers of an interrupted write or collection (named .tmp-* or *.gc-*)."""
    root = Path(settings.BLOB_ROOT)
    if not root.is_dir():
        return []
    leftover = (TRASH, ".tmp-")
    files = []
    for path in root.glob("??/*"):
        if len(path.name) == 64 or any(mark in path.name for mark in leftover):
            with contextlib.suppress(FileNotFoundError):  # collected meanwhile
                files.append((path, path.stat()))
    return files


# --- reporting ------------------------------------------------------------------------------------

KINDS: dict[str, tuple[tuple[type[models.Model], str, str], ...]] = {
    "weights": (
        (ModelVersion, "weights", "project_id"),
        (ModelVersion, "wire_weights", "project_id"),
        (ModelVersion, "wire_delta", "project_id"),
        (ModelVersion, "optimizer_state", "project_id"),
    ),
    "results": ((Result, "blob", "work_unit__project_id"),),
    "references": ((WorkUnit, "reference", "project_id"),),
    # Pipeline mode: stage graphs and weights per version, activations and their gradients per unit.
    "stages": tuple(
        (WorkUnit, name, "project_id") for name in ("input_blob", "grad_blob", "stage_graph", "stage_weights")
    ),
    "shards": ((DatasetShard, "blob", "dataset__projects__id"),),
    "graphs": ((Project, "graph", "id"),),
}


@dataclass
class StorageReport:
    """Bytes of distinct blobs by kind, overall and per project (a dataset's shards count for every project
    training on it), plus what no row references and what the files take on disk."""

    totals: dict[str, int] = field(default_factory=dict)
    by_project: dict[int, dict[str, int]] = field(default_factory=dict)
    unreferenced_bytes: int = 0
    blob_rows: int = 0
    disk_bytes: int = 0
    disk_files: int = 0


def storage_report() -> StorageReport:
    report = StorageReport()
    for kind, references in KINDS.items():
        pairs = _referenced(references)
        report.totals[kind] = sum(dict((sha, size) for _, sha, size in pairs).values())
        for project_id, _, size in set(pairs):
            if project_id is not None:
                per_kind = report.by_project.setdefault(project_id, dict.fromkeys(KINDS, 0))
                per_kind[kind] += size
    report.unreferenced_bytes = blobs_unreferenced().aggregate(n=models.Sum("size"))["n"] or 0
    report.blob_rows = Blob.objects.count()
    files = _blob_files()
    report.disk_files, report.disk_bytes = len(files), sum(stat.st_size for _, stat in files)
    return report


def _referenced(
    references: Iterable[tuple[type[models.Model], str, str]],
) -> list[tuple[int | None, str, int]]:
    """(project id, blob sha, size) for every distinct pair the references give."""
    pairs: set[tuple[int | None, str, int]] = set()
    for model, name, project in references:
        rows = model._default_manager.filter(**{f"{name}__isnull": False})
        pairs.update(rows.values_list(project, f"{name}_id", f"{name}__size").distinct())
    return list(pairs)
