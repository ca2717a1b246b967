"""Validation and trust: is a received update what an honest volunteer would have sent?

Every update gets cheap checks of its own (names, shapes, finite values, sample count, replays, norm
outliers). Volunteers are not trusted until they return `trust_threshold` valid results in a row; until then
every update is spot-checked, and afterwards a random `spot_check_rate` share still is (BOINC's adaptive
replication). A project spot-checks one of two ways (`Project.spot_check_by`):

- "server" (the default): the update is recomputed on the server with engine/ and must match it, within
  the codec's tolerance (statistically for graphs with dropout). Which work units are checked is drawn
  when they are sent (lifecycle.work_unit_assign sets `spot_check`), and the server computes their update
  (`reference`) right away, while the volunteer computes: validating the result is then a comparison, off
  the round's critical path. A result whose volunteer lost its trust in the meantime is checked too.
- "replica": the work unit goes to a second volunteer as well (decided when it is sent, in
  lifecycle.work_unit_assign, which raises its target_results and min_quorum to 2). Its results stay
  pending after their own checks until `min_quorum` of them passed those; then they are compared with each
  other under the same tolerances. The first result agreeing with a quorum becomes the work unit's
  canonical result; results agreeing with it are valid, the others invalid. Without a quorum one more
  instance is sent, until `max_total_results` (then the work unit is errored and its samples fed anew).

A result whose judging raises (a crafted header, an overflowing number, anything the checks did not
foresee) is invalid, so no upload can stall its round; a failure of the server's own (database, broker,
disk) is retried instead, and given up without penalty after lifecycle.VALIDATION_GIVE_UP_SECONDS.

Only canonical results are aggregated (training.py): a replicated slice counts once. A result that arrives
after its work unit was decided is judged against the canonical result but never aggregated. Valid results
earn credit from server-side FLOPs, each of them; invalid ones earn nothing and reset trust.

An update's own checks read its blob without decoding it (codecs.Packed: names and shapes from the header,
finite values from its int8 scales, the norm from the int8 values a chunk at a time); it is decoded only to
be compared with a reference (spot checks, replicas). Aggregation then folds the same bytes into the round's
sum (training.py), so an update nobody compares is dequantized once, there.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from statistics import median
from typing import TypeVar

import kombu.exceptions
import redis.exceptions
import torch
from django.db import InterfaceError, OperationalError, transaction
from django.db.models import F, Q, QuerySet
from django.utils import timezone

from config.bulk import bulk_write
from engine import codecs
from engine.aggregate import check_update
from engine.graph import Graph
from engine.runtime import compute_gradients, local_steps
from projects import notify, pipeline, ring, stages, swarms
from projects.blobs import blob_put, blob_view
from projects.datasets import slices_load, work_unit_slices
from projects.lifecycle import result_invalidate, result_reject, results_abandon, results_awaiting_quorum
from projects.models import ModelVersion, Project, Result, WorkUnit
from projects.services import project_graph, version_wire_weights
from workers.models import Volunteer
from workers.services import Grant, credit_lock, credits_grant, volunteer_ensure

Tensors = Mapping[str, torch.Tensor]  # decoded tensors, or a codecs.Packed blob that decodes on access
logger = logging.getLogger(__name__)
M = TypeVar("M", Result, WorkUnit)
# The server's own failures, not the result's: judging is retried (tasks.validate_result), and a result
# still undecided after lifecycle.VALIDATION_GIVE_UP_SECONDS is given up without penalty. OSError covers a
# blob file missing or unreadable on disk.
INFRASTRUCTURE_ERRORS: tuple[type[BaseException], ...] = (
    OperationalError,
    InterfaceError,
    redis.exceptions.RedisError,
    kombu.exceptions.OperationalError,
    OSError,
)
# int4 (7 levels a block) with error feedback: a plain int4 update is ~0.13 from the true one (engine tests),
# the residual carried adds to that.
INT4_TOLERANCE = 0.5
# Measured (benchmarks/scaling/bytes.py's sent_vs_true, topk 1/64 with feedback, 48 averaging units of the
# Fashion-MNIST MLP): cosine 0.34-0.55, norm ratio 0.53-1.38, relative L2 distance 0.83-1.38.
TOPK_MIN_COSINE, TOPK_MAX_NORM_RATIO = 0.2, 4.0
# Relative L2 distance to the reference (the server's recomputation, or another volunteer's result) that
# still counts as the same update. int8 and int4 with error feedback carry the previous work units' residual,
# so they need wide margins; attacks (sign flips, scaling, noise, replays) land at 1.0 or more.
TOLERANCE = {"fp32": 0.01, "fp16": 0.02, "int8": 0.25, "int4": INT4_TOLERANCE}
# For graphs with dropout, whose updates cannot be recomputed exactly.
MIN_COSINE = 0.3
MAX_NORM_RATIO = 2.0
# topk sends 1 value in 64 plus what earlier units left out (error feedback), so an honest update is far
# from the server's in L2 but points its way: it is checked statistically too, with bounds from the honest
# updates of benchmarks/scaling/bytes.py (sent_vs_true there).
SPARSE_CHECK = {"topk": (TOPK_MIN_COSINE, TOPK_MAX_NORM_RATIO)}
# Error feedback carries into an honest update what quantising the device's previous update dropped: a unit
# much smaller than the one before it (a round's last samples, a shard's end) can be mostly that residual,
# and honest results failed their spot checks by 28-98% (issue 15's 64-volunteer runs). So the distance
# allowed grows by this share of the device's previous valid update's norm. int8 rounds each element to
# within half of its block's absmax/127, at most sqrt(256)/254 = 0.063 of a 256-block's L2 norm (0.068
# counting what that update carried itself): a bound, not an estimate (0.017 measured, heavy tails). int4's
# bound (16/14) would allow anything: 0.6 is twice the worst residual measured, 0.28 of the update, on
# updates drawn from normal, Laplace and Student-t (3 degrees of freedom) distributions.
# topk keeps 1 value in 64, so its residual is most of an update: measured (engine.codecs.ErrorFeedback on
# the Fashion-MNIST MLP as in benchmarks/scaling/bytes.py, local steps lr 0.05 momentum 0.9 on batches of 64,
# 1-3 units of 1,024-6,400 samples, then one of 64-200 on the same weights, as a round's last samples) at
# 0.8-1.63x the norm of the update sent before it, 1.62-2.26x for 64-sample gradients. The honest small
# units then had cosine 0.12-0.41 and norm ratio 1.6-50: 22 of 27 were refused (norm ratio over 4). 2.5 is
# above every share measured; the hard bound (sqrt(63) = 7.9: a kept 1/64 holds at least 1/64 of its
# block's energy) would let an update scaled 10x through. _statistical_problem says how the check uses it.
CARRIED = {"int8": 0.068, "int4": 0.6, "topk": 2.5}
# An honest update's residual comes from other data, so it adds little along the reference: in the runs
# measured for CARRIED the update's component there (cosine x norm ratio) exceeded TOPK_MAX_NORM_RATIO by at
# most 0.014x the residual allowed (carried / reference norm). The true update scaled 100x exceeded it by
# 0.033x or more, and replaying the update sent before (altered, so its digest differs) by up to 0.1x:
# 18 replays of 27 are refused here, the rest point the small unit's way as little as honest ones do.
CARRIED_ALIGNMENT = 0.03
# topk-encoded Gaussian noise against honest updates of the same MLP: |cosine| at most 0.079 (about 2,000
# draws, std 0.013); the honest small units measured for CARRIED: cosine 0.123 at least.
NOISE_COSINE = 0.1
NORM_OUTLIER_FACTOR = 10.0
# A mean over a few samples spreads far wider than one over many: one misclassified sample's gradient is most
# of it, and a well classified one's is almost nothing. Honest simulated volunteers on the MNIST MLP demo
# (benchmarks.server.throughput at 8 and then 256 volunteers, where a sync round of 256 samples gave each
# volunteer 2-6) had norms whose 90th percentile was 1.6x their median in units of 32 samples, 13x at 2, and
# at most 73x at 2 (20.2 against 0.28); at a flat 10x, 380 of 880 honest 2-sample results were refused, each
# refusal lowering the median of the valid history the next ones were compared with, and a refused slice
# resent was refused again. Widening as 1/sqrt(samples) still refused 108 in 40 s. So below this many
# samples a step the check bounds what a unit can move its round by, its samples x its norm (the round's
# weights), as a unit of this many at 10x: 160x at 2, 80x at 4.
NORM_FULL_SAMPLES = 32
NORM_HISTORY = 20
REPLAY_CANDIDATES = 100
SERVER_REFERENCE = "the server's recomputation"
REPLICA_REFERENCE = "another volunteer's result for the same work unit"
CANONICAL_REFERENCE = "the accepted result of this work unit"


# Results one validation decides in one transaction (issue 15): the validator used to take one task and
# three transactions per result, each committing (an fsync) and each verdict asking round_ready again. A
# batch is what waits when its task runs, so it grows with the backlog and costs nothing when there is none.
BATCH_SIZE = 32


class Busy(Exception):
    """The result's work unit is locked by another transaction: most often another validator's batch that
    took the result as a batch mate and is deciding it. Waiting for that commit held a validating process
    idle (seen at 64 volunteers: the two validating processes waited on each other's rows)."""


def results_validate(*, result_id: int, limit: int = BATCH_SIZE, wait: bool = True) -> list[int]:
    """Decide a received result: valid (credited, may be aggregated) or invalid (its slice is resent); in
    a replicated work unit, pending until a quorum of results is in, which then decides them all. With it,
    up to `limit - 1` other results of its project waiting for validation (batch_mates), each judged in
    isolation (a savepoint each: one that raises condemns only itself), all in one transaction. Returns the
    ids of every result decided, for the caller to announce once this commits (training.results_decided):
    late results get their verdict too, so no volunteer waits for an answer that never comes. Not `wait`ing,
    a work unit another transaction holds raises Busy at once."""
    with transaction.atomic(), _reading_once():
        first = _locked_pending(result_id=result_id, wait=wait)
        if first is None:
            return []  # decided already (by another task's batch, or a retry of this one)
        mates = _batch_mates(first=first, limit=limit - 1)
        # Every volunteer's row of the batch (in id order), then their teams', before any verdict: verdicts
        # lock them one by one, and two batches doing so in crossing orders would deadlock.
        volunteers = credit_lock(user_ids=[r.volunteer_id for r in [first, *mates]])
        _trust_known(volunteers=volunteers)
        batch = Verdicts()
        decided = _staged(batch, first, _judge_or_invalidate)
        for mate in mates:
            decided += _staged(batch, mate, _judge_mate)
        batch.write()
    return [r.pk for r in decided]


@dataclass
class Verdicts:
    """What a batch's valid verdicts write, once at its end (write): the results' and work units' rows (all
    locked by the batch already), the credit (ledger, totals, devices' speed) and each round's valid samples
    (training.round_ready's counter). Trust, and everything an invalid verdict writes, is written as it is
    judged: the batch's next result of the same volunteer is judged with it."""

    grants: list[Grant] = field(default_factory=list)
    samples: Counter[int] = field(default_factory=Counter)  # by model version id
    results: list[Result] = field(default_factory=list)
    units: list[WorkUnit] = field(default_factory=list)

    def add(self, other: Verdicts) -> None:
        self.grants += other.grants
        self.samples.update(other.samples)
        self.results += other.results
        self.units += other.units

    def clear(self) -> None:
        self.grants.clear()
        self.samples.clear()
        self.results.clear()
        self.units.clear()

    def write(self) -> None:
        bulk_write(_once(self.results), ["validation", "update_norm", "spot_checked", "checked"])
        bulk_write(_once(self.units), ["status", "canonical_result"])
        credits_grant(grants=self.grants)
        # Last: the version's row is one every validation of the round writes; held only until the commit.
        for version_id, samples in sorted(self.samples.items()):
            ModelVersion.objects.filter(pk=version_id).update(valid_samples=F("valid_samples") + samples)


def _once(rows: list[M]) -> list[M]:
    return list({row.pk: row for row in rows}.values())


# The verdicts of the result being judged in results_validate's batch (staged by _validate and _settle).
_verdicts: ContextVar[Verdicts | None] = ContextVar("verdicts", default=None)
_earlier: ContextVar[Verdicts | None] = ContextVar("earlier", default=None)  # the batch's, before it


@dataclass
class ReadOnce:
    """What every result of a batch reads alike, read once per project and batch: its current version's
    number and its recent update norms, as they stood when the batch began (a batch's own verdicts are not
    the history its results are compared with). Read for each result, they were three of its queries."""

    versions: dict[int, int] = field(default_factory=dict)
    norms: dict[int, list[float]] = field(default_factory=dict)
    # Each volunteer's run of valid results, as its locked row has it (kept in step by _validate), while
    # every verdict of the batch is valid: anything else (an invalid or late verdict, a judgement rolled
    # back) forgets them all, and trust is read from the row again (_trusted).
    trust: dict[int, int] = field(default_factory=dict)


_read_once: ContextVar[ReadOnce | None] = ContextVar("read_once", default=None)


@contextmanager
def _reading_once() -> Iterator[None]:
    token = _read_once.set(ReadOnce())
    try:
        yield
    finally:
        _read_once.reset(token)


def _current_number(project: Project) -> int:
    memo = _read_once.get()
    if memo is None:
        return project.current_version().number
    if project.pk not in memo.versions:
        memo.versions[project.pk] = project.current_version().number
    return memo.versions[project.pk]


def _staged(batch: Verdicts, result: Result, judge: Callable[[Result], list[Result]]) -> list[Result]:
    """Judge one result of a batch, its verdict's writes staged; kept only if its judgement stood (a
    judgement that raised was rolled back to its savepoint: see _staged_drop)."""
    staged = Verdicts()
    token, earlier = _verdicts.set(staged), _earlier.set(batch)
    decided: list[Result] = []
    try:
        decided = judge(result)
    finally:
        _verdicts.reset(token)
        _earlier.reset(earlier)
        if not decided or any(r.validation != Result.Validation.VALID for r in decided):
            _trust_known(volunteers={})
    batch.add(staged)
    return decided


def _trust_known(*, volunteers: dict[int, Volunteer]) -> None:
    memo = _read_once.get()
    if memo is not None:
        memo.trust = {user_id: volunteer.consecutive_valid for user_id, volunteer in volunteers.items()}


def _trusted(*, result: Result, threshold: int) -> bool:
    """Whether the result's volunteer is trusted now: the batch's rows while they are known, else read."""
    memo = _read_once.get()
    if memo is not None and result.volunteer_id in memo.trust:
        return memo.trust[result.volunteer_id] >= threshold
    return volunteer_ensure(user=result.volunteer).is_trusted(threshold=threshold)


def _staged_valid() -> list[Result]:
    """The results found valid so far in this batch (not written yet: Verdicts.write)."""
    staged, earlier = _verdicts.get(), _earlier.get()
    return [*(earlier.results if earlier else []), *(staged.results if staged else [])]


def _verdicts_staging() -> Verdicts:
    staged = _verdicts.get()
    if staged is None:
        raise RuntimeError("verdicts are staged only inside results_validate's batch")
    return staged


def _staged_drop() -> None:
    """The judgement being staged was rolled back: what it staged goes with it."""
    staged = _verdicts.get()
    if staged is not None:
        staged.clear()


def _locked_pending(*, result_id: int, wait: bool = True) -> Result | None:
    """The result, locked after its work unit, if it still waits for its verdict."""
    # The work unit before its results: a quorum decides several results at once, and the work unit's
    # lock serialises them; lifecycle.py takes locks in the same order. Only the work unit's row: locking
    # the joined project too (as this once did) made a project's validations, recomputations included,
    # run one at a time however many workers there were.
    row = Result.objects.filter(pk=result_id, **_PENDING).values_list("work_unit_id", flat=True).first()
    if row is None:
        return None
    work_units = WorkUnit.objects.select_for_update(of=("self",), no_key=True, skip_locked=not wait)
    work_unit = _for_judging(work_units).filter(pk=row).first()
    if work_unit is None:  # the row exists (the result points at it): another transaction holds it
        raise Busy(f"work unit {row} is locked by another transaction")
    locked = Result.objects.select_for_update(of=("self",), no_key=True)
    # Its volunteer too: trust, credit and verdicts read the user, one query fewer per result.
    result = locked.select_related("blob", "volunteer").filter(pk=result_id, **_PENDING).first()
    if result is not None:
        result.work_unit = work_unit
    return result


_PENDING = {"status": Result.Status.RECEIVED, "validation": Result.Validation.PENDING, "checked": False}


def _for_judging(work_units: QuerySet[WorkUnit]) -> QuerySet[WorkUnit]:
    return work_units.select_related("project", "version", "shard__blob", "reference")


def _batch_mates(*, first: Result, limit: int) -> list[Result]:
    """Up to `limit` more results of `first`'s project waiting for validation, locked with their work units.
    Only plain data-parallel units checked by the server: a quorum or a pipeline stage locks rows beyond its
    own (the other replicas, the ring's peers). Locks never waited for (SKIP LOCKED): a row another
    transaction holds (another validator, the step cancelling its round) is left to that row's own task,
    so a batch holding several work units never waits on one and cannot close a cycle."""
    project = first.work_unit.project
    if limit < 1 or project.is_pipeline or project.spot_check_by != Project.SpotCheckBy.SERVER:
        return []
    locked = Result.objects.select_for_update(of=("self",), no_key=True, skip_locked=True)
    candidates = locked.filter(
        work_unit__project_id=project.pk, work_unit__min_quorum=1, work_unit__stage_kind="", **_PENDING
    ).exclude(pk=first.pk)
    # In the order of the validation queue's partial index (result_awaiting_validation), its work units'
    # (oldest first): ordered by the result's key, PostgreSQL walked the primary key from the first result
    # ever received to the pending few (48% of the database's active time at 64 volunteers).
    mates = list(
        candidates.select_related("blob", "volunteer").order_by("work_unit_id", "received_at")[:limit]
    )
    units = _for_judging(WorkUnit.objects.select_for_update(of=("self",), no_key=True, skip_locked=True))
    wanted = {mate.work_unit_id for mate in mates} - {first.work_unit_id}
    by_id = {unit.pk: unit for unit in units.filter(pk__in=wanted)}
    by_id[first.work_unit_id] = first.work_unit  # the same object: a verdict on it is seen by the next
    kept = [mate for mate in mates if mate.work_unit_id in by_id]
    for mate in kept:
        mate.work_unit = by_id[mate.work_unit_id]
    return kept


def _judge_mate(result: Result) -> list[Result]:
    """A batch mate: as the first result, except that a failure of the server's own while judging it (its
    blob unreadable) leaves it pending for its own task to retry, instead of failing the whole batch."""
    try:
        return _judge_or_invalidate(result)  # each of its steps in a savepoint: one that fails leaves nothing
    except INFRASTRUCTURE_ERRORS as exc:
        _staged_drop()
        logger.warning("result %s left for its own validation: %s", result.pk, type(exc).__name__)
        return []


def _judge_or_invalidate(result: Result) -> list[Result]:
    """Judge `result`; if judging it raises anything but a failure of the server's own (database, broker,
    disk: the task retries those), the result is invalid. Otherwise one crafted upload (a header nested
    100,000 deep, an overflowing number) would fail its validation forever and hold its round open."""
    try:
        with transaction.atomic():  # a savepoint: nothing a failed judgement did half-way is kept
            return _judge(result)
    except INFRASTRUCTURE_ERRORS:
        _staged_drop()
        raise
    except Exception as exc:
        _staged_drop()
        logger.warning("result %s could not be validated: %s", result.pk, type(exc).__name__)
        # A savepoint of its own: a batch mate whose invalidation fails for the server's reasons is left
        # pending with nothing of it written (a second savepoint around every judgement cost two statements).
        with transaction.atomic():
            result = _relocked(result_id=result.pk)
            result_invalidate(result=result, reason=f"could not be validated: {type(exc).__name__}")
        return [result]


def _relocked(*, result_id: int) -> Result:
    """The result and its work unit as the database has them (both locked by this transaction already)."""
    result = Result.objects.select_related("blob").get(pk=result_id)
    result.work_unit = WorkUnit.objects.select_related("project", "version").get(pk=result.work_unit_id)
    return result


def _judge(result: Result) -> list[Result]:
    """Decide `result`, if its turn came; returns every result decided (a quorum decides several)."""
    work_unit = result.work_unit
    late = _lateness(work_unit)
    if late:
        # Work cancelled while the update was in the queue (a new round started) is late, not invalid.
        result.status, result.reason = Result.Status.CANCELLED, late
        result.save(update_fields=["status", "reason"])
        return [result]
    if work_unit.stage_kind:
        return _judge_stage(result)
    reason, params = _own_problem(result)
    if reason:
        result_invalidate(result=result, reason=reason)
        return [result]
    result.checked = True
    if work_unit.status == WorkUnit.Status.VALIDATED:
        return [_judge_against_canonical(result=result, update=params)]
    if work_unit.min_quorum > 1:
        result.save(update_fields=["checked", "update_norm"])
        return _quorum(work_unit=work_unit, result=result, update=params)
    reason = _spot_check(result=result, update=params)
    if reason:
        result_invalidate(result=result, reason=reason)
    else:
        _validate(result=result)
        _settle(work_unit=work_unit, canonical=result)
    return [result]


def _judge_stage(result: Result) -> list[Result]:
    """A pipeline stage unit's result (pipeline.py): its own checks, and the server's recomputation for
    volunteers not trusted yet and the drawn share of trusted ones. Valid: credit, and the unit its output
    makes ready. Undecided (none returned) while a payload the recomputation needs is still with the peer
    that sent it by the ring (ring.ring_check_inputs asks it to upload)."""
    work_unit = result.work_unit
    trusted = _trusted(result=result, threshold=work_unit.project.trust_threshold)
    check = work_unit.spot_check or not trusted
    if check and ring.ring_check_inputs(work_unit=work_unit):
        return []
    reason, parts = pipeline.stage_result_check(result=result, spot_check=check)
    if reason:
        result_invalidate(result=result, reason=reason)
        return [result]
    _validate(result=result)
    swarms.stage_member_observe(result=result)
    _settle(work_unit=work_unit, canonical=result)
    stages.stage_successor_create(
        work_unit=work_unit,
        output=result.blob,
        input_grad=parts.input_grad_bytes,
        sent_digest=result.sent_digest,
    )
    return [result]


def _lateness(work_unit: WorkUnit) -> str | None:
    if work_unit.status == WorkUnit.Status.CANCELLED:
        return "the round closed before this result was validated"
    if work_unit.status == WorkUnit.Status.ERRORED:
        return "this work unit failed too often"
    if work_unit.status == WorkUnit.Status.VALIDATED and work_unit.canonical_result_id is None:
        return "this work unit was already decided"
    project = work_unit.project
    staleness = _current_number(project) - work_unit.version.number
    if project.mode == Project.Mode.ASYNC_SGD and not project.staleness_weight(staleness=staleness):
        return f"computed on a version {staleness} steps old (the bound is {project.staleness_bound})"
    return None


def _own_problem(result: Result) -> tuple[str | None, Tensors]:
    """The checks every result gets on its own: why it fails them (None if it passes), and its params."""
    work_unit = result.work_unit
    if result.samples != work_unit.count:
        return f"expected {work_unit.count} samples, got {result.samples}", {}
    if result.loss is None or not torch.isfinite(torch.tensor(result.loss)):
        return "the loss is not a finite number", {}
    try:
        update = _decoded(result)
    except codecs.CodecError as exc:
        return f"undecodable update: {exc}", {}
    graph = project_graph(project=work_unit.project)
    expected = {p.name: tuple(p.shape) for p in graph.params}
    expected.update({b.name: tuple(b.shape) for b in graph.buffers if b.name in update})
    reason = check_update(update, expected)
    if reason:
        return reason, {}
    if _replayed(result):
        return "this update was already submitted for another work unit (replay)", {}
    params = _only(update, [p.name for p in graph.params])
    return _norm_problem(result=result, norm=_norm(params)), params


def _decoded(result: Result) -> Tensors:
    """The result's update, parsed and checked but not decoded (see codecs.Packed)."""
    return codecs.parse(blob_view(blob=result.blob)) if result.blob else {}


def _only(update: Tensors, names: list[str]) -> Tensors:
    return update.select(names) if isinstance(update, codecs.Packed) else {n: update[n] for n in names}


def _params(result: Result, work_unit: WorkUnit) -> Tensors:
    """The params of a result that passed its checks (so it decodes and has every one of them)."""
    update = _decoded(result)
    return {p.name: update[p.name] for p in project_graph(project=work_unit.project).params}


def _replayed(result: Result) -> bool:
    """The same bytes received before, for another slice or version. Two honest volunteers given the same
    slice of the same version (a round bigger than the dataset wraps around) legitimately send identical
    bytes. Only earlier ones count: a batch judging the first after its copies had arrived found it a replay
    of them, and refused the honest work with the replays (test_simulator's stale_replay: 3 invalid of 3)."""
    unit = result.work_unit
    if not result.digest:
        return False
    received = result.received_at or timezone.now()
    earlier = Q(received_at__lt=received) | Q(received_at=received, pk__lt=result.pk)
    # By digest, not blob: a decided work unit's updates are deleted (storage.py), their digests stay. The
    # digest's own index first, then their work units by key: joined in one statement, PostgreSQL walked every
    # work unit of the project and probed each for the digest (issue 15). Bounded: past a hundred copies of
    # one update, the rest are replays of the first anyway.
    same = Result.objects.filter(earlier, digest=result.digest).values_list("work_unit_id", flat=True)
    work_unit_ids = list(same[:REPLAY_CANDIDATES])
    if not work_unit_ids:
        return False
    # By key alone, the project compared here: with the project in the statement too, PostgreSQL without
    # statistics read the project's index (every work unit it has) rather than the primary key.
    fields = ("project_id", "version_id", "shard_id", "offset", "count")
    mine = (unit.project_id, unit.version_id, unit.shard_id, unit.offset, unit.count)
    others = WorkUnit.objects.filter(pk__in=work_unit_ids).values_list(*fields)
    return any(other[0] == mine[0] and other != mine for other in others)


def _norm(update: Tensors) -> float:
    if isinstance(update, codecs.Packed):
        return math.sqrt(update.sq_norm())
    return math.sqrt(sum(float((t.double() ** 2).sum()) for t in update.values()))


def _norm_problem(*, result: Result, norm: float) -> str | None:
    project = result.work_unit.project
    recent = _norms_before(project=project)
    result.update_norm = norm
    mine = _per_step(norm, project=project, samples=result.samples)
    factor = _outlier_factor(project=project, samples=result.samples)
    if len(recent) < 5 or mine <= factor * median(recent):
        return None
    return f"update norm {mine:.3g} is over {factor:.3g}x the recent median {median(recent):.3g}"


def _outlier_factor(*, project: Project, samples: int) -> float:
    """NORM_OUTLIER_FACTOR for a step of NORM_FULL_SAMPLES samples or more; wider as 1/samples below (a work
    unit's samples are the server's: its count, checked before this)."""
    per_step = min(samples, project.local_batch_size) if project.task == "local_steps" else samples
    return NORM_OUTLIER_FACTOR * max(1.0, NORM_FULL_SAMPLES / max(1, per_step))


def _per_step(norm: float, *, project: Project, samples: int) -> float:
    """A local-steps update (averaging) grows with its steps, and crowd rounds size units per device: a fast
    device's holds 10x the steps of a slow one's, which is no outlier. Compared per local step, a scaled
    update still is. A gradient is a mean over its batch: its norm does not grow with the batch."""
    if project.task != "local_steps":
        return norm
    return norm / max(1, math.ceil(samples / project.local_batch_size))


# Newest valid norms of all projects read to find a project's NORM_HISTORY (see _recent_norms).
NORM_SCAN = 25 * NORM_HISTORY


def _norms_before(*, project: Project) -> list[float]:
    memo = _read_once.get()
    if memo is None:
        return _recent_norms(project=project)
    if project.pk not in memo.norms:
        memo.norms[project.pk] = _recent_norms(project=project)
    return memo.norms[project.pk]


def _recent_norms(*, project: Project) -> list[float]:
    """The project's latest NORM_HISTORY valid update norms per step (_per_step), newest first. Joined to
    the work units in SQL, PostgreSQL (tables never analysed: this machine runs it without autovacuum)
    walked every work unit of the project for each of the 20: 85% of the database's time at 32 volunteers
    after ten minutes (issue 15). Here the query names a closed range of primary keys, which the planner
    reads by index whatever its statistics: the last NORM_SCAN results and their work units. Joined on the
    project as before only if other projects' results crowd this one's out of that window."""
    top = Result.objects.order_by("-pk").values_list("pk", flat=True).first() or 0
    window = Result.objects.filter(
        pk__range=(top - NORM_SCAN + 1, top), validation=Result.Validation.VALID, update_norm__isnull=False
    )
    # The project joined by the work unit's key, with no condition on it in SQL (one on the project would be
    # answered from the project's index: all its history).
    rows = window.values_list("pk", "update_norm", "samples", "work_unit__project_id")
    newest = [(n, samples) for _, n, samples, owner in sorted(rows, reverse=True) if owner == project.pk]
    if len(newest) < NORM_HISTORY and top > NORM_SCAN:
        joined = Result.objects.filter(
            work_unit__project=project, validation=Result.Validation.VALID, update_norm__isnull=False
        )
        newest = list(joined.order_by("-pk").values_list("update_norm", "samples")[:NORM_HISTORY])
    kept = [(n, samples) for n, samples in newest[:NORM_HISTORY] if n is not None]
    return [_per_step(n, project=project, samples=samples) for n, samples in kept]


def _spot_check(*, result: Result, update: Tensors) -> str | None:
    """A server-side spot check, when the project does them and this result is due one."""
    project = result.work_unit.project
    if project.spot_check_by != Project.SpotCheckBy.SERVER:
        return None  # replicas are decided when work is sent (lifecycle.work_unit_assign)
    # Drawn when the work was sent (lifecycle.work_unit_assign); a volunteer that lost its trust since
    # is checked all the same.
    trusted = _trusted(result=result, threshold=project.trust_threshold)
    if trusted and not result.work_unit.spot_check:
        return None
    result.spot_checked = True
    reference = _reference(work_unit=result.work_unit)
    return _disagreement(
        project=project,
        update=update,
        reference=reference,
        against=SERVER_REFERENCE,
        carried=_carried(result=result, project=project),
    )


def _reference(*, work_unit: WorkUnit) -> Tensors:
    """The server's update for the slice: precomputed while the volunteer computed, else computed now."""
    if work_unit.reference is not None:
        tensors, meta = codecs.decode(work_unit.reference.read())
        if meta.get("recipe") == work_unit.project.task_recipe:
            return tensors
    return recompute(work_unit=work_unit)


def work_unit_compute_reference(*, work_unit_id: int) -> bool:
    """Compute and store the server's update for a spot-checked work unit before its result arrives
    (queued when it is sent). Nothing is lost if this never runs: validation then computes it."""
    work_unit = (
        WorkUnit.objects.select_related("project", "version", "shard__blob").filter(pk=work_unit_id).first()
    )
    if (
        work_unit is None
        or not work_unit.is_open
        or work_unit.reference_id is not None
        or work_unit.stage_kind
    ):
        return False  # gone (its project was deleted), decided, or done already
    recipe = work_unit.project.task_recipe
    update = codecs.encode(recompute(work_unit=work_unit), "fp32", metadata={"recipe": recipe})
    with transaction.atomic():  # stored and referenced at once: the blob collector never sees it unreferenced
        blob = blob_put(data=update)
        return WorkUnit.objects.filter(pk=work_unit_id, reference=None).update(reference=blob) == 1


def _disagreement(
    *, project: Project, update: Tensors, reference: Tensors, against: str, carried: float = 0.0
) -> str | None:
    """Why `update` is not the same update as `reference` (None if it is): the relative L2 distance within the
    codec's tolerance plus what error feedback may have `carried` (L2, _carried), or for graphs with dropout
    the statistical test. Used for server recomputations and for comparing replicas alike."""
    stochastic = _stochastic(project_graph(project=project))
    if stochastic or project.codec in SPARSE_CHECK:
        cosine, ratio = SPARSE_CHECK.get(project.codec, (MIN_COSINE, MAX_NORM_RATIO))
        if stochastic:  # both: the looser of the two
            cosine, ratio = min(cosine, MIN_COSINE), max(ratio, MAX_NORM_RATIO)
        return _statistical_problem(
            update=update,
            reference=reference,
            against=against,
            min_cosine=cosine,
            max_ratio=ratio,
            carried=carried,
        )
    scale = max(_norm(reference), 1e-12)
    distance = _norm({k: update[k] - reference[k] for k in reference})
    if distance > TOLERANCE[project.codec] * scale + carried:
        return f"differs from {against} by {distance / scale:.1%}"
    return None


def _carried(*, result: Result, project: Project) -> float:
    """The most error feedback may honestly have carried into `result` from its device's previous update."""
    share = CARRIED.get(project.codec, 0.0)
    if not share or result.device_id is None:
        return 0.0
    earlier = Result.objects.filter(
        device_id=result.device_id,
        work_unit__project_id=project.pk,
        pk__lt=result.pk,
        validation=Result.Validation.VALID,
        update_norm__isnull=False,
    )
    latest = earlier.order_by("-pk").values_list("pk", "update_norm").first()
    # This batch's own valid verdicts are not written until its end: one of them may be the latest.
    mine = [
        (r.pk, r.update_norm)
        for r in _staged_valid()
        if r.device_id == result.device_id and r.pk < result.pk and r.update_norm is not None
        and r.work_unit.project_id == project.pk
    ]  # fmt: skip
    candidates = [*mine, *([latest] if latest else [])]
    return share * (max(candidates)[1] or 0.0) if candidates else 0.0


def _stochastic(graph: Graph) -> bool:
    return any(node.op == "dropout" and node.attrs.get("p", 0) > 0 for node in graph.nodes)


def _statistical_problem(
    *,
    update: Tensors,
    reference: Tensors,
    against: str,
    min_cosine: float = MIN_COSINE,
    max_ratio: float = MAX_NORM_RATIO,
    carried: float = 0.0,
) -> str | None:
    """Dropout masks are random, so an honest update only points the same way as the server's, with a
    similar norm (measured here: cosine 0.65-0.75 for the CNN preset's 0.25 dropout); sign flips, noise
    and scaling do not. An update may hold a residual error feedback `carried` (L2, _carried), which
    lowers its cosine and raises its norm (see CARRIED_ALIGNMENT for what still refuses scaling)."""
    a, b = _flat(update), _flat(reference)
    if not float(b.norm()):
        # Nothing scored (every target ignore_index: loss 0, zero gradients, docs/graph-format.md): no
        # direction to compare, and only the same zero update is honest.
        return None if not float(a.norm()) else f"does not match {against} (which is zero: nothing scored)"
    cosine = float(a @ b / max(float(a.norm() * b.norm()), 1e-30))
    ratio = float(a.norm() / max(float(b.norm()), 1e-30))
    extra = carried / float(b.norm())  # the residual allowed, in units of the reference's norm
    if extra:
        # Never below the cosine random noise reaches: the residual must not make noise pass.
        min_cosine = max(min_cosine / (1 + extra), NOISE_COSINE)
    if (
        cosine < min_cosine
        or not 1 / max_ratio <= ratio <= max_ratio + extra
        or cosine * ratio > max_ratio + CARRIED_ALIGNMENT * extra
    ):
        return f"does not match {against} (cosine {cosine:.2f}, norm ratio {ratio:.2f})"
    return None


def _flat(tensors: Tensors) -> torch.Tensor:
    return torch.cat([tensors[name].double().flatten() for name in sorted(tensors)])


def recompute(*, work_unit: WorkUnit) -> dict[str, torch.Tensor]:
    """What an honest volunteer sends for this work unit, computed here with engine/."""
    project = work_unit.project
    graph = project_graph(project=project)
    x, y = slices_load(work_unit_slices(work_unit=work_unit))
    inputs = {graph.inputs[0].name: torch.from_numpy(x)}
    targets = {graph.targets[0].name: torch.from_numpy(y)}
    weights = version_wire_weights(version=work_unit.version)
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


# --- replicas -------------------------------------------------------------------------------------


def _quorum(*, work_unit: WorkUnit, result: Result, update: Tensors) -> list[Result]:
    """Once `min_quorum` results passed their own checks, compare them (as BOINC's check_set): the first
    agreeing with a quorum is canonical, and each other result is valid if it agrees with the canonical one.
    With no quorum agreeing, one more instance is wanted. Returns the results decided."""
    waiting = results_awaiting_quorum(work_unit_ids=[work_unit.pk]).select_related("blob")
    candidates = [result if r.pk == result.pk else r for r in waiting]
    if len(candidates) < work_unit.min_quorum:
        return []
    project = work_unit.project
    # Decoded once each: every pair of them may be compared.
    updates = {r.pk: dict(update) if r.pk == result.pk else _params(r, work_unit) for r in candidates}
    carried = {r.pk: _carried(result=r, project=project) for r in candidates}
    canonical = _canonical(
        project=project, candidates=candidates, updates=updates, carried=carried, quorum=work_unit.min_quorum
    )
    if canonical is None:
        work_unit.record_disagreement()
        work_unit.save(update_fields=["wanted", "target_results", "status"])
        if work_unit.status == WorkUnit.Status.ERRORED:
            # Nobody can tell which of them was right: no credit, but no penalty either.
            results_abandon(work_unit_ids=[work_unit.pk], reason="no two results of this work unit agreed")
        else:
            transaction.on_commit(notify.work_available)
        return []
    reference = updates[canonical.pk]
    # Every volunteer's row (in id order), then their teams': each grant below locks a volunteer and then
    # the team, and crediting several one at a time could cross another transaction's order.
    credit_lock(user_ids=[candidate.volunteer_id for candidate in candidates])
    for candidate in sorted(candidates, key=lambda r: r.volunteer_id):
        candidate.work_unit = work_unit
        candidate.spot_checked = True
        reason: str | None = None
        if candidate is not canonical:
            reason = _disagreement(
                project=project,
                update=updates[candidate.pk],
                reference=reference,
                against=REPLICA_REFERENCE,
                carried=carried[candidate.pk] + carried[canonical.pk],
            )
        if reason:
            result_reject(result=candidate, reason=reason)
        else:
            _validate(result=candidate)
    _settle(work_unit=work_unit, canonical=canonical)
    return candidates


def _canonical(
    *,
    project: Project,
    candidates: list[Result],
    updates: dict[int, Tensors],
    carried: dict[int, float],
    quorum: int,
) -> Result | None:
    """The first candidate that agrees with at least `quorum - 1` others (each pair compared once, the
    earlier result as the reference, each allowed what error feedback carried into either), or None."""
    agree: dict[tuple[int, int], bool] = {}
    for i, first in enumerate(candidates):
        for second in candidates[i + 1 :]:
            agree[first.pk, second.pk] = agree[second.pk, first.pk] = not _disagreement(
                project=project,
                update=updates[second.pk],
                reference=updates[first.pk],
                against="",
                carried=carried[first.pk] + carried[second.pk],
            )
    for candidate in candidates:
        if 1 + sum(agree[candidate.pk, other.pk] for other in candidates if other is not candidate) >= quorum:
            return candidate
    return None


def _judge_against_canonical(*, result: Result, update: Tensors) -> Result:
    """A replica that arrived after its work unit was decided: credited if it agrees, never aggregated."""
    work_unit = result.work_unit
    canonical = work_unit.canonical_result
    assert canonical is not None  # _lateness made it late otherwise
    result.spot_checked = True
    project = work_unit.project
    reason = _disagreement(
        project=project,
        update=update,
        reference=_params(canonical, work_unit),
        against=CANONICAL_REFERENCE,
        carried=_carried(result=result, project=project) + _carried(result=canonical, project=project),
    )
    if reason:
        result_reject(result=result, reason=reason)
    else:
        _validate(result=result)
    return result


# --- verdicts -------------------------------------------------------------------------------------


def _validate(*, result: Result) -> None:
    """Valid: credit (the server's FLOP count, never the client's) and one more step towards trust."""
    result.validation = Result.Validation.VALID
    staged = _verdicts_staging()
    staged.results.append(result)
    staged.grants.append(Grant(result=result, flops=stages.unit_flops(work_unit=result.work_unit)))
    # Trust at once: the batch's next result of this volunteer is judged with it (and an invalid one
    # after it resets it, in that order).
    Volunteer.objects.filter(user_id=result.volunteer_id).update(
        consecutive_valid=F("consecutive_valid") + 1, consecutive_invalid=0
    )
    memo = _read_once.get()
    if memo is not None and result.volunteer_id in memo.trust:
        memo.trust[result.volunteer_id] += 1


def _settle(*, work_unit: WorkUnit, canonical: Result) -> None:
    """The work unit is done; `canonical` is the one result of it that training aggregates."""
    work_unit.status, work_unit.canonical_result = WorkUnit.Status.VALIDATED, canonical
    # Counted in the verdicts' transaction, so round_ready reads one row: once for all the batch's verdicts,
    # at its end (Verdicts.write), with the unit's own row.
    staged = _verdicts_staging()
    staged.units.append(work_unit)
    staged.samples[work_unit.version_id] += canonical.samples
