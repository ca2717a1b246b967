"""Storage that does not grow forever (projects/storage.py), on PostgreSQL: no blob a row still references is
ever deleted, whatever kind of row, and what is released, pruned and collected is exactly what may be."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from django.contrib.auth.models import User
from django.core.management import CommandError, call_command
from django.db import close_old_connections, connection, models, transaction
from django.test import Client
from django.utils import timezone

from engine import codecs
from projects import storage
from projects.blobs import blob_put, blob_references
from projects.lifecycle import work_units_feed
from projects.models import Blob, DatasetShard, Metric, ModelVersion, Project, PrunedError, Result, WorkUnit
from projects.services import version_evaluate, version_publish, version_weights
from tests.integration.volunteer import assign, receive

pytestmark = pytest.mark.django_db(transaction=True)

KNOWN_REFERENCES = [
    (DatasetShard, "blob"),
    (ModelVersion, "optimizer_state"),
    (ModelVersion, "weights"),
    (ModelVersion, "wire_delta"),
    (ModelVersion, "wire_weights"),
    (Project, "graph"),
    (Result, "blob"),
    (WorkUnit, "grad_blob"),
    (WorkUnit, "input_blob"),
    (WorkUnit, "reference"),
    (WorkUnit, "stage_graph"),
    (WorkUnit, "stage_weights"),
]


WORK_UNIT_REFERENCES = ("grad_blob", "input_blob", "reference", "stage_graph", "stage_weights")


def old_blob(data: bytes) -> Blob:
    """A blob stored long before any grace period."""
    blob = blob_put(data=data)
    Blob.objects.filter(pk=blob.pk).update(stored_at=timezone.now() - timedelta(days=2))
    return Blob.objects.get(pk=blob.pk)


def collect() -> storage.Collected:
    return storage.blobs_collect_garbage(grace_seconds=0)


def exists(blob: Blob) -> bool:
    return Blob.objects.filter(pk=blob.pk).exists() and blob.path.is_file()


def test_the_references_are_every_foreign_key_to_blob() -> None:
    # A new kind of reference must be known to the report (storage.KINDS) and tested here.
    assert blob_references() == KNOWN_REFERENCES
    reported = {(model, name) for refs in storage.KINDS.values() for model, name, _ in refs}
    assert reported == set(KNOWN_REFERENCES)


def _rows(project: Project, volunteer: User) -> dict[tuple[type[models.Model], str], Any]:
    """One row of each kind that can reference a blob."""
    result = assign(volunteer)
    version = project.current_version()
    return {
        (DatasetShard, "blob"): DatasetShard.objects.filter(dataset=project.dataset).first(),
        (ModelVersion, "optimizer_state"): version,
        (ModelVersion, "weights"): version,
        (ModelVersion, "wire_weights"): version,
        (ModelVersion, "wire_delta"): version,
        (Project, "graph"): project,
        (Result, "blob"): result,
        **{(WorkUnit, name): result.work_unit for name in WORK_UNIT_REFERENCES},
    }


@pytest.mark.parametrize("reference", KNOWN_REFERENCES, ids=lambda r: f"{r[0].__name__}.{r[1]}")
def test_a_blob_referenced_by_one_row_of_any_kind_is_never_collected(
    reference: tuple[type[models.Model], str], mlp_project: Project, volunteer_user: User
) -> None:
    model, name = reference
    row = _rows(mlp_project, volunteer_user)[reference]
    original = getattr(row, name)
    original_bytes = original.read() if original else None
    blob = old_blob(f"only {model.__name__}.{name} refers to me".encode())
    model._default_manager.filter(pk=row.pk).update(**{name: blob})

    collect()
    assert exists(blob)  # referenced by that one row only, old, and the grace period is 0

    # The row's own blob went meanwhile if nothing else referred to it (rightly): store it again.
    restored = blob_put(data=original_bytes) if original_bytes is not None else None
    model._default_manager.filter(pk=row.pk).update(**{name: restored})
    assert collect().blobs >= 1
    assert not Blob.objects.filter(pk=blob.pk).exists() and not blob.path.exists()
    # Nothing else went: every blob still referenced has its row and its file.
    assert_every_referenced_blob_on_disk()


def assert_every_referenced_blob_on_disk() -> None:
    for model, name in blob_references():
        for sha in model._default_manager.exclude(**{f"{name}__isnull": True}).values_list(
            f"{name}_id", flat=True
        ):
            blob = Blob.objects.get(pk=sha)
            assert blob.path.is_file(), f"{model.__name__}.{name} -> {sha} lost its file"


def test_unreferenced_blobs_are_spared_during_the_grace_period(db: None) -> None:
    fresh = blob_put(data=b"stored a moment ago, its row not referenced yet")
    stale = old_blob(b"stored two days ago and never referenced")
    collected = storage.blobs_collect_garbage(grace_seconds=3600)
    assert exists(fresh) and not Blob.objects.filter(pk=stale.pk).exists() and not stale.path.exists()
    assert (collected.blobs, collected.bytes) == (1, stale.size)


def test_storing_the_same_bytes_again_restarts_the_grace_period(db: None) -> None:
    blob = old_blob(b"the same bytes, stored again")
    again = blob_put(data=b"the same bytes, stored again")
    assert again.pk == blob.pk and again.stored_at > blob.stored_at
    storage.blobs_collect_garbage(grace_seconds=3600)
    assert exists(blob)


def test_a_blob_stored_by_a_transaction_still_open_is_never_collected(mlp_project: Project) -> None:
    """The row blob_put upserted stays locked until its transaction commits: the collector skips it even
    with no grace period (and before the upsert commits it still sees the old stored_at), and the reference
    made in that transaction then finds its blob and file."""
    blob = old_blob(b"about to be referenced")
    stored, release = threading.Event(), threading.Event()

    def reference_it() -> None:
        try:
            with transaction.atomic():
                again = blob_put(data=b"about to be referenced")
                stored.set()
                release.wait(10)
                WorkUnit.objects.filter(project=mlp_project).update(reference=again)
        finally:
            connection.close()

    thread = threading.Thread(target=reference_it)
    thread.start()
    assert stored.wait(10)
    assert collect().blobs == 0
    release.set()
    thread.join(10)
    assert exists(blob) and WorkUnit.objects.filter(reference=blob).exists()
    assert collect().blobs == 0 and exists(blob)


def test_blob_put_waiting_on_the_collector_writes_the_file_again(
    monkeypatch: pytest.MonkeyPatch, mlp_project: Project
) -> None:
    """The other order: the collector locked an unreferenced blob and moved its file aside when blob_put of
    the same bytes comes. blob_put waits for the collector to commit, inserts the row anew and writes the
    file; the reference it makes then holds."""
    data = b"collected and stored again at the same moment"
    blob = old_blob(data)
    moved, errors = threading.Event(), []
    move_aside = storage._move_aside

    def slow_move_aside(path: Path) -> tuple[Path, Path]:
        aside = move_aside(path)
        moved.set()
        time.sleep(1.0)  # blob_put below reaches its upsert and waits on the row lock meanwhile
        return aside

    def store_and_reference() -> None:
        try:
            assert moved.wait(10)
            with transaction.atomic():
                again = blob_put(data=data)
                WorkUnit.objects.filter(project=mlp_project).update(reference=again)
        except Exception as exc:  # reported below, in the test's thread
            errors.append(exc)
        finally:
            connection.close()

    monkeypatch.setattr(storage, "_move_aside", slow_move_aside)
    thread = threading.Thread(target=store_and_reference)
    thread.start()
    assert collect().blobs == 1
    thread.join(20)
    close_old_connections()
    assert errors == []
    assert exists(blob) and blob.path.read_bytes() == data
    assert WorkUnit.objects.filter(reference=blob).exists()


def test_files_without_a_row_are_swept_after_the_grace_period(settings: Any, db: None) -> None:
    orphan = Path(settings.BLOB_ROOT) / "ab" / ("ab" + "0" * 62)
    orphan.parent.mkdir(parents=True, exist_ok=True)
    orphan.write_bytes(b"left by a transaction that rolled back")
    assert storage.blobs_collect_garbage(grace_seconds=3600).orphan_files == 0
    assert orphan.exists()
    # Younger than ORPHAN_FILE_AGE it stays, whatever the grace period: its row may not be committed yet.
    assert storage.blobs_collect_garbage(grace_seconds=0).orphan_files == 0
    old = time.time() - 7 * 3600
    os.utime(orphan, (old, old))
    assert storage.blobs_collect_garbage(grace_seconds=3600).orphan_files == 1
    assert not orphan.exists()


# --- released updates ------------------------------------------------------------------------------


def decided_round(project: Project, users: tuple[User, User]) -> list[Result]:
    """A complete round of two valid results, aggregated into version 1."""
    results = [assign(user) for user in users]
    for user, result in zip(users, results, strict=True):
        assert receive(user, result).status == "valid"
    assert project.current_version().number == 1
    return [Result.objects.get(pk=r.pk) for r in results]


def test_updates_of_decided_aggregated_work_units_are_released_and_collected(
    mlp_project: Project, volunteer_user: User, other_volunteer: User
) -> None:
    results = decided_round(mlp_project, (volunteer_user, other_volunteer))
    blobs = [r.blob for r in results]
    assert all(r.aggregated and r.blob is not None for r in results)
    assert storage.storage_release_decided() == 2
    for result, blob in zip(results, blobs, strict=True):
        result.refresh_from_db()
        assert result.blob is None and blob is not None and result.digest == blob.pk
    assert collect().blobs >= 2
    assert not any(Blob.objects.filter(pk=b.pk).exists() for b in blobs if b)
    assert_every_referenced_blob_on_disk()


def test_updates_still_needed_are_kept(
    mlp_project: Project, volunteer_user: User, other_volunteer: User
) -> None:
    Project.objects.filter(pk=mlp_project.pk).update(round_samples=10_000)  # no round closes
    work_units_feed(project_id=mlp_project.pk)
    waiting = assign(volunteer_user)  # decided and valid, waiting for its round to be aggregated
    assert receive(volunteer_user, waiting).status == "valid"
    judged = assign(volunteer_user)  # decided and aggregated, but another instance of it is still out
    assert receive(volunteer_user, judged).status == "valid"
    Result.objects.filter(pk=judged.pk).update(aggregated=True)
    out = Result.objects.create(
        work_unit=judged.work_unit, volunteer=other_volunteer, deadline=timezone.now()
    )
    pending = assign(other_volunteer)  # received, not judged yet
    Result.objects.filter(pk=pending.pk).update(status="received", blob=old_blob(b"an update"))

    assert storage.storage_release_decided() == 0
    assert Result.objects.filter(pk__in=[waiting.pk, judged.pk, pending.pk], blob__isnull=False).count() == 3
    Result.objects.filter(pk=out.pk).update(status=Result.Status.TIMED_OUT)
    assert storage.storage_release_decided() == 1
    assert Result.objects.get(pk=judged.pk).blob is None


def test_a_replay_is_caught_after_the_replayed_update_was_deleted(
    mlp_project: Project, volunteer_user: User, other_volunteer: User
) -> None:
    results = decided_round(mlp_project, (volunteer_user, other_volunteer))
    payload = results[0].blob.read() if results[0].blob else b""
    storage.storage_release_decided()
    collect()
    again = assign(volunteer_user)
    outcome = receive(volunteer_user, again, payload=payload)
    assert outcome.status == "invalid" and "replay" in outcome.reason


def test_stage_blobs_are_released_once_their_step_is_over_and_collected(
    researcher: User, digits_dataset: Any
) -> None:
    """Pipeline mode: activations, output gradients and stage weights stay while their step runs (a backward
    unit reads its forward unit's input), and are released and collected once the step is published."""
    from tests.integration.test_pipeline_mode import offer, pipeline_project, send, users

    project = pipeline_project(researcher, digits_dataset, micro_batches=2)  # the MLP in 3 stages
    (ann,) = users("ann")
    while project.current_version().number < 1:
        result = offer(ann)
        assert result is not None and send(ann, result).status == "valid"
    first = WorkUnit.objects.filter(version__number=0)
    held = {sha for name in storage.STAGE_BLOBS for sha in first.values_list(f"{name}_id", flat=True) if sha}
    activations = set(first.exclude(input_blob=None).values_list("input_blob_id", flat=True))
    assert len(activations) == 4 and first.exclude(grad_blob=None).count() == 4  # stages 1 and 2, M = 2
    next_step = set(WorkUnit.objects.filter(version__number=1).values_list("stage_weights_id", flat=True))

    assert storage.storage_release_decided() >= first.count()
    assert not first.exclude(**dict.fromkeys(storage.STAGE_BLOBS)).exists()
    assert not WorkUnit.objects.filter(version__number=1, stage_weights=None).exists()  # its step runs
    collect()
    gone = {sha for sha in held if not Blob.objects.filter(pk=sha).exists()}
    assert activations <= gone and not gone & next_step
    assert_every_referenced_blob_on_disk()


# --- pruned versions -------------------------------------------------------------------------------


def publish(project: Project, numbers: range, accuracy: Callable[[int], float | None]) -> None:
    weights = version_weights(version=project.current_version())
    for number in numbers:
        shifted = {k: v + number for k, v in weights.items()}
        version = version_publish(project=project, number=number, weights=shifted, momentum=shifted)
        value = accuracy(number)
        if value is not None:
            Metric.objects.create(project=project, version=version, name="test_accuracy", value=value)
            Metric.objects.create(project=project, version=version, name="test_loss", value=1 - value)


@pytest.fixture
def twelve_versions(mlp_project: Project, settings: Any) -> Iterator[Project]:
    """Versions 0-11, every one evaluated: accuracy peaks at version 7 (loss is lowest there too)."""
    settings.CROWDTRAIN = {**settings.CROWDTRAIN, "KEEP_EVERY_K_VERSIONS": 5, "EVAL_EVERY_VERSIONS": 1}
    Project.objects.filter(pk=mlp_project.pk).update(weights_codec="fp16")
    mlp_project.refresh_from_db()
    Metric.objects.create(
        project=mlp_project, version=mlp_project.current_version(), name="test_accuracy", value=0.1
    )
    Metric.objects.create(
        project=mlp_project, version=mlp_project.current_version(), name="test_loss", value=0.9
    )
    publish(mlp_project, range(1, 12), lambda n: 0.9 if n == 7 else 0.1 + n / 100)
    WorkUnit.objects.filter(project=mlp_project).delete()
    yield mlp_project


def weighted(project: Project) -> list[int]:
    return list(
        project.versions.filter(weights__isnull=False).order_by("number").values_list("number", flat=True)
    )


def test_old_versions_keep_weights_every_kth_the_best_and_the_latest(twelve_versions: Project) -> None:
    project = twelve_versions
    pruned = storage.versions_prune(project_id=project.pk)
    assert weighted(project) == [0, 5, 7, 10, 11] and pruned == 7
    version = project.versions.get(number=3)
    assert version.pruned_at is not None and version.wire_weights is None and version.optimizer_state is None
    assert version.metrics.count() == 2  # the row and its metrics stay
    with pytest.raises(PrunedError):
        version_weights(version=version)
    assert version_evaluate(version_id=version.pk)["test_accuracy"] == pytest.approx(0.13)
    # Their blobs go; the kept versions' stay, files included.
    assert collect().blobs > 0
    assert_every_referenced_blob_on_disk()
    for number in weighted(project):
        version_weights(version=project.versions.get(number=number))


def test_the_best_by_loss_when_the_target_metric_is_the_loss(twelve_versions: Project) -> None:
    Metric.objects.filter(version__project=twelve_versions, version__number=8, name="test_loss").update(
        value=0.0
    )
    Project.objects.filter(pk=twelve_versions.pk).update(target_metric="test_loss")
    storage.versions_prune()
    assert weighted(twelve_versions) == [0, 5, 8, 10, 11]


def test_versions_with_open_work_or_due_an_evaluation_keep_their_weights(twelve_versions: Project) -> None:
    project = twelve_versions
    three = project.versions.get(number=3)
    shard = DatasetShard.objects.filter(dataset=project.dataset).first()
    assert shard is not None
    WorkUnit.objects.create(project=project, version=three, shard=shard, offset=0, count=5)
    Metric.objects.filter(version__number=4, version__project=project).delete()  # due, not evaluated yet
    storage.versions_prune()
    assert weighted(project) == [0, 3, 4, 5, 7, 10, 11]


def test_a_pruned_checkpoint_is_a_404_that_says_which_versions_are_kept(twelve_versions: Project) -> None:
    Project.objects.filter(pk=twelve_versions.pk).update(status="running")
    storage.versions_prune()
    response = Client().get(f"/api/projects/{twelve_versions.pk}/checkpoint/?version=3")
    assert response.status_code == 404
    assert "pruned" in response.json()["detail"] and "[0, 5, 7, 10, 11]" in response.json()["detail"]
    assert Client().get(f"/api/projects/{twelve_versions.pk}/checkpoint/?version=best").status_code == 200


def test_the_checkpoint_of_every_kept_version_loads(twelve_versions: Project) -> None:
    storage.versions_prune()
    for number in weighted(twelve_versions):
        tensors = codecs.decode(twelve_versions.versions.get(number=number).weights_blob.read())[0]
        assert all(torch.isfinite(t).all() for t in tensors.values())


# --- the management command ------------------------------------------------------------------------


def test_the_storage_command_reports_by_kind_and_reclaims(
    twelve_versions: Project, capsys: pytest.CaptureFixture[str]
) -> None:
    old_blob(b"nobody refers to this one")
    call_command("storage")
    report = capsys.readouterr().out
    assert "weights" in report and "shards" in report and twelve_versions.name in report
    before = storage.storage_report()
    call_command("storage", "--reclaim", "--grace-seconds", "0")
    out = capsys.readouterr().out
    after = storage.storage_report()
    assert "pruned 7 versions" in out and "freed" in out
    assert after.disk_bytes < before.disk_bytes and after.unreferenced_bytes == 0
    assert after.totals["weights"] < before.totals["weights"]
    with pytest.raises(CommandError):
        call_command("storage", "--grace-seconds", "-1")
