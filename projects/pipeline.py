"""Pipeline mode's results and steps (issue 14; docs/pipeline.md; the units are in stages.py).

A stage result is judged on its own (samples, loss, the payload's shapes and finite values in the
activation codec: hostile bytes give a reason, never an exception) and, when spot-checked, against the
server's recomputation of the unit with engine/pipeline.py (engine/activations.spot_check for activations
and their gradients, relative L2 for parameter gradients and trained buffers). When every backward unit of
the step is validated their parameter gradients are summed and the project's server optimizer publishes the
next version, as sync_sgd does.

Batch norm: a backward unit recomputes its stage's forward on the micro-batch, so it reports the stage's
trained buffers (running statistics) after that forward beside its parameter gradients, named as the
buffers, as a data-parallel update does. The step averages them over micro-batches, weighted by samples,
as engine/schedule.gpipe_step does. A stage with trained buffers but no backward unit (nothing up to it
trains, so no gradient reaches it) has its buffers recomputed here from its forward units' inputs: such a
stage has no parameters, so its forward costs the server little.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

from engine import activations, codecs, optim
from engine.aggregate import check_update
from engine.partition import Stage
from engine.pipeline import StageUnitError, stage_backward, stage_forward
from projects.models import Blob, ModelVersion, Project, Result, WorkUnit
from projects.services import project_graph, version_publish, version_weights, version_wire_weights
from projects.stages import (
    BACKWARD,
    FORWARD,
    backward_units,
    input_shape,
    output_shape,
    payload_split,
    project_partition,
    slice_tensors,
    unit_has_loss,
    unit_seed,
    unit_stage,
)

Tensors = dict[str, Tensor]
# Relative L2 distance of a spot-checked unit's parameter gradients to the server's (fp32 on the wire: only
# the float32 differences of two interpreters remain; attacks land at 1.0 or more).
GRADS_TOLERANCE = 1e-3


@dataclass
class StageParts:
    """A stage result's decoded payload: the output activation (forward), or the input gradient and the
    parameter gradients (backward)."""

    activation: Tensor | None = None
    input_grad: Tensor | None = None
    grads: Tensors = field(default_factory=dict)
    buffers: Tensors = field(default_factory=dict)  # the stage's trained buffers after the unit's forward
    input_grad_bytes: bytes = b""


# --- results: payloads, checks, recomputation -----------------------------------------------------


def stage_result_check(*, result: Result, spot_check: bool) -> tuple[str | None, StageParts]:
    """Why a stage result is invalid (None if it is not), and its decoded parts. Hostile bytes give a
    reason, never an exception; `spot_check`: compare with the server's recomputation of the unit."""
    work_unit = result.work_unit
    if result.samples != work_unit.count:
        return f"expected {work_unit.count} samples, got {result.samples}", StageParts()
    if unit_has_loss(work_unit=work_unit) and (result.loss is None or not math.isfinite(result.loss)):
        return "the loss is not a finite number", StageParts()
    if result.sent_digest and (work_unit.spot_check or not _ring_may_send(work_unit)):
        return "the server asked for this unit's payload, and got only its digest", StageParts()
    try:
        payload = result.blob.read() if result.blob else b""
        parts = _parts(work_unit=work_unit, payload=payload, by_ring=bool(result.sent_digest))
    except (StageUnitError, activations.ActivationError, codecs.CodecError) as exc:
        return f"malformed stage result: {exc}", StageParts()
    if parts is None:
        return (
            "the parameter gradients or trained buffers have the wrong names, shapes or values",
            StageParts(),
        )
    if not spot_check:
        return None, parts
    result.spot_checked = True
    return _disagreement(work_unit=work_unit, parts=parts, by_ring=bool(result.sent_digest)), parts


def _ring_may_send(work_unit: WorkUnit) -> bool:
    """Ring on, and the unit sends something to an adjacent stage (ring.produces_payload, a layer up)."""
    if not work_unit.project.pipeline_ring:
        return False
    return work_unit.stage_kind == FORWARD or bool(
        work_unit.stage and unit_stage(work_unit=work_unit).needs_input_grad
    )


def _parts(*, work_unit: WorkUnit, payload: bytes, by_ring: bool = False) -> StageParts | None:
    """`by_ring`: the activation or input gradient went to the next volunteer, which checks it against the
    digest; the frame holds the rest (nothing, or the parameter gradients after a zero length)."""
    codec = work_unit.project.activation_codec
    if work_unit.stage_kind == FORWARD:
        if by_ring:
            if payload:
                raise StageUnitError("a result sent by the ring carries no activation")
            return StageParts()
        shape = output_shape(work_unit=work_unit)
        return StageParts(activation=activations.decode(payload, shape, kind="activation", codec=codec))
    stage = unit_stage(work_unit=work_unit)
    grad_bytes, grads_bytes = payload_split(payload)
    input_grad = None
    if by_ring and grad_bytes:
        raise StageUnitError("a result sent by the ring carries no input gradient")
    if stage.needs_input_grad and not by_ring:
        shape = input_shape(stage, work_unit.count)
        input_grad = activations.decode(grad_bytes, shape, kind="gradient", codec=codec)
    elif grad_bytes:
        raise StageUnitError(f"stage {stage.index} sends no input gradient")
    tensors = codecs.decode(grads_bytes)[0] if grads_bytes else {}
    params = {p.name: tuple(p.shape) for p in stage.graph.params}
    trained = set(stage.graph.trained_buffers())
    expected = {**params, **{b.name: tuple(b.shape) for b in stage.graph.buffers if b.name in trained}}
    if set(tensors) != set(expected) or check_update(tensors, expected):
        return None
    grads = {name: tensors[name] for name in params}
    buffers = {name: tensors[name] for name in trained}
    return StageParts(input_grad=input_grad, grads=grads, buffers=buffers, input_grad_bytes=grad_bytes)


def _disagreement(*, work_unit: WorkUnit, parts: StageParts, by_ring: bool = False) -> str | None:
    """`by_ring`: a volunteer that lost its trust after the unit was sent (it would not have been let use
    the ring otherwise): only its parameter gradients are here to compare."""
    reference = stage_unit_recompute(work_unit=work_unit)
    if by_ring:
        reference.activation = reference.input_grad = None
    codec = work_unit.project.activation_codec
    pairs = (
        ("output activation", parts.activation, reference.activation, "activation"),
        ("input gradient", parts.input_grad, reference.input_grad, "gradient"),
    )
    for what, sent, want, kind in pairs:
        if sent is not None and want is not None:
            if not activations.spot_check(sent, want, codec, kind=kind).accepted:
                return f"the {what} differs from the server's recomputation"
        elif (sent is None) != (want is None):
            return f"the {what} is missing or not expected"
    for what, sent_tensors, wanted in (
        ("parameter gradients", parts.grads, reference.grads),
        ("trained buffers", parts.buffers, reference.buffers),
    ):
        distance = _distance(sent_tensors, wanted)
        if distance > GRADS_TOLERANCE:
            return f"the {what} differ from the server's recomputation by {distance:.1%}"
    return None


def _distance(got: Mapping[str, Tensor], want: Mapping[str, Tensor]) -> float:
    if not want:
        return 0.0
    diff = math.sqrt(sum(float((got[n].double() - want[n].double()).pow(2).sum()) for n in want))
    norm = math.sqrt(sum(float(want[n].double().pow(2).sum()) for n in want))
    return diff / max(norm, 1e-12)


def stage_unit_recompute(*, work_unit: WorkUnit) -> StageParts:
    """What an honest volunteer computes for a stage unit, here with engine/pipeline.py (float32)."""
    stage = unit_stage(work_unit=work_unit)
    weights = _unit_weights(work_unit=work_unit)
    inputs, targets = _unit_inputs(work_unit=work_unit, stage=stage)
    seed = unit_seed(work_unit=work_unit)
    if work_unit.stage_kind == FORWARD:
        return StageParts(activation=stage_forward(stage, weights, inputs, seed=seed).output)
    output_grad = None if stage.last else _blob_tensor(work_unit.grad_blob, work_unit, stage, kind="gradient")
    done = stage_backward(
        stage,
        weights,
        inputs,
        output_grad,
        targets=targets if stage.last else None,
        loss_scale=work_unit.loss_scale if work_unit.loss_scale is not None else 1.0,
        seed=seed,
    )
    return StageParts(input_grad=done.input_grad, grads=done.grads, buffers=done.buffers)


def _unit_weights(*, work_unit: WorkUnit) -> Tensors:
    """Exactly the weights the volunteer was sent (the stage's blob), else the version's wire weights."""
    if work_unit.stage_weights is not None:
        return dict(codecs.decode(work_unit.stage_weights.read())[0])
    return version_wire_weights(version=work_unit.version)


def _unit_inputs(*, work_unit: WorkUnit, stage: Stage) -> tuple[Tensor | Tensors, Tensors]:
    x, y = slice_tensors(work_unit.shard, work_unit.offset, work_unit.count)
    graph = project_graph(project=work_unit.project)
    targets = {graph.loss.inputs[1]: y}
    if stage.index == 0:
        return {graph.inputs[0].name: x}, targets
    return _blob_tensor(work_unit.input_blob, work_unit, stage, kind="activation"), targets


def _blob_tensor(blob: Blob | None, work_unit: WorkUnit, stage: Stage, *, kind: str) -> Tensor:
    """The stage's input activation, or the gradient of its output (the next stage's input's shape)."""
    if blob is None:
        raise StageUnitError(f"work unit {work_unit.pk} has no {kind} blob")
    shape = input_shape(stage, work_unit.count) if kind == "activation" else output_shape(work_unit=work_unit)
    return activations.decode(blob.read(), shape, kind=kind, codec=work_unit.project.activation_codec)


# --- the step -------------------------------------------------------------------------------------


def step_complete(*, project: Project, current: ModelVersion) -> bool:
    """Is every backward unit of the step on `current` validated?"""
    done = WorkUnit.objects.filter(version=current, stage_kind=BACKWARD, status=WorkUnit.Status.VALIDATED)
    return done.count() == backward_units(project=project) * project.micro_batches


def step_publish(*, project: Project, current: ModelVersion) -> ModelVersion | None:
    """The next version, once the step on `current` is complete (the caller holds the project's row):
    the summed stage gradients through the project's server optimizer, as sync_sgd steps."""
    if not step_complete(project=project, current=current):
        return None
    results = _step_results(current=current)
    weights, state = _current_state(version=current)
    grads, buffers = _step_sums(project=project, results=results, current=current)
    optim.server_step_(
        weights,
        grads,
        state,
        averaging=False,
        lr=project.learning_rate,
        momentum=project.momentum,
        weight_decay=project.weight_decay,
    )
    weights.update(buffers)
    Result.objects.filter(pk__in=[r.pk for r in results]).update(aggregated=True)
    last = [r for r in results if r.work_unit.stage == len(project_partition(project=project).stages) - 1]
    samples = sum(r.work_unit.count for r in last)
    loss = sum((r.loss or 0.0) * r.work_unit.count for r in last) / max(samples, 1)
    return version_publish(
        project=project,
        number=current.number + 1,
        weights=weights,
        momentum=state,
        train_loss=loss,
        samples=samples,
    )


def _step_results(*, current: ModelVersion) -> list[Result]:
    return list(
        Result.objects.filter(
            work_unit__version=current,
            work_unit__stage_kind=BACKWARD,
            work_unit__status=WorkUnit.Status.VALIDATED,  # not those of a step a pause interrupted
            canonical_for__isnull=False,
        )
        .select_related("blob", "work_unit")
        .order_by("work_unit__stage", "work_unit__micro_batch")
    )


def _current_state(*, version: ModelVersion) -> tuple[Tensors, Tensors]:
    weights = {k: v.clone() for k, v in version_weights(version=version).items()}
    if version.optimizer_state is None:
        return weights, {}
    return weights, dict(codecs.decode(version.optimizer_state.read())[0])


def _step_sums(*, project: Project, results: list[Result], current: ModelVersion) -> tuple[Tensors, Tensors]:
    """Every param's gradient summed over stages (tied params appear in several) and micro-batches, and
    every trained buffer averaged over micro-batches weighted by samples (see the module's docstring)."""
    graph = project_graph(project=project)
    total = {p.name: torch.zeros(p.shape) for p in graph.params}
    trained = set(graph.trained_buffers())
    reported: dict[str, list[tuple[Tensor, int]]] = {}
    for result in results:
        if result.blob is None:
            continue
        _, tensors = payload_split(result.blob.read())
        for name, value in (codecs.decode(tensors)[0] if tensors else {}).items():
            if name in total:
                total[name] += value
            elif name in trained:
                reported.setdefault(name, []).append((value, result.work_unit.count))
    for work_unit in _forward_units_reporting_buffers(project=project, current=current):
        for name, value in _forward_buffers(work_unit=work_unit).items():
            reported.setdefault(name, []).append((value, work_unit.count))
    return total, {name: _weighted_mean(pairs) for name, pairs in reported.items()}


def _weighted_mean(pairs: list[tuple[Tensor, int]]) -> Tensor:
    samples = sum(count for _, count in pairs)
    return sum((value * (count / samples) for value, count in pairs), torch.zeros_like(pairs[0][0]))


def _forward_units_reporting_buffers(*, project: Project, current: ModelVersion) -> list[WorkUnit]:
    """The step's forward units of stages with trained buffers but no backward unit."""
    parts = project_partition(project=project).stages
    silent = [
        stage.index
        for stage, following in zip(parts, parts[1:], strict=False)
        if stage.graph.trained_buffers() and not following.needs_input_grad
    ]
    if not silent:
        return []
    units = WorkUnit.objects.filter(
        version=current, stage_kind=FORWARD, stage__in=silent, status=WorkUnit.Status.VALIDATED
    )
    return list(units.select_related("project", "version", "shard", "input_blob", "stage_weights"))


def _forward_buffers(*, work_unit: WorkUnit) -> Tensors:
    stage = unit_stage(work_unit=work_unit)
    inputs, _ = _unit_inputs(work_unit=work_unit, stage=stage)
    weights = _unit_weights(work_unit=work_unit)
    return stage_forward(stage, weights, inputs, seed=unit_seed(work_unit=work_unit)).buffers
