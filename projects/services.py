"""Project lifecycle and synchronous data-parallel training: versions, work units, results, aggregation.

Every step that touches several models lives here. Views, consumers and Celery tasks only validate input
and call these functions.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch
from django.conf import settings
from django.contrib.auth.models import User
from django.db import transaction
from django.db.models import Sum

from engine import aggregate, codecs, runtime
from engine.flops import train_flops_per_sample
from engine.graph import Graph, GraphError, graph_to_json, infer_shapes, load_graph
from engine.presets import export_preset
from projects import notify
from projects.blobs import blob_put
from projects.datasets import dataset_load_split
from projects.models import (
    Dataset,
    DatasetShard,
    Metric,
    ModelVersion,
    Project,
    Result,
    WorkUnit,
)
from workers.services import credit_grant

logger = logging.getLogger(__name__)
Tensors = dict[str, torch.Tensor]

TRAINING_SETTINGS = (
    "mode",
    "learning_rate",
    "momentum",
    "weight_decay",
    "batch_size",
    "round_samples",
    "max_versions",
    "priority",
)


class ProjectError(ValueError):
    """A project cannot be created or changed as asked; the message is shown to the researcher."""


class ResultError(ValueError):
    """A result that breaks the protocol; `code` is sent to the client in an `error` message."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class ResultOutcome:
    work_unit_id: int
    accepted: bool
    reason: str
    credit_flops: int
    total_credit_flops: int


# --- projects -------------------------------------------------------------------------------------


def project_create(
    *,
    owner: User,
    name: str,
    dataset: Dataset,
    preset: str,
    description: str = "",
    settings: dict[str, Any] | None = None,
) -> Project:
    """Build the model from a preset, check it fits the dataset, and publish version 0."""
    graph_dict, weights = export_preset(preset)
    return project_create_from_graph(
        owner=owner,
        name=name,
        dataset=dataset,
        graph_dict=graph_dict,
        weights=weights,
        preset=preset,
        description=description,
        settings=settings,
    )


def project_create_from_graph(
    *,
    owner: User,
    name: str,
    dataset: Dataset,
    graph_dict: dict[str, Any],
    weights: Tensors,
    preset: str = "",
    description: str = "",
    settings: dict[str, Any] | None = None,
) -> Project:
    graph = _graph_for_dataset(graph_dict=graph_dict, dataset=dataset)
    with transaction.atomic():
        project = Project.objects.create(
            owner=owner,
            name=name,
            description=description,
            dataset=dataset,
            preset=preset,
            graph=blob_put(data=graph_to_json(graph), content_type="application/json"),
            flops_per_sample=train_flops_per_sample(graph),
            **{key: value for key, value in (settings or {}).items() if key in TRAINING_SETTINGS},
        )
        version_publish(project=project, number=0, weights=weights, momentum={})
    return project


def _graph_for_dataset(*, graph_dict: dict[str, Any], dataset: Dataset) -> Graph:
    try:
        graph = load_graph(graph_dict)
    except GraphError as exc:
        raise ProjectError(f"Invalid model graph: {exc}") from exc
    sample_shape = list(graph.inputs[0].shape[1:])
    if sample_shape != list(dataset.input_shape):
        raise ProjectError(
            f"The model expects samples of shape {sample_shape}, the dataset has {dataset.input_shape}."
        )
    classes = infer_shapes(graph, batch=1)[graph.output][-1]
    if graph.loss.op == "cross_entropy" and classes < dataset.num_classes:
        raise ProjectError(f"The model predicts {classes} classes, the dataset has {dataset.num_classes}.")
    return graph


def project_start(*, project: Project) -> Project:
    if project.status == Project.Status.FINISHED:
        raise ProjectError("This project has finished; create a new one to train again.")
    project.status = Project.Status.RUNNING
    project.save(update_fields=["status"])
    transaction.on_commit(lambda: notify.feed_requested(project_id=project.pk))
    return project


def project_pause(*, project: Project) -> Project:
    with transaction.atomic():
        project.status = Project.Status.PAUSED
        project.save(update_fields=["status"])
        _cancel_open_work(project=project, reason="project paused")
    return project


def project_graph(*, project: Project) -> Graph:
    return load_graph(project.graph.read())


# --- versions -------------------------------------------------------------------------------------


def version_publish(
    *,
    project: Project,
    number: int,
    weights: Tensors,
    momentum: Tensors,
    train_loss: float | None = None,
    samples: int = 0,
) -> ModelVersion:
    weights_blob = blob_put(data=codecs.encode(weights))
    state_blob = blob_put(data=codecs.encode(momentum)) if momentum else None
    return ModelVersion.objects.create(
        project=project,
        number=number,
        weights=weights_blob,
        optimizer_state=state_blob,
        train_loss=train_loss,
        samples=samples,
    )


def version_weights(*, version: ModelVersion) -> Tensors:
    return codecs.decode(version.weights.read())[0]


def version_aggregate(*, project_id: int, version_number: int) -> ModelVersion | None:
    """Close the round of `version_number` if enough samples arrived: average, step, publish the next version.

    Idempotent: a round that is already closed, or not yet full, is left alone.
    """
    with transaction.atomic():
        project = Project.objects.select_for_update().get(pk=project_id)
        current = project.current_version()
        results = list(_round_results(version=current))
        if current.number != version_number or sum(r.samples for r in results) < project.round_samples:
            return None
        new_version = _step(project=project, version=current, results=results)
        _cancel_open_work(project=project, reason="new model version")
        _finish_if_done(project=project, version=new_version)
    transaction.on_commit(
        lambda: notify.version_published(
            project_id=project_id, version_id=new_version.pk, number=new_version.number
        )
    )
    return new_version


def _round_results(*, version: ModelVersion) -> Any:
    return Result.objects.filter(
        work_unit__version=version, status=Result.Status.ACCEPTED, aggregated=False
    ).select_related("blob")


def _step(*, project: Project, version: ModelVersion, results: list[Result]) -> ModelVersion:
    grads = aggregate.weighted_mean(
        [codecs.decode(r.blob.read())[0] for r in results if r.blob], [float(r.samples) for r in results]
    )
    momentum = codecs.decode(version.optimizer_state.read())[0] if version.optimizer_state else {}
    params, momentum = aggregate.sgd_step(
        version_weights(version=version),
        grads,
        momentum,
        lr=project.learning_rate,
        momentum=project.momentum,
        weight_decay=project.weight_decay,
    )
    samples = sum(r.samples for r in results)
    loss = sum((r.loss or 0.0) * r.samples for r in results) / samples
    Result.objects.filter(pk__in=[r.pk for r in results]).update(aggregated=True)
    return version_publish(
        project=project,
        number=version.number + 1,
        weights=params,
        momentum=momentum,
        train_loss=loss,
        samples=samples,
    )


def _finish_if_done(*, project: Project, version: ModelVersion) -> None:
    if version.number >= project.max_versions:
        project.status = Project.Status.FINISHED
        project.save(update_fields=["status"])


# --- work units -----------------------------------------------------------------------------------


def work_units_feed(*, project_id: int) -> int:
    """Top up the current round of a running project with ready work units (the BOINC feeder)."""
    with transaction.atomic():
        project = Project.objects.select_for_update().get(pk=project_id)
        if not project.is_running:
            return 0
        version = project.current_version()
        missing = _samples_missing(project=project, version=version)
        created = 0
        while missing > 0:
            work_unit = _next_work_unit(project=project, version=version)
            missing -= work_unit.count
            created += 1
        project.save(update_fields=["data_cursor"])
    return created


def _samples_missing(*, project: Project, version: ModelVersion) -> int:
    live = [WorkUnit.Status.READY, WorkUnit.Status.ASSIGNED, WorkUnit.Status.DONE]
    covered = WorkUnit.objects.filter(version=version, status__in=live).aggregate(n=Sum("count"))["n"] or 0
    return project.round_samples - covered


def _next_work_unit(*, project: Project, version: ModelVersion) -> WorkUnit:
    shard, offset = _locate(project=project, index=project.data_cursor % project.dataset.train_samples)
    count = min(project.batch_size, shard.count - offset)
    project.data_cursor += count
    return WorkUnit.objects.create(project=project, version=version, shard=shard, offset=offset, count=count)


def _locate(*, project: Project, index: int) -> tuple[DatasetShard, int]:
    shard_samples = settings.CROWDTRAIN["SHARD_SAMPLES"]
    shard = project.dataset.shards.get(split=DatasetShard.Split.TRAIN, index=index // shard_samples)
    return shard, index % shard_samples


def work_unit_assign(*, user: User) -> WorkUnit | None:
    """Hand the next ready work unit of the highest-priority running project to `user`."""
    deadline = settings.CROWDTRAIN["WORK_UNIT_DEADLINE_SECONDS"]
    with transaction.atomic():
        work_unit = (
            WorkUnit.objects.select_for_update(skip_locked=True)
            .filter(status=WorkUnit.Status.READY, project__status=Project.Status.RUNNING)
            .exclude(results__volunteer=user)
            .select_related("project", "version", "shard__blob", "project__graph", "version__weights")
            # Oldest open round first: with several projects, each one's round keeps moving.
            .order_by("-project__priority", "version__created_at", "id")
            .first()
        )
        if work_unit is None:
            return None
        work_unit.assign(user, deadline)
        work_unit.save(update_fields=["status", "assigned_to", "assigned_at", "deadline"])
    return work_unit


def work_units_release(*, user: User, work_unit_ids: list[int]) -> int:
    """Give back work a volunteer can no longer finish (it disconnected), so others pick it up at once."""
    return WorkUnit.objects.filter(
        pk__in=work_unit_ids, assigned_to=user, status=WorkUnit.Status.ASSIGNED
    ).update(status=WorkUnit.Status.READY, assigned_to=None, assigned_at=None, deadline=None)


def work_units_expire() -> list[int]:
    """Reopen assigned work past its deadline (the BOINC transitioner); returns the project ids touched."""
    from django.utils import timezone

    late = WorkUnit.objects.filter(status=WorkUnit.Status.ASSIGNED, deadline__lt=timezone.now())
    project_ids = sorted(set(late.values_list("project_id", flat=True)))
    late.update(status=WorkUnit.Status.EXPIRED)
    return project_ids


def _cancel_open_work(*, project: Project, reason: str) -> None:
    open_units = WorkUnit.objects.filter(
        project=project, status__in=[WorkUnit.Status.READY, WorkUnit.Status.ASSIGNED]
    )
    by_user: dict[int, list[int]] = {}
    for pk, user_id in open_units.filter(assigned_to__isnull=False).values_list("pk", "assigned_to_id"):
        by_user.setdefault(user_id, []).append(pk)
    open_units.update(status=WorkUnit.Status.CANCELLED)
    transaction.on_commit(lambda: notify.work_cancelled(by_user=by_user, reason=reason))


# --- results --------------------------------------------------------------------------------------


def result_submit(
    *, user: User, work_unit_id: int, samples: int, loss: float, compute_ms: int, payload: bytes
) -> ResultOutcome:
    """Validate and record one volunteer's gradient; credit it if accepted; close the round if it is full."""
    if len(payload) > settings.CROWDTRAIN["MAX_RESULT_BYTES"]:
        raise ResultError("too_large", "The update is larger than this server accepts.")
    with transaction.atomic():
        work_unit = _work_unit_for_result(user=user, work_unit_id=work_unit_id)
        previous = Result.objects.filter(work_unit=work_unit, volunteer=user).first()
        if previous is not None:
            return _outcome(result=previous, user=user)
        if work_unit.status != WorkUnit.Status.ASSIGNED:
            return _rejected_without_record(work_unit=work_unit, user=user)
        result = _record(
            work_unit=work_unit, user=user, samples=samples, loss=loss, compute_ms=compute_ms, payload=payload
        )
    if result.status == Result.Status.ACCEPTED:
        transaction.on_commit(
            lambda: notify.result_accepted(
                project_id=work_unit.project_id, version_number=work_unit.version.number
            )
        )
    return _outcome(result=result, user=user)


def _work_unit_for_result(*, user: User, work_unit_id: int) -> WorkUnit:
    work_unit = (
        WorkUnit.objects.select_for_update()
        .select_related("project", "version")
        .filter(pk=work_unit_id)
        .first()
    )
    if work_unit is None:
        raise ResultError("unknown_work_unit", f"There is no work unit {work_unit_id}.")
    if work_unit.assigned_to_id != user.pk:
        raise ResultError("not_assigned", f"Work unit {work_unit_id} is not assigned to you.")
    return work_unit


def _rejected_without_record(*, work_unit: WorkUnit, user: User) -> ResultOutcome:
    # Late or cancelled work: harmless, earns nothing, and is not stored.
    total = _total_flops(user=user)
    return ResultOutcome(work_unit.pk, False, f"work unit is {work_unit.status}", 0, total)


def _record(
    *, work_unit: WorkUnit, user: User, samples: int, loss: float, compute_ms: int, payload: bytes
) -> Result:
    reason, blob = _validate_update(work_unit=work_unit, samples=samples, loss=loss, payload=payload)
    accepted = not reason
    result = Result.objects.create(
        work_unit=work_unit,
        volunteer=user,
        blob=blob,
        samples=work_unit.count,
        loss=loss if accepted else None,
        compute_ms=max(0, compute_ms),
        reason=reason,
        status=Result.Status.ACCEPTED if accepted else Result.Status.REJECTED,
    )
    # A rejected slice must still be computed by someone: expire it so the feeder reissues it.
    work_unit.status = WorkUnit.Status.DONE if accepted else WorkUnit.Status.EXPIRED
    work_unit.save(update_fields=["status"])
    if accepted:
        credit_grant(user=user, result=result, flops=work_unit.project.flops_per_sample * work_unit.count)
    return result


def _validate_update(*, work_unit: WorkUnit, samples: int, loss: float, payload: bytes) -> tuple[str, Any]:
    if samples != work_unit.count:
        return f"expected {work_unit.count} samples, got {samples}", None
    if not isinstance(loss, (int, float)) or not torch.isfinite(torch.tensor(float(loss))):
        return "loss is not a finite number", None
    try:
        update, _ = codecs.decode(payload)
    except codecs.CodecError as exc:
        return f"undecodable update: {exc}", None
    graph = project_graph(project=work_unit.project)
    reason = aggregate.check_update(update, {p.name: tuple(p.shape) for p in graph.params})
    if reason:
        return reason, None
    return "", blob_put(data=payload)


def _outcome(*, result: Result, user: User) -> ResultOutcome:
    credit = getattr(result, "credit", None)
    return ResultOutcome(
        work_unit_id=result.work_unit_id,
        accepted=result.status == Result.Status.ACCEPTED,
        reason=result.reason,
        credit_flops=credit.flops if credit else 0,
        total_credit_flops=_total_flops(user=user),
    )


def _total_flops(*, user: User) -> int:
    from workers.models import Volunteer

    return Volunteer.objects.filter(user=user).values_list("total_flops", flat=True).first() or 0


# --- evaluation -----------------------------------------------------------------------------------


def version_evaluate(*, version_id: int) -> dict[str, float]:
    """Evaluate a version on the held-out split and store the results as metrics (once per version)."""
    version = ModelVersion.objects.select_related("project__dataset", "project__graph", "weights").get(
        pk=version_id
    )
    stored = dict(version.metrics.values_list("name", "value"))
    if stored:
        return stored
    graph = project_graph(project=version.project)
    x, y = _test_split(dataset_id=version.project.dataset_id)
    values = runtime.evaluate(
        graph, version_weights(version=version), {graph.inputs[0].name: x}, {graph.targets[0].name: y}
    )
    for name, value in values.items():
        Metric.objects.get_or_create(
            version=version, name=f"test_{name}", defaults={"project": version.project, "value": value}
        )
    return {f"test_{name}": value for name, value in values.items()}


@lru_cache(maxsize=8)
def _test_split(*, dataset_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    # Shards are immutable, so caching a dataset's test split per process is safe.
    x, y = dataset_load_split(dataset=Dataset.objects.get(pk=dataset_id), split=DatasetShard.Split.TEST)
    return torch.from_numpy(x), torch.from_numpy(y)


def versions_evaluate_latest() -> list[int]:
    """Newest versions of running projects that have no metrics yet (for the periodic evaluator)."""
    latest = []
    for project in Project.objects.filter(status=Project.Status.RUNNING):
        version = project.current_version()
        if not version.metrics.exists():
            latest.append(version.pk)
    return latest
