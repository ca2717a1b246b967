"""Validation and trust: is a received update what an honest volunteer would have sent?

Every update gets cheap checks (names, shapes, finite values, sample count, replays, norm outliers).
Volunteers are not trusted until they return `trust_threshold` valid results in a row; until then every
update is spot-checked by recomputing it on the server with engine/, and afterwards a random
`spot_check_rate` share still is (BOINC's adaptive replication, with the server as the second replica).
Valid results earn credit from server-side FLOPs; invalid ones earn nothing and reset trust.
"""

from __future__ import annotations

import math
import random
from statistics import median

import torch
from django.db import transaction
from django.db.models import F

from engine import codecs
from engine.aggregate import check_update
from engine.graph import Graph
from engine.runtime import compute_gradients, local_steps
from projects import notify
from projects.datasets import shard_load
from projects.models import Project, Result, WorkUnit
from projects.services import project_graph, version_weights
from workers.models import Device, Volunteer
from workers.services import credit_grant, volunteer_ensure

Tensors = dict[str, torch.Tensor]
# Relative L2 distance to the server's recomputation that still counts as the same update. int8 with error
# feedback carries the previous work units' residual, so it needs the widest margin; attacks (sign flips,
# scaling, noise, replays) land at 1.0 or more.
TOLERANCE = {"fp32": 0.01, "fp16": 0.02, "int8": 0.25}
# For graphs with dropout, whose updates cannot be recomputed exactly.
MIN_COSINE = 0.3
MAX_NORM_RATIO = 2.0
NORM_OUTLIER_FACTOR = 10.0
NORM_HISTORY = 20


def result_validate(*, result_id: int) -> Result:
    """Decide a received result: valid (credited, may be aggregated) or invalid (its slice is resent)."""
    with transaction.atomic():
        result = (
            Result.objects.select_for_update(of=("self",))
            .select_related("work_unit__project", "work_unit__version", "work_unit__shard__blob", "blob")
            .get(pk=result_id)
        )
        if result.status != Result.Status.RECEIVED or result.validation != Result.Validation.PENDING:
            return result
        if _still_wanted(result):
            _decide(result=result, reason=_problem(result))
    # Late results get their verdict too, so no volunteer waits for an answer that never comes.
    transaction.on_commit(lambda: notify.result_decided(result_id=result.pk))
    return result


def _decide(*, result: Result, reason: str) -> None:
    if reason:
        _invalidate(result=result, reason=reason)
    else:
        _validate(result=result)


def _still_wanted(result: Result) -> bool:
    """Work cancelled while the update was in the queue (a new round started) is late, not invalid."""
    work_unit = (
        WorkUnit.objects.select_for_update()
        .select_related("project", "version", "shard__blob")
        .get(pk=result.work_unit_id)
    )
    late = _lateness(work_unit)
    if late:
        result.status, result.reason = Result.Status.CANCELLED, late
        result.save(update_fields=["status", "reason"])
        return False
    result.work_unit = work_unit
    return True


def _lateness(work_unit: WorkUnit) -> str:
    if work_unit.status == WorkUnit.Status.CANCELLED:
        return "the round closed before this result was validated"
    project = work_unit.project
    staleness = project.current_version().number - work_unit.version.number
    if project.mode == Project.Mode.ASYNC_SGD and not project.staleness_weight(staleness=staleness):
        return f"computed on a version {staleness} steps old (the bound is {project.staleness_bound})"
    return ""


def _problem(result: Result) -> str:
    """Why the result is invalid, or '' if it passed every check it was due."""
    work_unit = result.work_unit
    if result.samples != work_unit.count:
        return f"expected {work_unit.count} samples, got {result.samples}"
    if result.loss is None or not torch.isfinite(torch.tensor(result.loss)):
        return "the loss is not a finite number"
    try:
        update = codecs.decode(result.blob.read())[0] if result.blob else {}
    except codecs.CodecError as exc:
        return f"undecodable update: {exc}"
    return _update_problem(result=result, update=update)


def _update_problem(*, result: Result, update: Tensors) -> str:
    graph = project_graph(project=result.work_unit.project)
    expected = {p.name: tuple(p.shape) for p in graph.params}
    expected.update({b.name: tuple(b.shape) for b in graph.buffers if b.name in update})
    reason = check_update(update, expected)
    if reason:
        return reason
    if _replayed(result):
        return "this update was already submitted for another work unit (replay)"
    params = {p.name: update[p.name] for p in graph.params}
    return _norm_problem(result=result, norm=_norm(params)) or _spot_check(result=result, update=params)


def _replayed(result: Result) -> bool:
    """The same bytes for another slice or version. Two honest volunteers given the same slice of the same
    version (a round bigger than the dataset wraps around) legitimately send identical bytes."""
    unit = result.work_unit
    same = Result.objects.filter(blob=result.blob, work_unit__project=unit.project).exclude(pk=result.pk)
    return same.exclude(
        work_unit__version=unit.version,
        work_unit__shard=unit.shard,
        work_unit__offset=unit.offset,
        work_unit__count=unit.count,
    ).exists()


def _norm(update: Tensors) -> float:
    return math.sqrt(sum(float((t.double() ** 2).sum()) for t in update.values()))


def _norm_problem(*, result: Result, norm: float) -> str:
    norms = (
        Result.objects.filter(work_unit__project=result.work_unit.project, validation=Result.Validation.VALID)
        .exclude(update_norm=None)
        .order_by("-pk")
        .values_list("update_norm", flat=True)[:NORM_HISTORY]
    )
    recent = [n for n in norms if n is not None]
    result.update_norm = norm
    if len(recent) < 5 or norm <= NORM_OUTLIER_FACTOR * median(recent):
        return ""
    return f"update norm {norm:.3g} is over {NORM_OUTLIER_FACTOR:g}x the recent median {median(recent):.3g}"


def _spot_check(*, result: Result, update: Tensors) -> str:
    project = result.work_unit.project
    volunteer = volunteer_ensure(user=result.volunteer)
    trusted = volunteer.is_trusted(threshold=project.trust_threshold)
    if trusted and random.random() >= project.spot_check_rate:
        return ""
    result.spot_checked = True
    reference = recompute(work_unit=result.work_unit)
    if _stochastic(project_graph(project=project)):
        return _statistical_problem(update=update, reference=reference)
    distance = _norm({k: update[k] - reference[k] for k in reference}) / max(_norm(reference), 1e-12)
    if distance > TOLERANCE[project.codec]:
        return f"differs from the server's recomputation by {distance:.1%}"
    return ""


def _stochastic(graph: Graph) -> bool:
    return any(node.op == "dropout" and node.attrs.get("p", 0) > 0 for node in graph.nodes)


def _statistical_problem(*, update: Tensors, reference: Tensors) -> str:
    """Dropout masks are random, so an honest update only points the same way as the server's, with a
    similar norm (measured here: cosine 0.65-0.75 for the CNN preset's 0.25 dropout); sign flips, noise
    and scaling do not."""
    a, b = _flat(update), _flat(reference)
    cosine = float(a @ b / max(float(a.norm() * b.norm()), 1e-30))
    ratio = float(a.norm() / max(float(b.norm()), 1e-30))
    if cosine < MIN_COSINE or not 1 / MAX_NORM_RATIO <= ratio <= MAX_NORM_RATIO:
        return f"does not match the server's recomputation (cosine {cosine:.2f}, norm ratio {ratio:.2f})"
    return ""


def _flat(tensors: Tensors) -> torch.Tensor:
    return torch.cat([tensors[name].double().flatten() for name in sorted(tensors)])


def recompute(*, work_unit: WorkUnit) -> Tensors:
    """What an honest volunteer sends for this work unit, computed here with engine/."""
    project = work_unit.project
    graph = project_graph(project=project)
    x, y = shard_load(shard=work_unit.shard)
    window = slice(work_unit.offset, work_unit.offset + work_unit.count)
    inputs = {graph.inputs[0].name: torch.from_numpy(x[window])}
    targets = {graph.targets[0].name: torch.from_numpy(y[window])}
    weights = version_weights(version=work_unit.version)
    if project.task == "local_steps":
        return local_steps(
            graph,
            weights,
            inputs,
            targets,
            batch_size=project.local_batch_size,
            lr=project.local_learning_rate,
            momentum=project.local_momentum,
        ).delta
    return compute_gradients(graph, weights, inputs, targets).grads


def _invalidate(*, result: Result, reason: str) -> None:
    result.validation, result.reason = Result.Validation.INVALID, reason[:200]
    result.save(update_fields=["validation", "reason", "update_norm", "spot_checked"])
    Volunteer.objects.filter(user=result.volunteer).update(
        consecutive_valid=0, results_invalid=F("results_invalid") + 1
    )
    work_unit = result.work_unit
    work_unit.record_failure()
    work_unit.save(update_fields=["wanted", "error_results", "status"])


def _validate(*, result: Result) -> None:
    project = result.work_unit.project
    result.validation = Result.Validation.VALID
    result.save(update_fields=["validation", "update_norm", "spot_checked"])
    flops = project.flops_per_sample * result.work_unit.count
    credit_grant(user=result.volunteer, result=result, flops=flops)
    Volunteer.objects.filter(user=result.volunteer).update(consecutive_valid=F("consecutive_valid") + 1)
    _observe_device(result=result, flops=flops)
    WorkUnit.objects.filter(pk=result.work_unit_id).update(status=WorkUnit.Status.VALIDATED)


def _observe_device(*, result: Result, flops: int) -> None:
    if result.device_id is None:
        return
    device = Device.objects.select_for_update().get(pk=result.device_id)
    device.observe(flops=flops, compute_ms=result.compute_ms)
    device.save(update_fields=["observed_gflops", "compute_ms"])
