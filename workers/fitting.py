"""Work units that fit a device: the volunteer's largest work unit and daily download (computing preferences)
and the memory its browser reports. The scheduler (projects.lifecycle) asks here inside its transaction.

A work unit's download is what its browser fetches: the graph, the version's weights as sent and the whole
shard (browsers fetch a shard whole and keep it), less the blobs this device was sent since it connected,
which its browser has kept. Its memory is the model a few times over (weights, gradients, optimizer state, the
encoded update), the decoded shard and the activations of one mini-batch (engine.graph.activation_memory):
only this last part shrinks with fewer samples. Browsers report the memory of the whole device
(navigator.deviceMemory, rounded down, at most 8 GiB); one work unit may take MEMORY_SHARE of it."""

from __future__ import annotations

import functools
import math
from collections.abc import Collection
from dataclasses import dataclass

from django.db import connection
from django.utils import timezone

from engine.graph import activation_memory, load_graph
from projects import stages
from projects.datasets import work_unit_slices
from projects.models import Blob, WorkUnit
from workers.models import Device, DeviceDownload
from workers.preferences import MB, Preferences

MEMORY_SHARE = 0.25
MODEL_COPIES = 4
FLOAT_BYTES = 4


@dataclass(frozen=True)
class Limits:
    """What one work unit may be for a device now (None: no limit)."""

    work_unit_bytes: int | None = None  # its download, and its memory (the volunteer's preference)
    memory_bytes: int | None = None  # its memory (the device's)
    download_left: int | None = None  # its download (what is left of today's allowance)
    sent: frozenset[str] = frozenset()  # blobs the device already has
    # The device's row of today, locked by limits_for: download_record updates it without reading it again.
    today: DeviceDownload | None = None


@dataclass(frozen=True)
class Fit:
    samples: int  # how many of the work unit's samples fit; 0: none
    reason: str = ""  # why none: "download_limit" or "too_large"


def limits_for(
    *,
    device: Device | None,
    preferences: Preferences,
    memory_mb: float | None,
    today: DeviceDownload | None = None,
) -> Limits:
    """Locks the device's row of today (until the caller's transaction ends): two connections of one
    browser cannot both spend the last of its allowance. `today`: that row, if the caller locked it
    (todays_lock)."""
    memory = None if not memory_mb else int(memory_mb * MB * MEMORY_SHARE)
    if device is None:
        return Limits(work_unit_bytes=preferences.max_work_unit_bytes(), memory_bytes=memory)
    today = _locked_today(device=device, today=today)
    allowance = preferences.max_download_bytes()
    return Limits(
        work_unit_bytes=preferences.max_work_unit_bytes(),
        memory_bytes=memory,
        download_left=None if allowance is None else max(0, allowance - today.bytes),
        sent=frozenset(today.blobs),
        today=today,
    )


def fit(*, work_unit: WorkUnit, limits: Limits) -> Fit:
    """How many samples of `work_unit` (its project, version and shard with their blobs loaded) fit."""
    shards = [] if work_unit.stage_kind else _shard_blobs(work_unit)  # one query, read by both checks
    blobs = work_unit_blobs(work_unit, held=limits.sent, shards=shards)
    download = sum(size for sha, size in blobs.items() if sha not in limits.sent)
    if limits.download_left is not None and download > limits.download_left:
        return Fit(0, "download_limit")
    if limits.work_unit_bytes is not None and download > limits.work_unit_bytes:
        return Fit(0, "too_large")
    caps = [cap for cap in (limits.work_unit_bytes, limits.memory_bytes) if cap is not None]
    samples = _samples_within(work_unit=work_unit, shards=shards, cap=min(caps)) if caps else work_unit.count
    return Fit(samples, "" if samples else "too_large")


def work_unit_blobs(
    work_unit: WorkUnit, *, held: Collection[str] = (), shards: list[Blob] | None = None
) -> dict[str, int]:
    """{sha256: size} of what a browser downloads for `work_unit`, given the blobs it `held` (sent on its
    connection): weights it builds from the previous version's and a delta cost the delta's size.
    `shards`: its shard blobs (_shard_blobs), if the caller has them."""
    if work_unit.stage_kind:  # a pipeline stage unit: its stage's graph and weights, and its activations
        parts = (work_unit.stage_graph, work_unit.stage_weights, work_unit.input_blob, work_unit.grad_blob)
        return _sizes([work_unit.shard.blob, *(blob for blob in parts if blob is not None)])
    version = work_unit.version
    shards = _shard_blobs(work_unit) if shards is None else shards
    sizes = _sizes([work_unit.project.graph, version.wire_blob, *shards])
    if version.wire_delta is not None and version.wire_base in held:
        sizes[version.wire_blob.sha256] = version.wire_delta.size
    return sizes


def _shard_blobs(work_unit: WorkUnit) -> list[Blob]:
    """The shards a browser downloads whole for `work_unit`'s samples (several for a unit larger than what
    is left of its first shard)."""
    return [part.shard.blob for part in work_unit_slices(work_unit=work_unit)]


def _sizes(blobs: list[Blob]) -> dict[str, int]:
    return {blob.sha256: blob.size for blob in blobs}


def _samples_within(*, work_unit: WorkUnit, shards: list[Blob], cap: int) -> int:
    if work_unit.stage_kind:  # its micro-batch is fixed; its stage was cut to fit the device budget
        return work_unit.count if stages.unit_stage(work_unit=work_unit).memory.total <= cap else 0
    params, activations = model_memory(work_unit.project.graph)
    fixed = MODEL_COPIES * params + sum(_sizes(shards).values())  # each shard held once
    if fixed + activations > cap:
        return 0
    batch = work_unit.project.local_batch_size if work_unit.project.task == "local_steps" else math.inf
    fits = (cap - fixed) // activations if activations else math.inf
    return work_unit.count if fits >= min(batch, work_unit.count) else int(fits)


def model_memory(graph: Blob) -> tuple[int, int]:
    """(bytes of the parameters and buffers, bytes of activations per training sample) of a graph."""
    return _model_memory(graph.sha256)


@functools.lru_cache(maxsize=64)
def _model_memory(sha256: str) -> tuple[int, int]:
    # Keyed by content: a graph's bytes never change, so neither does its memory.
    graph = load_graph(Blob.objects.get(pk=sha256).read(), max_activation_bytes=None)
    tensors = [*graph.params, *graph.buffers]
    params = sum(math.prod(spec.shape) for spec in tensors) * FLOAT_BYTES
    return params, activation_memory(graph).train_bytes


def download_record(*, device: Device, work_unit: WorkUnit, today: DeviceDownload | None = None) -> None:
    """Count `work_unit`'s download against the device's day (inside the sending transaction). `today`: the
    device's row of today as limits_for locked it in this transaction (read again if not given)."""
    today = _locked_today(device=device, today=today)
    download_count(today=today, work_unit=work_unit)
    today.save(update_fields=DOWNLOAD_FIELDS)


DOWNLOAD_FIELDS = ["bytes", "work_units", "blobs"]


def download_count(*, today: DeviceDownload, work_unit: WorkUnit) -> None:
    """download_record without the write: a batch of sends writes its devices' rows once (DOWNLOAD_FIELDS)."""
    today.record(work_unit_blobs(work_unit, held=today.blobs))


def download_forget_sent(*, device_id: int) -> None:
    """A new connection: its browser may have a fresh page, without the blobs sent before (counted again)."""
    DeviceDownload.objects.filter(device_id=device_id, day=timezone.now().date()).update(blobs=[])


def download_today(*, device_id: int) -> int:
    """Bytes counted for the device today."""
    row = DeviceDownload.objects.filter(device_id=device_id, day=timezone.now().date()).first()
    return row.bytes if row else 0


# One statement whether the rows exist yet or not, and it locks them (a no-key update: `bytes` is no key)
# until the sending transaction ends, as the insert-then-SELECT FOR NO KEY UPDATE it replaces did in two
# round trips per device (every assignment makes one: issue 15).
_TODAY = (
    "INSERT INTO {table} AS t (device_id, day, bytes, work_units, blobs) VALUES {rows} "
    "ON CONFLICT (device_id, day) DO UPDATE SET bytes = t.bytes RETURNING *"
)


def todays_lock(*, device_ids: Collection[int]) -> dict[int, DeviceDownload]:
    """limits_for's row of today for several devices, in one statement on PostgreSQL: a batch of sends
    (lifecycle.work_units_offer). Locked in id order, as every batch locks them."""
    ids, day = sorted(set(device_ids)), timezone.now().date()
    if not ids:
        return {}
    if connection.vendor != "postgresql":
        # The embedded SQLite of `make run`: one process, the same queries whether the rows exist or not.
        new = [DeviceDownload(device_id=pk, day=day) for pk in ids]
        DeviceDownload.objects.bulk_create(new, ignore_conflicts=True)
        locked = DeviceDownload.objects.select_for_update(no_key=True).filter(device_id__in=ids, day=day)
        return {row.device_id: row for row in locked}
    table = connection.ops.quote_name(DeviceDownload._meta.db_table)
    sql = _TODAY.format(table=table, rows=", ".join(["(%s, %s, 0, 0, '[]')"] * len(ids)))
    rows = DeviceDownload.objects.raw(sql, [value for pk in ids for value in (pk, day)])
    return {row.device_id: row for row in rows}


def _today(*, device_id: int) -> DeviceDownload:
    return todays_lock(device_ids=[device_id])[device_id]


def _locked_today(*, device: Device, today: DeviceDownload | None) -> DeviceDownload:
    """`today` if it is the device's row the caller locked, else that row, locked now."""
    return today if today is not None and today.device_id == device.pk else _today(device_id=device.pk)
