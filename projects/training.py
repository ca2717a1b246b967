"""Server-side training: turn valid updates into the next model version, as the project's mode says.

- sync_sgd: a round closes once `round_samples` valid samples arrived (or at `round_timeout` with what
  arrived) and every result received meanwhile was judged; gradients are aggregated and one server
  optimizer step (SGD with momentum) is taken.
- averaging: the same rounds, but updates are deltas of local training; their average is the
  pseudo-gradient of an outer Nesterov step (DiLoCo).
- async_sgd: whatever valid updates arrived are applied at once, each weighted by 1/(1 + staleness).
Stale work is cancelled when a version is published, so a straggler's result can never be applied twice.
Only each work unit's canonical result is aggregated: when a slice was replicated to check a volunteer
(validation.py), its samples count once and its update is averaged once, however many results agreed.

A round's updates are streamed (aggregate.WeightedSum): each is read from its blob and folded into one sum,
int8 values dequantized straight into it, so a round holds one update's memory however many it has and no
update is decoded into a float copy. Medians and trimmed means need every update at once: those rounds
decode them all. The step then changes the current weights and optimizer state in place: the ones this
process published last if it has them (_published), else read into memory of its own.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from datetime import timedelta
from functools import partial

import torch
from django.conf import settings
from django.db import transaction
from django.db.models import QuerySet
from django.utils import timezone

from engine import aggregate, codecs, optim
from projects import notify, pipeline
from projects.blobs import blob_read_buffer, blob_view
from projects.lifecycle import (
    VALIDATION_GIVE_UP_SECONDS,
    results_announce,
    work_units_cancel,
    work_units_feed,
)
from projects.models import Blob, ModelVersion, Project, Result, WorkUnit
from projects.services import project_graph, version_publish

Tensors = dict[str, torch.Tensor]
TRIM = 0.2
# Projects whose last published weights and optimizer state this process keeps for its next step (a
# ResNet-18's are 90 MB): with several workers, a step on another process's version reads them instead.
PUBLISHED_KEPT = 2
# Of a crowd-sized averaging round's planned samples (round_close_samples). 0.8 measured no better at 32 and
# 64 volunteers (scaling-heterogeneous: 26.2x and 46.5x against 25.1x and 47.4x) and wastes more work.
CROWD_CLOSE_SHARE = 0.9


def project_step(*, project_id: int) -> ModelVersion | None:
    """Publish the next version if the current round is complete."""
    with transaction.atomic():
        project = Project.objects.select_for_update(no_key=True).get(pk=project_id)
        current = project.current_version()
        version = _close_round(project=project, current=current)
        if version is None:
            return None
        _cancel_stale(project=project, version=version)
        if version.number >= project.max_versions:
            project.status = Project.Status.FINISHED
            project.save(update_fields=["status"])
        # The next round's work now, not in a task of its own: volunteers are waiting for it.
        work_units_feed(project_id=project_id)
    transaction.on_commit(partial(_version_announce, version=version))
    return version


def _close_round(*, project: Project, current: ModelVersion) -> ModelVersion | None:
    """The next version if the round (the step, in pipeline mode) on `current` is complete, else None."""
    if project.is_pipeline:
        return pipeline.step_publish(project=project, current=current)
    _hold_arrivals(project=project, current=current)
    results = list(_pending(project=project, current=current))
    samples = sum(r.samples for r in results)
    if not results or not _round_complete(project=project, current=current, samples=samples):
        return None
    return _publish(project=project, current=current, results=results)


def _hold_arrivals(*, project: Project, current: ModelVersion) -> None:
    """Lock the round's instances still out before judging whether the round is complete. result_receive
    holds an arriving result's row while it stores it: the step now waits for that arrival and then for its
    verdict, or locks first and cancels it (the result is then late, never received). Without this a step
    could close the round under a result received on time and leave it unjudged."""
    if project.mode == Project.Mode.ASYNC_SGD:
        return
    out = Result.objects.filter(work_unit__version=current, status=Result.Status.IN_PROGRESS)
    list(out.select_for_update(no_key=True, of=("self",)).order_by("pk").values_list("pk", flat=True))


def _version_announce(*, version: ModelVersion) -> None:
    notify.work_available()  # the step fed the next round in its transaction: volunteers may ask for it
    if version.number % settings.CROWDTRAIN["EVAL_EVERY_VERSIONS"] == 0:
        notify.evaluation_wanted(version_id=version.pk)


def results_decided(*, result_ids: list[int]) -> None:
    """After verdicts committed: tell their volunteers, and queue the step of each project whose round they
    completed. Any verdict, valid or not, may be the one its round waited for (a round closes only once every
    result received during it is judged, see _round_complete)."""
    if not result_ids:
        return
    results_announce(result_ids=result_ids)
    projects = WorkUnit.objects.filter(results__pk__in=result_ids).values_list("project_id", flat=True)
    for project_id in sorted(set(projects)):
        if round_ready(project_id=project_id):
            notify.step_wanted(project_id=project_id)


def round_ready(*, project_id: int) -> bool:
    """Would project_step publish now? Asked after every verdict, so that only the verdict completing a
    round queues the (locking) step, not all of them. The same work whatever the round's size: the round's
    valid samples are counted on its version by each verdict (validation._settle), and the other questions
    are an indexed EXISTS each (async: any update waiting; rounds: any result still being judged)."""
    project = Project.objects.get(pk=project_id)
    current = project.current_version()
    if project.is_pipeline:
        return pipeline.step_complete(project=project, current=current)
    if project.mode == Project.Mode.ASYNC_SGD:
        return _pending_results(project=project, current=current).exists()
    samples = current.valid_samples
    return samples > 0 and _round_complete(project=project, current=current, samples=samples)


def _pending(*, project: Project, current: ModelVersion) -> list[Result]:
    results = _pending_results(project=project, current=current).select_related("blob", "work_unit__version")
    return list(results.order_by("pk"))


def _pending_results(*, project: Project, current: ModelVersion) -> QuerySet[Result]:
    results = Result.objects.filter(
        work_unit__project=project,
        validation=Result.Validation.VALID,
        aggregated=False,
        status=Result.Status.RECEIVED,
        canonical_for__isnull=False,
    )
    if project.mode != Project.Mode.ASYNC_SGD:
        results = results.filter(work_unit__version=current)
    return results


def _round_complete(*, project: Project, current: ModelVersion, samples: int) -> bool:
    """`samples`: the round's valid samples (canonical results only)."""
    if project.mode == Project.Mode.ASYNC_SGD:
        return True
    target_met = samples >= round_close_samples(project=project, current=current)
    expired = timezone.now() - current.created_at >= timedelta(seconds=project.round_timeout)
    # Every result received while the round was open is judged before it closes, whether the round met its
    # target or timed out: closing first would cancel them as "late" (no credit, no verdict on their merits)
    # although they were on time, and which verdict a result got would depend on which worker ran first.
    # Each decision asks for the step again, and the wait is bounded (_awaiting_validation).
    return (target_met or expired) and not _awaiting_validation(current)


def round_close_samples(*, project: Project, current: ModelVersion) -> int:
    """The valid samples that complete the round on `current`. A crowd-sized averaging round closes at
    CROWD_CLOSE_SHARE of the samples it planned (Hivemind's target batch): its devices' units end together
    by design (Project.unit_seconds), and the last few percent (devices that lost seconds downloading, a
    leaver's unit sent again) would keep every device of the round waiting; what is still out is cancelled."""
    target = current.round_target or project.round_samples
    if project.crowd_rounds and project.mode == Project.Mode.AVERAGING and current.round_target:
        return math.ceil(CROWD_CLOSE_SHARE * target)
    return target


def _awaiting_validation(current: ModelVersion) -> bool:
    # Results that passed their checks and wait for a replica do not hold the round: the replica may never
    # come. Closing the round cancels them as late. Nor do results the server has failed to judge for
    # VALIDATION_GIVE_UP_SECONDS (the transitioner gives them up), so a round always closes in the end.
    recent = timezone.now() - timedelta(seconds=VALIDATION_GIVE_UP_SECONDS)
    return Result.objects.filter(
        work_unit__version=current,
        status=Result.Status.RECEIVED,
        validation=Result.Validation.PENDING,
        checked=False,
        received_at__gte=recent,
    ).exists()


def _publish(*, project: Project, current: ModelVersion, results: list[Result]) -> ModelVersion:
    weights = [_weight(project=project, current=current, result=r) for r in results]
    update, buffers = _combine(project=project, updates=_updates(results), weights=weights)
    samples = sum(r.samples for r in results)
    if project.mode == Project.Mode.ASYNC_SGD:
        # Staleness weights shrink the step, not only the mix: a lone stale update moves the model less.
        update = {name: value.mul_(sum(weights) / samples) for name, value in update.items()}
    params, state = _step(project=project, version=current, update=update)
    Result.objects.filter(pk__in=[r.pk for r in results]).update(aggregated=True)
    version = version_publish(
        project=project,
        number=current.number + 1,
        weights={**params, **buffers},
        momentum=state,
        train_loss=sum((r.loss or 0.0) * r.samples for r in results) / samples,
        samples=samples,
    )
    transaction.on_commit(partial(_keep, version=version, weights={**params, **buffers}, state=state))
    return version


def _updates(results: list[Result]) -> Iterator[codecs.Packed]:
    """Each result's update, parsed (not decoded) when it is folded in and dropped after."""
    for result in results:
        if result.blob:
            yield codecs.parse(blob_view(blob=result.blob))


def _weight(*, project: Project, current: ModelVersion, result: Result) -> float:
    staleness = current.number - result.work_unit.version.number
    return result.samples * (project.staleness_weight(staleness=staleness) if staleness else 1.0)


def _combine(
    *, project: Project, updates: Iterable[Tensors | codecs.Packed], weights: Sequence[float]
) -> tuple[Tensors, Tensors]:
    """The round's update as the project aggregates them, and the weighted mean of the trained buffers over
    the updates that report them all (the others keep the current version's values, see _step)."""
    graph = project_graph(project=project)
    names, buffer_names = [p.name for p in graph.params], graph.trained_buffers()
    if _robust(project=project, count=len(weights)):
        return _combine_decoded(
            project=project, updates=updates, weights=weights, names=names, buffer_names=buffer_names
        )
    params, buffers = aggregate.WeightedSum(names), aggregate.WeightedSum(buffer_names)
    for update, weight in zip(updates, weights, strict=True):
        params.add(update, weight)
        if buffer_names and all(name in update for name in buffer_names):
            buffers.add(update, weight)
    return params.mean(), buffers.mean() if buffers.count else {}


def _robust(*, project: Project, count: int) -> bool:
    robust = (Project.Aggregator.MEDIAN, Project.Aggregator.TRIMMED_MEAN)
    return project.aggregator in robust and count >= 3


def _combine_decoded(
    *,
    project: Project,
    updates: Iterable[Tensors | codecs.Packed],
    weights: Sequence[float],
    names: list[str],
    buffer_names: list[str],
) -> tuple[Tensors, Tensors]:
    """_combine for medians and trimmed means, which need every update at once: each is decoded (the
    round then holds all of them, as float32)."""
    decoded = [
        {name: update[name] for name in [*names, *buffer_names] if name in update} for update in updates
    ]
    combined = _aggregate(
        project=project, updates=[{n: u[n] for n in names} for u in decoded], weights=weights
    )
    pairs = [(u, w) for u, w in zip(decoded, weights, strict=True) if all(n in u for n in buffer_names)]
    if not buffer_names or not pairs:
        return combined, {}
    return combined, aggregate.weighted_mean(
        [{n: u[n] for n in buffer_names} for u, _ in pairs], [w for _, w in pairs]
    )


def _aggregate(*, project: Project, updates: list[Tensors], weights: Sequence[float]) -> Tensors:
    if project.aggregator == Project.Aggregator.MEDIAN and len(updates) >= 3:
        return aggregate.coordinate_median(updates)
    if project.aggregator == Project.Aggregator.TRIMMED_MEAN and len(updates) >= 3:
        return aggregate.trimmed_mean(updates, TRIM)
    return aggregate.weighted_mean(updates, list(weights))


def _step(*, project: Project, version: ModelVersion, update: Tensors) -> tuple[Tensors, Tensors]:
    """The server's optimizer step, in place on the current weights and state (copies of this process's
    own, see _owned); `update` is spent."""
    weights, state = _owned(version=version)
    optim.server_step_(
        weights,
        update,
        state,
        averaging=project.mode == Project.Mode.AVERAGING,
        lr=project.learning_rate,
        momentum=project.momentum,
        weight_decay=project.weight_decay,
    )
    return weights, state


_published: OrderedDict[int, tuple[str | None, str | None, Tensors, Tensors]] = OrderedDict()
_published_lock = threading.Lock()


def _owned(*, version: ModelVersion) -> tuple[Tensors, Tensors]:
    """The version's weights and optimizer state in memory no one else uses: as this process published them
    (taken out of _published: the step changes them) or read from their blobs."""
    with _published_lock:
        kept = _published.pop(version.project_id, None)
    # Blobs are addressed by content: the same names are the same bytes.
    if kept is not None and kept[:2] == (version.weights_id, version.optimizer_state_id):
        return kept[2], kept[3]
    state = _read(blob=version.optimizer_state) if version.optimizer_state else {}
    return _read(blob=version.weights_blob), state


def _read(*, blob: Blob) -> Tensors:
    return codecs.decode(blob_read_buffer(blob=blob), copy=False)[0]


def _keep(*, version: ModelVersion, weights: Tensors, state: Tensors) -> None:
    """Once the version committed, keep what it published for this process's next step."""
    with _published_lock:
        _published[version.project_id] = (version.weights_id, version.optimizer_state_id, weights, state)
        _published.move_to_end(version.project_id)
        while len(_published) > PUBLISHED_KEPT:
            _published.popitem(last=False)


def _cancel_stale(*, project: Project, version: ModelVersion) -> None:
    stale = WorkUnit.objects.filter(
        project=project, status=WorkUnit.Status.OPEN, version__number__lt=version.number
    )
    if project.mode == Project.Mode.ASYNC_SGD:
        # In async mode work in flight stays useful until the staleness bound; only unsent work is renewed.
        bound = version.number - project.staleness_bound
        stale = stale.filter(total_results=0) | stale.filter(version__number__lte=bound)
    work_units_cancel(work_units=list(stale), reason="a new model version was published")


def rounds_close_expired() -> list[int]:
    """Close rounds past their timeout with the valid results they have (stragglers are cancelled)."""
    cutoff = timezone.now()
    closed = []
    for project in Project.objects.filter(status=Project.Status.RUNNING).exclude(mode=Project.Mode.ASYNC_SGD):
        current = project.current_version()
        if cutoff - current.created_at >= timedelta(seconds=project.round_timeout) and project_step(
            project_id=project.pk
        ):
            closed.append(project.pk)
    return closed
