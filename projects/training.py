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

Publishing is on the volunteers' critical path, so it does only what they need: the step runs in a thread
tensor by tensor while the new weights are hashed (SHA-256: blobs are content-addressed), and that thread
then writes them (blobs.blob_put_computed); then the version's row commits and is announced. The optimizer
state, which only the next step reads, is stored after that by a thread of its own (_keep); the next step in
this process waits for it, and one in another process that finds it missing (the publisher died first)
recomputes it from the two versions' weights (_state_recovered).
"""

from __future__ import annotations

import logging
import math
import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from functools import partial

import torch
from django.conf import settings
from django.db import connection, transaction
from django.db.models import Q, QuerySet, Sum
from django.utils import timezone

from engine import aggregate, codecs, optim
from projects import notify, pipeline
from projects.blobs import blob_put_computed, blob_put_tensors, blob_read_buffer, blob_view
from projects.lifecycle import (
    VALIDATION_GIVE_UP_SECONDS,
    results_announce,
    work_units_cancel,
    work_units_feed,
)
from projects.models import Blob, ModelVersion, Project, Result, WorkUnit
from projects.services import project_graph, version_publish

Tensors = dict[str, torch.Tensor]
logger = logging.getLogger(__name__)
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
    results = [r for r in _pending(project=project, current=current) if _readable(r)]
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


def _readable(result: Result) -> bool:
    """A valid result whose update is gone (released by storage.py) cannot be folded in: it is left out of
    the round, which must not stall on it."""
    if result.blob_id is None:
        logger.error("result %s is valid and not aggregated but its update is gone; left out", result.pk)
    return result.blob_id is not None


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
    samples = _round_samples(project=project, current=current)
    return samples > 0 and _round_complete(project=project, current=current, samples=samples)


def _round_samples(*, project: Project, current: ModelVersion) -> int:
    """The round's valid samples: counted on its version by each verdict, except when rounds overlap, where
    the version before also holds results of the round before (one sum over the round's results)."""
    if not project.rounds_overlap:
        return current.valid_samples
    return _pending_results(project=project, current=current).aggregate(n=Sum("samples"))["n"] or 0


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
        results = results.filter(_round_units(project=project, current=current))
    return results


def _round_units(*, project: Project, current: ModelVersion) -> Q:
    """Results of the work units that make the round on `current`: those on `current`, and when rounds
    overlap (Project.rounds_overlap) those on earlier versions within the staleness bound, still in flight
    when their rounds closed (a unit takes about a round, so mostly the version before)."""
    if not project.rounds_overlap:
        return Q(work_unit__version=current)
    oldest = current.number - project.staleness_bound
    return Q(work_unit__project=project, work_unit__version__number__gt=oldest)


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
    return (target_met or expired) and not _awaiting_validation(project=project, current=current)


def round_close_samples(*, project: Project, current: ModelVersion) -> int:
    """The valid samples that complete the round on `current`. A crowd-sized averaging round closes at
    CROWD_CLOSE_SHARE of the samples it planned (Hivemind's target batch): its devices' units end together
    by design (Project.unit_seconds), and the last few percent (devices that lost seconds downloading, a
    leaver's unit sent again) would keep every device of the round waiting; what is still out is cancelled."""
    target = current.round_target or project.round_samples
    if project.crowd_averaging and current.round_target:
        return math.ceil(CROWD_CLOSE_SHARE * target)
    return target


def _awaiting_validation(*, project: Project, current: ModelVersion) -> bool:
    # Results that passed their checks and wait for a replica do not hold the round: the replica may never
    # come. Closing the round cancels them as late. Nor do results the server has failed to judge for
    # VALIDATION_GIVE_UP_SECONDS (the transitioner gives them up), so a round always closes in the end.
    recent = timezone.now() - timedelta(seconds=VALIDATION_GIVE_UP_SECONDS)
    return Result.objects.filter(
        _round_units(project=project, current=current),
        status=Result.Status.RECEIVED,
        validation=Result.Validation.PENDING,
        checked=False,
        received_at__gte=recent,
    ).exists()


def _publish(*, project: Project, current: ModelVersion, results: list[Result]) -> ModelVersion:
    weights = [_weight(project=project, current=current, result=r) for r in results]
    update, buffers = _combine(project=project, updates=_updates(results), weights=weights)
    if project.mode == Project.Mode.ASYNC_SGD:
        # Staleness weights shrink the step, not only the mix: a lone stale update moves the model less.
        samples = sum(r.samples for r in results)
        update = {name: value.mul_(sum(weights) / samples) for name, value in update.items()}
    return _version_next(project=project, current=current, update=update, buffers=buffers, results=results)


def _version_next(
    *, project: Project, current: ModelVersion, update: Tensors, buffers: Tensors, results: list[Result]
) -> ModelVersion:
    """The version after `current` from its round's combined `update` and `buffers`, in the caller's
    transaction: the step, the weights stored, `results` marked aggregated and the version's row (what the
    aggregation benchmark times as a publish)."""
    samples = sum(r.samples for r in results)
    params, state, blob = _step_stored(project=project, version=current, update=update, buffers=buffers)
    Result.objects.filter(pk__in=[r.pk for r in results]).update(aggregated=True)
    version = version_publish(
        project=project,
        number=current.number + 1,
        weights=params,
        weights_blob=blob,
        momentum={},  # stored once the version is out (_keep): only the next step needs it
        train_loss=sum((r.loss or 0.0) * r.samples for r in results) / samples,
        samples=samples,
    )
    transaction.on_commit(partial(_keep, version=version, weights=params, state=state))
    return version


def _updates(results: list[Result]) -> Iterator[codecs.Packed]:
    """Each result's update, parsed (not decoded) when it is folded in and dropped after."""
    for result in results:
        if result.blob:
            yield codecs.parse(blob_view(blob=result.blob))


def _weight(*, project: Project, current: ModelVersion, result: Result) -> float:
    # Overlapping rounds fold a delta one version stale at full weight, as DiLoCo's delayed outer step does:
    # there, that is every unit's staleness.
    staleness = current.number - result.work_unit.version.number - project.rounds_overlap
    return result.samples * (project.staleness_weight(staleness=staleness) if staleness > 0 else 1.0)


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
    own, see _owned); `update` is spent. (_step_stored is the same step, tensor by tensor.)"""
    weights, state = _owned(version=version)
    _server_step(project=project, weights=weights, state=state, grads=update)
    return weights, state


def _server_step(*, project: Project, weights: Tensors, state: Tensors, grads: Tensors) -> None:
    """The project's optimizer on `grads` (all of the model's tensors or some: per tensor, the same
    operations, so stepping them one by one is bit-exact with stepping them together)."""
    optim.server_step_(
        weights,
        grads,
        state,
        averaging=project.mode == Project.Mode.AVERAGING,
        lr=project.learning_rate,
        momentum=project.momentum,
        weight_decay=project.weight_decay,
    )


def _step_stored(
    *, project: Project, version: ModelVersion, update: Tensors, buffers: Tensors
) -> tuple[Tensors, Tensors, Blob]:
    """_step, and the next version's weights (with the round's `buffers`) stored as they come: a thread
    steps the tensors in the order of the blob's bytes while this one hashes each stepped tensor, and then
    writes them (blobs.blob_put_computed), so a publish costs about the hash of the weights rather than
    step + hash + write."""
    weights, state = _owned(version=version)
    weights.update(buffers)
    header, named = codecs.encode_fp32_named(weights)
    if unknown := set(update) - set(weights):
        raise KeyError(f"an update for tensors the model does not have: {sorted(unknown)[:5]}")

    def stepped() -> Iterator[memoryview]:
        yield header
        for name, piece in named:
            if name in update:
                _server_step(project=project, weights=weights, state=state, grads={name: update.pop(name)})
            yield piece

    return weights, state, blob_put_computed(pieces=stepped())


@dataclass
class _Kept:
    """What this process published last for a project: the weights and optimizer state, and the thread
    storing that state (which reads it: the next step waits for it before changing the state)."""

    version_id: int
    weights_id: str | None
    weights: Tensors
    state: Tensors
    saver: threading.Thread | None


_published: OrderedDict[int, _Kept] = OrderedDict()
_published_lock = threading.Lock()
SAVER_NAME = "state-save"  # the threads storing optimizer states (state_saves_wait finds them by it)


def _owned(*, version: ModelVersion) -> tuple[Tensors, Tensors]:
    """The version's weights and optimizer state in memory no one else uses: as this process published them
    (taken out of _published: the step changes them) or read from their blobs."""
    with _published_lock:
        kept = _published.pop(version.project_id, None)
    if kept is not None and (kept.version_id, kept.weights_id) == (version.pk, version.weights_id):
        if kept.saver is not None:
            kept.saver.join()
        return kept.weights, kept.state
    stored = ModelVersion.objects.filter(pk=version.pk).values_list("optimizer_state", flat=True).first()
    if stored is None:
        weights = _read(blob=version.weights_blob)
        return weights, _state_missing(version=version, weights=weights)
    # One after the other: reading both 45 MB files in two threads measured slower here (111 ms against 82,
    # on a shared 2-core machine), and so did a copy-on-write mmap the step faults in (144 against 100).
    return _read(blob=version.weights_blob), _read(blob=Blob(sha256=stored))


def _read(*, blob: Blob) -> Tensors:
    return codecs.decode(blob_read_buffer(blob=blob), copy=False)[0]


def _keep(*, version: ModelVersion, weights: Tensors, state: Tensors) -> None:
    """Once the version committed (and so may be announced), store its optimizer state in a thread of its
    own, and keep what it published for this process's next step."""
    saver = None
    if state:
        saver = threading.Thread(
            target=_state_save, kwargs={"version_id": version.pk, "state": state}, name=SAVER_NAME
        )
        saver.start()
    with _published_lock:
        _published[version.project_id] = _Kept(version.pk, version.weights_id, weights, state, saver)
        _published.move_to_end(version.project_id)
        while len(_published) > PUBLISHED_KEPT:
            _published.popitem(last=False)


def state_saves_wait() -> None:
    """Wait until every optimizer state being stored is stored: the next step does so for its own version
    (_owned), and tests before their database is emptied under a saver (the flush deadlocked with it)."""
    for thread in threading.enumerate():
        if thread.name == SAVER_NAME:
            thread.join()


def _state_save(*, version_id: int, state: Tensors) -> None:
    """Store a published version's optimizer state. If this never happens (the process died first), the
    next step recomputes it from the weights (_state_recovered)."""
    try:
        _state_store(version_id=version_id, state=state)
    except Exception:
        logger.exception(
            "the optimizer state of version %s was not stored; the next step recomputes it", version_id
        )
    finally:
        connection.close()  # this thread's own connection (back to the pool)


def _state_store(*, version_id: int, state: Tensors) -> None:
    with transaction.atomic():
        blob = blob_put_tensors(tensors=state)
        # Unless stored meanwhile (a step elsewhere recovered it) or the version was pruned.
        ModelVersion.objects.filter(pk=version_id, optimizer_state=None, pruned_at=None).update(
            optimizer_state=blob
        )


def _state_missing(*, version: ModelVersion, weights: Tensors) -> Tensors:
    """The optimizer state of a version stored without one: none (no momentum, version 0, pipelines), or
    recomputed if the process that published it died before storing it (or stores it still)."""
    project = version.project
    if not project.momentum or version.number == 0 or project.is_pipeline:
        return {}
    return _state_recovered(project=project, version=version, weights=weights)


def _state_recovered(*, project: Project, version: ModelVersion, weights: Tensors) -> Tensors:
    """The momentum the step to `version` left, recomputed from the weights it started from and the ones
    it published (equal up to float32 rounding), then stored; if those are gone, momentum starts afresh
    (as torch's SGD does on its first step)."""
    previous = ModelVersion.objects.filter(project=project, number=version.number - 1).first()
    if previous is None or previous.weights is None:
        logger.warning(
            "version %s: no optimizer state and no previous weights; momentum restarts", version.pk
        )
        return {}
    prior = _read(blob=previous.optimizer_state) if previous.optimizer_state else {}
    names = [p.name for p in project_graph(project=project).params]
    state = optim.momentum_recovered(
        _read(blob=previous.weights),
        weights,
        prior,
        names,
        nesterov=project.mode == Project.Mode.AVERAGING,
        lr=project.learning_rate,
        momentum=project.momentum,
    )
    logger.warning("version %s: optimizer state recomputed from its weights", version.pk)
    _state_store(version_id=version.pk, state=state)
    return state


def _cancel_stale(*, project: Project, version: ModelVersion) -> None:
    stale = WorkUnit.objects.filter(
        project=project, status=WorkUnit.Status.OPEN, version__number__lt=version.number
    )
    if project.mode == Project.Mode.ASYNC_SGD or project.rounds_overlap:
        # In async mode and overlapping rounds (_round_units) work in flight stays useful until the staleness
        # bound; only unsent work is renewed.
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
