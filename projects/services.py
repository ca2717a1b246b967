"""Projects and model versions: creation from a preset or an uploaded graph, start/pause, evaluation.

Work units and results move in lifecycle.py, updates are judged in validation.py, and new versions are
computed in training.py. Views, consumers and Celery tasks only validate input and call these functions.
"""

from __future__ import annotations

from functools import lru_cache, partial
from typing import Any

import torch
from django.conf import settings as site_settings  # `settings` is projects' training-settings argument
from django.contrib.auth.models import User
from django.db import transaction
from django.utils import timezone
from django.utils.translation import gettext_noop

from engine import codecs, runtime
from engine.flops import train_flops_per_sample
from engine.graph import Graph, GraphError, TensorSpec, graph_to_json, infer_shapes, load_graph
from engine.presets import export_preset
from projects import notify, stages
from projects.blobs import blob_put, blob_put_tensors
from projects.datasets import dataset_load_split
from projects.lifecycle import work_units_cancel
from projects.models import (
    DEFAULT_MAX_ACTIVATION_MB,
    Baseline,
    Blob,
    Dataset,
    DatasetShard,
    Metric,
    ModelVersion,
    Project,
    WorkUnit,
)

Tensors = dict[str, torch.Tensor]

TRAINING_SETTINGS = (
    "mode",
    "codec",
    "weights_codec",
    "weights_delta_codec",
    "aggregator",
    "learning_rate",
    "momentum",
    "weight_decay",
    "local_learning_rate",
    "local_momentum",
    "local_batch_size",
    "batch_size",
    "round_samples",
    "round_timeout",
    "staleness_bound",
    "target_seconds",
    "spot_check_rate",
    "spot_check_by",
    "trust_threshold",
    "max_versions",
    "device_memory_mb",
    "pipeline_stages",
    "micro_batches",
    "activation_codec",
    "pipeline_ring",
    "target_metric",
    "target_value",
)


# Losses that fit float targets (datasets of kind "regression"): they compare the output with the target.
REGRESSION_LOSSES = ("mse", "l1")


class ProjectError(ValueError):
    """A project cannot be created or changed as asked; the message is shown to the researcher."""


# --- projects -------------------------------------------------------------------------------------


def project_create(
    *,
    owner: User,
    name: str,
    dataset: Dataset,
    preset: str,
    description: str = "",
    settings: dict[str, Any] | None = None,
    max_activation_mb: int = DEFAULT_MAX_ACTIVATION_MB,
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
        max_activation_mb=max_activation_mb,
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
    max_activation_mb: int = DEFAULT_MAX_ACTIVATION_MB,
) -> Project:
    graph = _graph_for_dataset(graph_dict=graph_dict, dataset=dataset, max_activation_mb=max_activation_mb)
    with transaction.atomic():
        project = Project.objects.create(
            owner=owner,
            name=name,
            description=description,
            dataset=dataset,
            preset=preset,
            max_activation_mb=max_activation_mb,
            graph=blob_put(data=graph_to_json(graph), content_type="application/json"),
            flops_per_sample=train_flops_per_sample(graph),
            **{key: value for key, value in (settings or {}).items() if key in TRAINING_SETTINGS},
        )
        _memory_check(project=project)
        version_publish(project=project, number=0, weights=weights, momentum={})
        baseline_schedule(project=project)
    return project


def _graph_for_dataset(*, graph_dict: dict[str, Any], dataset: Dataset, max_activation_mb: int) -> Graph:
    try:
        graph = load_graph(graph_dict, max_activation_bytes=max_activation_mb * 2**20)
    except GraphError as exc:
        raise ProjectError(f"Invalid model graph: {exc}") from exc
    problem = graph_mismatch(
        graph=graph,
        input_shape=list(dataset.input_shape),
        num_classes=dataset.num_classes,
        kind=dataset.kind,
        target_shape=list(dataset.target_shape),
    )
    if problem:
        raise ProjectError(problem)
    return graph


def graph_mismatch(
    *,
    graph: Graph,
    input_shape: list[int],
    num_classes: int,
    kind: str = Dataset.Kind.CLASSES,
    target_shape: list[int] | None = None,
) -> str | None:
    """Why a dataset cannot train `graph` (None if it can). The dataset's kind decides the loss: class labels
    (one int64 label per sample) and token sequences (one next-token label per position) need cross_entropy;
    float targets have no classes, so they need a regression loss (mse or l1) on float32 targets of their
    shape, and cross_entropy would read them as labels. The sample shape and input dtype (int64 token ids
    for tokens, float32 otherwise) must match, and the output must cover every class or token."""
    return (
        _input_mismatch(graph, input_shape, kind)
        or _target_mismatch(graph, kind, list(target_shape or []))
        or _output_mismatch(graph, kind, num_classes, list(target_shape or []))
    )


def _loss_target(graph: Graph) -> TensorSpec:
    name = graph.loss.inputs[1]
    return next((t for t in graph.targets if t.name == name), graph.targets[0])


def _input_mismatch(graph: Graph, input_shape: list[int], kind: str) -> str | None:
    sample_shape = list(graph.inputs[0].shape[1:])
    if sample_shape != list(input_shape):
        return f"The graph expects samples of shape {sample_shape}; the dataset has {list(input_shape)}."
    dtype = "int64" if kind == Dataset.Kind.TOKENS else "float32"
    if graph.inputs[0].dtype != dtype:
        what = "token ids" if kind == Dataset.Kind.TOKENS else "float32 values"
        return f"The graph's input is {graph.inputs[0].dtype}; the dataset's samples are {what} ({dtype})."
    return None


def _target_mismatch(graph: Graph, kind: str, target_shape: list[int]) -> str | None:
    target, loss = _loss_target(graph), graph.loss.op
    shape = [-1, *target_shape]
    if kind == Dataset.Kind.REGRESSION:
        if loss not in REGRESSION_LOSSES or target.dtype != "float32" or list(target.shape) != shape:
            return (
                "The dataset has float targets and no classes: the graph needs an mse or l1 loss on float32 "
                f"targets of shape {shape}."
            )
        return None
    if loss != "cross_entropy" or target.dtype != "int64" or list(target.shape) != shape:
        if kind == Dataset.Kind.TOKENS:
            return (
                "The graph needs a cross_entropy loss on one next-token label per position (int64 targets "
                f"of shape {shape}), like text datasets have."
            )
        return "The graph needs a cross_entropy loss on one class label per sample, like .npz datasets have."
    return None


def _output_mismatch(graph: Graph, kind: str, num_classes: int, target_shape: list[int]) -> str | None:
    output = list(infer_shapes(graph, batch=1)[graph.output][1:])
    if kind == Dataset.Kind.REGRESSION:
        if output != target_shape:
            return f"The graph outputs {output} per sample; the dataset's targets have shape {target_shape}."
        return None
    if output[:-1] != target_shape:
        return f"The graph outputs {output} per sample; the dataset needs {[*target_shape, 'classes']}."
    if kind == Dataset.Kind.TOKENS and output[-1] < num_classes:
        return f"The graph predicts {output[-1]} tokens; the dataset's vocabulary has {num_classes}."
    if output[-1] < num_classes:
        return f"The graph predicts {output[-1]} classes; the dataset has {num_classes}."
    return None


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
        open_units = WorkUnit.objects.filter(project=project, status=WorkUnit.Status.OPEN)
        work_units_cancel(work_units=list(open_units), reason="project paused")
    return project


# What a project's researcher may change once it exists (resource_share is staff's: it is no setting here).
EDITABLE_FIELDS = ("name", "description", *TRAINING_SETTINGS)


def project_update(*, project: Project, changes: dict[str, Any]) -> Project:
    """Change a project's name, description or training settings (the caller has validated the values)."""
    fields = [key for key in changes if key in EDITABLE_FIELDS]
    try:
        stages.pipeline_settings_check(project=project, changes={key: changes[key] for key in fields})
    except stages.PipelineError as exc:
        raise ProjectError(str(exc)) from None
    for key in fields:
        setattr(project, key, changes[key])
    _memory_check(project=project)
    if fields:
        project.save(update_fields=fields)
    return project


def _memory_check(*, project: Project) -> None:
    """A data-parallel mode refuses a model over the per-device memory budget, pointing to pipeline mode;
    pipeline mode refuses one it cannot cut as asked."""
    try:
        stages.project_memory_check(project=project)
    except stages.PipelineError as exc:
        raise ProjectError(str(exc)) from None


def project_delete(*, project: Project) -> None:
    """Delete a project nobody has been credited for: credit is the volunteers' record of their work, and
    it goes with the project, so a project that has any can only be paused."""
    with transaction.atomic():
        locked = Project.objects.select_for_update().get(pk=project.pk)
        if locked.credit.exists():
            raise ProjectError(
                "Volunteers have been credited for this project: pause it instead of deleting it."
            )
        if locked.status == Project.Status.RUNNING:
            project_pause(project=locked)
        locked.delete()


def project_graph(*, project: Project) -> Graph:
    return _graph_from_blob(sha256=project.graph_id, max_activation_bytes=project.max_activation_bytes)


@lru_cache(maxsize=32)
def _graph_from_blob(*, sha256: str, max_activation_bytes: int) -> Graph:
    # Graph blobs are immutable and content-addressed: validation, spot checks and aggregation all need the
    # parsed graph, so parse (and shape-check) each one once per process instead of once per call.
    # The project's activation bound applies here too: no task ever runs a graph too large for it.
    return load_graph(Blob.objects.get(pk=sha256).read(), max_activation_bytes=max_activation_bytes)


# --- the one-CPU baseline (trained in baseline.py) -----------------------------------------------


def baseline_schedule(*, project: Project) -> Baseline:
    """Queue the project's time-to-accuracy baseline on the low-priority `baseline` queue, or record why it
    is skipped. Once per project. The task is queued after commit and a lost message (broker down while
    demo projects are seeded) is queued again by the beat's queue_baselines."""
    existing = Baseline.objects.filter(project=project).first()
    if existing is not None:
        return existing
    reason = baseline_skip_reason(project=project)
    baseline = Baseline.objects.create(
        project=project,
        status=Baseline.Status.SKIPPED if reason else Baseline.Status.PENDING,
        reason=reason or "",
        budget_seconds=site_settings.CROWDTRAIN["BASELINE_SECONDS"],
        budget_samples=site_settings.CROWDTRAIN["BASELINE_SAMPLES"],
        queued_at=None if reason else timezone.now(),
    )
    if not reason:
        transaction.on_commit(partial(notify.baseline_wanted, project_id=project.pk), robust=True)
    return baseline


def baseline_skip_reason(*, project: Project) -> str | None:
    bound = site_settings.CROWDTRAIN["BASELINE_MAX_FLOPS_PER_SAMPLE"]
    if site_settings.CROWDTRAIN["BASELINE_SECONDS"] <= 0 or site_settings.CROWDTRAIN["BASELINE_SAMPLES"] <= 0:
        return gettext_noop("The one-CPU baseline is turned off on this server.")  # translated when shown
    if project.flops_per_sample > bound:
        return (
            f"Not run: a training sample costs {project.flops_per_sample:,} FLOPs, over this server's bound "
            f"of {bound:,} for the one-CPU baseline."
        )
    return None


# --- versions -------------------------------------------------------------------------------------


def version_publish(
    *,
    project: Project,
    number: int,
    weights: Tensors,
    momentum: Tensors,
    train_loss: float | None = None,
    samples: int = 0,
    weights_blob: Blob | None = None,
) -> ModelVersion:
    """`weights_blob`: the weights already stored (training._step_stored); empty `momentum`: no optimizer
    state stored with the version (none, or stored later: training._keep)."""
    # Hashed and written from the tensors' own memory, never joined into bytes (tens of MB for a ResNet).
    weights_blob = weights_blob or blob_put_tensors(tensors=weights)
    state_blob = blob_put_tensors(tensors=momentum) if momentum else None
    return ModelVersion.objects.create(
        project=project,
        number=number,
        weights=weights_blob,
        optimizer_state=state_blob,
        train_loss=train_loss,
        samples=samples,
        **_wire(project=project, number=number, weights=weights),
    )


def _wire(*, project: Project, number: int, weights: Tensors) -> dict[str, Any]:
    """The version's fields for what volunteers download: the weights in the project's weights_codec (None:
    the fp32 weights themselves), or with a weights_delta_codec, the delta from the previous version's and
    the weights it builds (stored whole, in fp32, for volunteers who hold no earlier version)."""
    codec, delta_codec = project.weights_codec, project.weights_delta_codec
    previous = _delta_base(project=project, number=number) if delta_codec else None
    if previous is None:
        wire = blob_put_tensors(tensors=weights, codec=codec) if codec != Project.WeightsCodec.FP32 else None
        return {"wire_weights": wire}
    data, held = codecs.weights_delta(version_wire_weights(version=previous), weights, delta_codec)
    base = previous.wire_blob.sha256
    return {
        "wire_weights": blob_put_tensors(tensors=held),
        "wire_delta": blob_put(data=data),
        "wire_base": base,
    }


def _delta_base(*, project: Project, number: int) -> ModelVersion | None:
    """The version a delta to version `number` starts from; none for pipeline projects (stage units carry
    their own stage's weights) or once its weights are pruned."""
    if project.is_pipeline or number == 0:
        return None
    previous = project.versions.filter(number=number - 1).select_related("weights", "wire_weights").first()
    return None if previous is None or previous.is_pruned else previous


def version_rewire(*, version: ModelVersion) -> None:
    """What volunteers download of `version` derived again from its project's codecs as they are now: for a
    project whose columns were set after its version 0 was published (the scaling benchmark's template)."""
    fields = _wire(project=version.project, number=version.number, weights=version_weights(version=version))
    ModelVersion.objects.filter(pk=version.pk).update(
        wire_weights=fields["wire_weights"],
        wire_delta=fields.get("wire_delta"),
        wire_base=fields.get("wire_base", ""),
    )


def version_weights(*, version: ModelVersion) -> Tensors:
    return codecs.decode(version.weights_blob.read())[0]


def version_wire_weights(*, version: ModelVersion) -> Tensors:
    """The weights exactly as volunteers decode them: what an honest update was computed from."""
    return codecs.decode(version.wire_blob.read())[0]


# --- evaluation -----------------------------------------------------------------------------------


def version_evaluate(*, version_id: int) -> dict[str, float]:
    """Evaluate a version on the held-out split and store the results as metrics (once per version)."""
    version = ModelVersion.objects.select_related("project__dataset", "project__graph", "weights").get(
        pk=version_id
    )
    stored = dict(version.metrics.values_list("name", "value"))
    if stored or version.is_pruned:
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
