"""Pipeline mode's stage units (issue 14; docs/pipeline.md): partitions, feeding and readiness, FLOPs.

A project in mode `pipeline` is cut into stages (engine/partition.py) under its per-device memory budget.
A step on version v is `micro_batches` micro-batches of `batch_size` samples each; micro-batch m of stage
k is a forward unit (k < S-1) and a backward unit. A unit exists only once its inputs do, so whatever is
open is ready: the feeder creates forward(0, m) (backward(0, m) for a one-stage model); a validated
forward(k, m) creates forward(k+1, m), or backward(S-1, m) after the last forward; a validated
backward(k, m) creates backward(k-1, m). The activation into a stage and the gradient of its output are
immutable blobs in the project's activation codec referenced by the unit (WorkUnit.input_blob and
grad_blob), so the blob collector keeps them while the unit exists. Every unit of micro-batch m carries its
loss scale (engine/pipeline.loss_scales): the last stage scales its loss by it, so the gradients summed
over micro-batches are the whole batch's. Judging results and the step are in pipeline.py.

A backward result's payload is the gradient of the stage input (an activation blob, kind "gradient"; empty
for a stage whose input needs none) and the stage's parameter gradients (engine/codecs.py), framed as an
8-byte little-endian length of the first part followed by both parts (docs/protocol.md).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache

import torch
from django.conf import settings
from django.db import transaction
from torch import Tensor

from engine import codecs
from engine.graph import Graph, graph_to_json, load_graph
from engine.partition import MAX_STAGES, MemoryModel, Partition, PartitionError, Stage, partition
from engine.pipeline import StageUnitError, loss_scales, stage_weights
from projects import notify
from projects.blobs import blob_put
from projects.datasets import shard_load
from projects.models import Blob, DatasetShard, ModelVersion, Project, Result, WorkUnit

Tensors = dict[str, Tensor]
FORWARD, BACKWARD = "forward", "backward"
# What a step's units are cut, sized and encoded by: changed mid-step, its units would no longer match their
# stages (pipeline_settings_check).
PARTITION_SETTINGS = (
    "mode",
    "batch_size",
    "device_memory_mb",
    "pipeline_stages",
    "micro_batches",
    "activation_codec",
)
LENGTH = struct.Struct("<Q")
PARTITIONS_KEPT = 16
# A step waits for every one of its units, so a stage unit is not given up after a few failed instances as a
# data-parallel slice is (its samples fed anew): its inputs are the server's own, validated, so its failures
# are volunteers', and it is sent again until one computes it.
STAGE_UNIT_LIMITS = {"max_error_results": 1000, "max_total_results": 2000}
PartitionKey = tuple[str, int, int, MemoryModel, int]  # graph, activation cap, stages, memory, micro-batches
_partitions: dict[PartitionKey, Partition] = {}
_stage_blob_ids: dict[tuple[PartitionKey, str, int], tuple[str, str]] = {}


class PipelineError(ValueError):
    """A project's model cannot be trained as configured; the message is shown to the researcher."""


def stage_graph(*, project: Project) -> Graph:
    """The project's whole graph (as services.project_graph, which lives a layer above)."""
    return _graph(sha256=project.graph_id, max_activation_bytes=project.max_activation_bytes)


@lru_cache(maxsize=16)
def _graph(*, sha256: str, max_activation_bytes: int) -> Graph:
    return load_graph(Blob.objects.get(pk=sha256).read(), max_activation_bytes=max_activation_bytes)


# --- partitions and memory ------------------------------------------------------------------------


def project_partition(*, project: Project) -> Partition:
    """The project's stages: `pipeline_stages` of them, or the fewest that fit its per-device budget, cut
    where a step of its `micro_batches` is shortest (engine.partition.partition). Cached by everything it
    depends on: graphs are immutable, settings change only the key."""
    key = _partition_key(project=project)
    if key not in _partitions:
        if len(_partitions) >= PARTITIONS_KEPT:
            _partitions.pop(next(iter(_partitions)))
        _partitions[key] = _partition(
            graph=stage_graph(project=project),
            stages=project.pipeline_stages,
            memory=key[3],
            micro_batches=key[4],
        )
    return _partitions[key]


def _partition_key(*, project: Project) -> PartitionKey:
    memory = _memory_model(project=project, optimizer_slots=0)
    return (
        project.graph_id,
        project.max_activation_bytes,
        project.pipeline_stages,
        memory,
        project.micro_batches,
    )


def _partition(*, graph: Graph, stages: int, memory: MemoryModel, micro_batches: int) -> Partition:
    """The fastest GPipe step of `micro_batches` decides the cuts: which ones are fastest depends on M
    (fill and drain weigh less as M grows), so volunteers' credit checks recompute it with the same M."""
    if stages:
        return partition(graph, stages, memory, micro_batches=micro_batches)
    for count in range(1, MAX_STAGES):
        try:
            return partition(graph, count, memory, micro_batches=micro_batches)
        except PartitionError:
            continue
    return partition(graph, MAX_STAGES, memory, micro_batches=micro_batches)  # raises, saying what would fit


def _memory_model(*, project: Project, optimizer_slots: int) -> MemoryModel:
    budget = project.device_memory_mb * 2**20 if project.device_memory_mb else None
    return MemoryModel(budget_bytes=budget, micro_batch=project.batch_size, optimizer_slots=optimizer_slots)


def project_memory_check(*, project: Project) -> None:
    """Data-parallel modes need the whole model on one device; pipeline mode needs a partition that fits.
    Raises PipelineError saying why not (and, for data-parallel modes, that pipeline mode would)."""
    if project.is_pipeline:
        try:
            project_partition(project=project)
        except PartitionError as exc:
            raise PipelineError(f"Pipeline mode cannot cut this model as asked: {exc}") from None
        return
    if project.device_memory_mb is None:
        return
    slots = 1 if project.mode == Project.Mode.AVERAGING else 0  # local momentum lives on the device
    whole = _partition_or_none(project=project, slots=slots)
    if whole is None:
        raise PipelineError(
            f"The model does not fit the per-device memory budget of {project.device_memory_mb} MiB in "
            f"{project.get_mode_display()} mode, where every volunteer holds the whole model. Choose the "
            "pipeline mode: it cuts the model into stages that each fit one device."
        )


def pipeline_settings_check(*, project: Project, changes: Mapping[str, object]) -> None:
    """Refuse to change what a running pipeline project's steps are cut by (PipelineError, saying to pause
    first). While paused the change is allowed: the step the pause interrupted starts over under the new
    settings when the project runs again (step_feed), so a step never mixes two partitions."""
    stored = Project.objects.filter(pk=project.pk).first()  # as saved: `project` may hold the changes
    if stored is None or not stored.is_running:
        return
    pipeline = Project.Mode.PIPELINE
    if stored.mode != pipeline and changes.get("mode", stored.mode) != pipeline:
        return
    changed = [
        name for name in PARTITION_SETTINGS if name in changes and changes[name] != getattr(stored, name)
    ]
    if changed:
        raise PipelineError(
            f"{', '.join(changed)} cannot change while the project runs: its current step was cut into "
            "stages with the present settings. Pause the project, change them and start it again; the "
            "interrupted step then starts over under the new settings."
        )


def _partition_or_none(*, project: Project, slots: int) -> Partition | None:
    graph = stage_graph(project=project)
    try:
        return partition(graph, 1, _memory_model(project=project, optimizer_slots=slots))
    except PartitionError:
        return None


# --- feeding and successors -----------------------------------------------------------------------


def step_feed(*, project: Project, version: ModelVersion) -> int:
    """Create the first unit of each micro-batch of the step on `version` (once); the caller holds the
    project's row and saves its data cursor. Returns how many units were created. A step a pause
    interrupted (it cancelled the open units) starts over: its other units are cancelled too, and fresh ones
    fed under the settings now in force (pipeline_settings_check)."""
    step = WorkUnit.objects.filter(version=version).exclude(stage_kind="")
    live = step.exclude(status=WorkUnit.Status.CANCELLED)
    if live.exists():
        if not step.filter(status=WorkUnit.Status.CANCELLED).exists():
            return 0
        # Units validated before the pause stay credited, never aggregated; a stray instance is late.
        out = Result.objects.filter(work_unit__in=live, status=Result.Status.IN_PROGRESS)
        out.update(status=Result.Status.CANCELLED, reason="the step started over")
        live.update(status=WorkUnit.Status.CANCELLED)
    slices = [_next_slice(project=project) for _ in range(project.micro_batches)]
    scales = _scales(project=project, version=version, slices=slices)
    last = len(project_partition(project=project).stages) == 1
    for m, ((shard, offset, count), scale) in enumerate(zip(slices, scales, strict=True)):
        WorkUnit.objects.create(
            project=project,
            version=version,
            shard=shard,
            offset=offset,
            count=count,
            stage_kind=BACKWARD if last else FORWARD,
            stage=0,
            micro_batch=m,
            loss_scale=scale,
            **STAGE_UNIT_LIMITS,
            **_stage_blobs(project=project, version=version, stage=0),
        )
    return len(slices)


def _next_slice(*, project: Project) -> tuple[DatasetShard, int, int]:
    """The next micro-batch of the training split, within one shard (a stage reads one slice; data-parallel
    units may run across shards: datasets.shard_slices)."""
    index = project.data_cursor % project.dataset.train_samples
    per_shard = settings.CROWDTRAIN["SHARD_SAMPLES"]
    shard = project.dataset.shards.get(split=DatasetShard.Split.TRAIN, index=index // per_shard)
    offset = index % per_shard
    count = min(project.batch_size, shard.count - offset)
    project.data_cursor += count
    return shard, offset, count


def _scales(
    *, project: Project, version: ModelVersion, slices: list[tuple[DatasetShard, int, int]]
) -> list[float]:
    graph = stage_graph(project=project)
    targets = [
        {graph.loss.inputs[1]: slice_tensors(shard, offset, count)[1]} for shard, offset, count in slices
    ]
    weights = codecs.decode(version.weights_blob.read())[0]
    return loss_scales(graph, weights, targets)


def slice_tensors(shard: DatasetShard, offset: int, count: int) -> tuple[Tensor, Tensor]:
    x, y = shard_load(shard=shard)
    window = slice(offset, offset + count)
    return torch.from_numpy(x[window].copy()), torch.from_numpy(y[window].copy())


@dataclass(frozen=True)
class Payload:
    """An activation or gradient a unit reads: its blob on the server, or only the digest of what went by the
    peer ring (projects/ring.py), or both once relayed."""

    blob: Blob | None = None
    digest: str = ""


def stage_successor_create(
    *, work_unit: WorkUnit, output: Blob | None, input_grad: bytes, sent_digest: str = ""
) -> WorkUnit | None:
    """The unit a validated `work_unit` makes ready (see the module's docstring), or None at stage 0's
    backward. Called in the validating transaction, holding the work unit's lock. `sent_digest`: the result's
    payload went by the peer ring, and only its digest is known here. A unit computed again because its
    payload was lost (ring.ring_payload_lost) feeds the units already waiting for it instead."""
    last = len(project_partition(project=work_unit.project).stages) - 1
    k = work_unit.stage or 0
    if work_unit.stage_kind == FORWARD:
        kind = FORWARD if k + 1 < last else BACKWARD
        out = Payload(digest=sent_digest) if sent_digest else Payload(blob=output)
        if kind == FORWARD:
            _refeed(work_unit=work_unit, kind=BACKWARD, stage=k + 1, inputs=out)
        return _successor(work_unit=work_unit, kind=kind, stage=k + 1, inputs=out, grad=None)
    if k == 0 or not unit_stage(work_unit=work_unit).needs_input_grad:
        return None  # nothing before this stage trains: the micro-batch's backward pass ends here
    grad = Payload(digest=sent_digest) if sent_digest else Payload(blob=blob_put(data=input_grad))
    forward = WorkUnit.objects.exclude(status=WorkUnit.Status.CANCELLED).get(
        version=work_unit.version, stage_kind=FORWARD, stage=k - 1, micro_batch=work_unit.micro_batch
    )
    inputs = Payload(blob=forward.input_blob, digest=forward.input_digest)
    return _successor(work_unit=work_unit, kind=BACKWARD, stage=k - 1, inputs=inputs, grad=grad)


def _successor(
    *, work_unit: WorkUnit, kind: str, stage: int, inputs: Payload, grad: Payload | None
) -> WorkUnit | None:
    transaction.on_commit(_work_available)
    if _refeed(work_unit=work_unit, kind=kind, stage=stage, inputs=inputs, grad=grad):
        return None
    return WorkUnit.objects.create(
        project=work_unit.project,
        version=work_unit.version,
        shard=work_unit.shard,
        offset=work_unit.offset,
        count=work_unit.count,
        stage_kind=kind,
        stage=stage,
        micro_batch=work_unit.micro_batch,
        input_blob=inputs.blob,
        input_digest=inputs.digest,
        grad_blob=grad.blob if grad else None,
        grad_digest=grad.digest if grad else "",
        loss_scale=work_unit.loss_scale,
        **STAGE_UNIT_LIMITS,
        **_stage_blobs(project=work_unit.project, version=work_unit.version, stage=stage),
    )


def _refeed(
    *, work_unit: WorkUnit, kind: str, stage: int, inputs: Payload, grad: Payload | None = None
) -> bool:
    """Whether the unit (kind, stage) of the micro-batch exists already; if it waits, it gets the payloads
    of `work_unit`, computed again (ring.ring_payload_lost), and is wanted again."""
    existing = (
        WorkUnit.objects.select_for_update(no_key=True)
        .filter(version=work_unit.version, stage_kind=kind, stage=stage, micro_batch=work_unit.micro_batch)
        .exclude(status=WorkUnit.Status.CANCELLED)
        .first()
    )
    if existing is None:
        return False
    if existing.status != WorkUnit.Status.OPEN:
        return True
    fields: dict[str, object] = {}
    if existing.input_blob_id is None:
        fields |= {"input_blob": inputs.blob, "input_digest": inputs.digest}
    if grad is not None and existing.grad_blob_id is None:
        fields |= {"grad_blob": grad.blob, "grad_digest": grad.digest}
    if not existing.results.filter(status=Result.Status.IN_PROGRESS).exists():
        fields["wanted"] = max(existing.wanted, 1)
    WorkUnit.objects.filter(pk=existing.pk).update(**fields)
    return True


def _stage_blobs(*, project: Project, version: ModelVersion, stage: int) -> dict[str, str]:
    """The stage's graph and weights blobs on `version` (content-addressed: stored again, the same rows).
    Keyed by the partition too: a step restarted under another stage count cuts other stages."""
    key = (_partition_key(project=project), version.wire_blob.sha256, stage)
    known = _stage_blob_ids.get(key)
    # Units referencing them keep them from the collector; a first unit must find them still stored.
    if known is None or Blob.objects.filter(pk__in=known).count() != len(set(known)):
        if len(_stage_blob_ids) >= PARTITIONS_KEPT:
            _stage_blob_ids.pop(next(iter(_stage_blob_ids)))
        known = _stage_blob_ids[key] = _stage_blobs_stored(project=project, version=version, stage=stage)
    return {"stage_graph_id": known[0], "stage_weights_id": known[1]}


def _stage_blobs_stored(*, project: Project, version: ModelVersion, stage: int) -> tuple[str, str]:
    part = project_partition(project=project).stages[stage]
    wire = codecs.decode(version.wire_blob.read())[0]
    graph = blob_put(data=graph_to_json(part.graph), content_type="application/json")
    weights = blob_put(data=codecs.encode(stage_weights(part, wire), project.weights_codec))
    return graph.sha256, weights.sha256


def _work_available() -> None:
    notify.work_available()


# --- units: what they cost, what they need --------------------------------------------------------


def unit_stage(*, work_unit: WorkUnit) -> Stage:
    return project_partition(project=work_unit.project).stages[work_unit.stage or 0]


def unit_has_loss(*, work_unit: WorkUnit) -> bool:
    """Data-parallel units compute the loss of their slice; of the stage units, only the last stage's."""
    return not work_unit.stage_kind or unit_stage(work_unit=work_unit).last


def backward_units(*, project: Project) -> int:
    """Backward units per micro-batch: the last stage's, and one for each stage whose output gradient is
    sent back (the stages after the first one with parameters)."""
    parts = project_partition(project=project).stages
    return 1 + sum(1 for following in parts[1:] if following.needs_input_grad)


def unit_flops(*, work_unit: WorkUnit) -> int:
    """Server-side FLOPs of a unit: what credit pays and fair share charges. Data-parallel units: the
    project's training FLOPs per sample times its samples."""
    if not work_unit.stage_kind:
        return work_unit.project.flops_per_sample * work_unit.count
    stage = unit_stage(work_unit=work_unit)
    per_sample = stage.forward_flops if work_unit.stage_kind == FORWARD else stage.backward_unit_flops
    return per_sample * work_unit.count


def unit_seed(*, work_unit: WorkUnit) -> int:
    """The dropout seed of a stage's micro-batch: its forward and backward units draw the same masks."""
    key = f"{work_unit.project_id}:{work_unit.version_id}:{work_unit.micro_batch}:{work_unit.stage}"
    # 52 bits: browsers read seeds as JSON numbers, exact only below 2**53 (engine/pipeline.js).
    return int(hashlib.sha256(key.encode()).hexdigest()[:13], 16)


def input_shape(stage: Stage, count: int) -> list[int]:
    return [count, *stage.graph.inputs[0].shape[1:]]


def output_shape(*, work_unit: WorkUnit) -> list[int]:
    following = project_partition(project=work_unit.project).stages[(work_unit.stage or 0) + 1]
    return input_shape(following, work_unit.count)


# --- payloads ----------------------------------------------------------------------------------


def backward_payload(*, input_grad: bytes, grads: bytes) -> bytes:
    """A backward result's wire payload (see the module's docstring)."""
    return LENGTH.pack(len(input_grad)) + input_grad + grads


def payload_split(payload: bytes) -> tuple[bytes, bytes]:
    if len(payload) < LENGTH.size:
        raise StageUnitError("the payload is shorter than its length prefix")
    (size,) = LENGTH.unpack_from(payload)
    if size > len(payload) - LENGTH.size:
        raise StageUnitError("the input gradient's length runs past the payload")
    return payload[LENGTH.size : LENGTH.size + size], payload[LENGTH.size + size :]
