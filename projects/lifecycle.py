"""The BOINC work-unit lifecycle: feeding, sending instances, receiving, releasing, timing out, cancelling.

A work unit is a slice of training data on one model version; each time it is sent to a volunteer a
Result (an instance) is created with its own deadline. Validation and training live in validation.py
and training.py; this module only moves work units and results between states (to invalid too, when
validation.py says so or a result's own words give it away) and tells volunteers where theirs ended up.

Projects that spot-check by replication (`spot_check_by` "replica", BOINC's adaptive replication) decide
here, when an instance is sent, whether it is checked: always for volunteers not yet trusted, for a
`spot_check_rate` share of trusted ones. A checked work unit wants two results that must agree
(`target_results` = `min_quorum` = 2), so one more instance goes to a different volunteer.

Lock order, to keep concurrent transactions free of deadlocks: instances in flight, then their work
units, then received results (validation.py takes the work unit before its results too). Rows are locked
FOR NO KEY UPDATE: Django's foreign keys are checked at COMMIT with a KEY SHARE lock on the referenced row,
which a plain FOR UPDATE blocks. (A validation creating a CreditEntry for a project whose row the step held
FOR UPDATE, while the step waited for the validation's work unit, deadlocked.)
"""

from __future__ import annotations

import bisect
import itertools
import math
import random
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from functools import partial
from statistics import median

from django.conf import settings
from django.contrib.auth.models import User
from django.db import transaction
from django.db.models import Case, Exists, F, OuterRef, Q, QuerySet, Sum, Value, When
from django.utils import timezone

from config.bulk import bulk_write
from engine import spec
from projects import notify, stages, swarms
from projects.blobs import blob_put, blobs_put
from projects.datasets import shard_position
from projects.models import DatasetShard, ModelVersion, Project, Result, WorkUnit
from projects.shares import Order, device_fractions, shares_order, usage_charge
from workers import fitting
from workers.models import Device, DeviceDownload, Volunteer
from workers.preferences import Preferences, devices_allowing, preferences_effective
from workers.services import volunteer_ensure, volunteer_record_invalid

# A connection may hold this many instances at once: one computing, one prefetched.
MAX_IN_FLIGHT = spec.MAX_IN_FLIGHT
# A received result still unvalidated this long after arrival has most likely lost its validate_result
# message (worker SIGKILLed mid-task: Redis redelivers unacked tasks only after an hour; Redis restarted
# empty; or the broker was down when daphne queued it). The transitioner queues it again.
VALIDATION_RETRY_SECONDS = 30
VALIDATION_RETRY_BATCH = 20  # per transitioner run: a long genuine backlog must not grow by much
# A received result the server still could not validate this long after arrival (its validations keep
# failing for the server's own reasons: see validation.INFRASTRUCTURE_ERRORS) is given up: late, neither
# credit nor penalty. Its round stops waiting for it then (training.py), so a round always closes.
VALIDATION_GIVE_UP_SECONDS = 300
GAVE_UP = "the server could not validate this result"
# Client-reported timings are stored in 32-bit columns; elapsed time bounds them long before this.
MAX_REPORTED_MS = 2**31 - 1


class ResultError(ValueError):
    """A result that breaks the protocol; `code` is sent to the client in an `error` message."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class ResultOutcome:
    work_unit_id: int
    status: str  # "pending" (queued for validation), "valid", "invalid" or "late"
    reason: str
    credit_flops: int
    total_credit_flops: int
    recent_credit: float  # the volunteer's recent average (credit per day) as of the outcome

    @property
    def accepted(self) -> bool:
        return self.status in ("pending", "valid")


# --- feeding --------------------------------------------------------------------------------------


def work_units_feed(*, project_id: int) -> int:
    """Keep one round of work ready for a running project's current version (the BOINC feeder)."""
    with transaction.atomic():
        project = Project.objects.select_for_update(no_key=True).get(pk=project_id)
        if not project.is_running:
            return 0
        version = project.current_version()
        if project.is_pipeline:  # a step's first units; the others follow their inputs (stages.py)
            created = stages.step_feed(project=project, version=version)
            project.save(update_fields=["data_cursor"])
            return created
        size = _round_plan(project=project, version=version)
        target = version.round_target or project.round_samples
        if project.rounds_overlap:
            # A unit ready for each device that ends one before the round closes: its next starts at once,
            # and counts in the next round if this one closes first (unsent ones are renewed then).
            target *= 2
        missing = target - _samples_covered(project=project, version=version)
        created = _round_create(project=project, version=version, size=size, missing=missing)
        if not created:
            created = _joiners_feed(project=project, version=version)
        project.save(update_fields=["data_cursor"])
    return created


def _round_create(*, project: Project, version: ModelVersion, size: int, missing: int) -> int:
    """Work units covering `missing` samples from the data cursor on, in one INSERT: a crowd-sized round has a
    unit per volunteer, and two queries each (its shard, its row) made feeding 256 of them 512 round trips."""
    if missing <= 0:
        return 0
    shards = list(project.dataset.shards.filter(split=DatasetShard.Split.TRAIN).order_by("index"))
    starts = list(itertools.accumulate((s.count for s in shards[:-1]), initial=0))
    units = []
    while missing > 0:
        units.append(_next_work_unit(project=project, version=version, size=size, shards=(shards, starts)))
        missing -= units[-1].count
    WorkUnit.objects.bulk_create(units)
    return len(units)


def _round_plan(*, project: Project, version: ModelVersion) -> int:
    """Samples per work unit of the round fed now. A crowd-sized round (Project.crowd_rounds) has a work unit
    for every connected device that may take its work, at least round_samples / batch_size of them: sync SGD
    shares the researcher's target batch between them; averaging gives each device a unit of target_seconds of
    local steps on that device (_device_units), so the round grows with the crowd, and its target is fixed
    once, when first fed (version.round_target), so that volunteers joining mid-round do not hold it open."""
    if not project.crowd_rounds or project.mode == Project.Mode.ASYNC_SGD:
        return project.batch_size
    connected = _connected(project_id=project.pk)
    devices = list(connected.only("observed_gflops", "gflops", "start_ms"))
    units = max(math.ceil(project.round_samples / project.batch_size), len(devices))
    if project.mode != Project.Mode.AVERAGING:
        # Sync keeps the researcher's round_samples as the live target, so a change mid-round still applies.
        return math.ceil(project.round_samples / units)
    fractions = device_fractions(project_id=project.pk, devices=connected)
    sizes = _device_units(project=project, devices=devices, units=units, fractions=fractions)
    if version.round_target is None:
        version.round_target = sum(sizes)
        version.save(update_fields=["round_target"])
    return max(sizes)


def _device_units(
    *, project: Project, devices: list[Device], units: int, fractions: dict[int, float]
) -> list[int]:
    """Samples of each of the round's `units`: one per connected device, taking target_seconds on that
    device less the time it takes to start (Device.start_ms), times the fraction of its time the project's
    resource share gives it (shares.device_fractions: 1 unless other running projects share the device, whose
    own rounds take the rest of that time), so that a fleet whose speeds spread 10x
    finishes its round together (Hivemind's rule) instead of fast devices waiting for slow ones given the
    median's unit. The feeder cuts units of the largest size and _send gives each device the front that fits
    its speed. Units beyond the devices (one volunteer computes several in turn) take the median device's
    size; with no device connected, batch_size: a speed guessed for nobody planned a first round no real
    fleet finished before its timeout (once units could hold the whole training split), whereas a small one
    closes at once and the next is planned for who came."""
    sized = [
        max(
            project.batch_size,
            _device_unit_samples(project=project, device=d, age=0, share=fractions.get(d.pk)),
        )
        for d in devices
    ]
    speeds = [device.speed_gflops() for device in devices]
    typical = max(project.batch_size, project.work_unit_samples(gflops=median(speeds))) if speeds else 0
    return sized + [max(project.batch_size, typical)] * (units - len(sized))


def _connected(*, project_id: int) -> QuerySet[Device]:
    """The connected devices not paused, whose volunteer is not held back and whose preferences allow the
    project: in a multi-project server, counting those that chose another project planned units nobody here
    would take (computed late as leftovers by others, or the round closed by its time)."""
    now = timezone.now()
    devices = Device.objects.filter(
        disconnected_at__isnull=True, forgotten_at__isnull=True, paused_at__isnull=True
    ).exclude(volunteer__no_work_until__gt=now)
    return devices_allowing(devices=devices, project_id=project_id)


def _joiners_feed(*, project: Project, version: ModelVersion) -> int:
    """Work for devices that connected after their round was planned (its target is fixed then,
    _round_plan): what each device without a unit of the round computes in the rest of it, less what is
    still unsent, while a quarter of it is left (Project.round_open_to_joiners). Without it they waited for
    the next round: at 64 volunteers signing in, 45 of them computed nothing for 41 s. The round's target
    grows by what is added, so the round closes at CROWD_CLOSE_SHARE of the whole: kept outside it, the round
    closed on its planned devices' samples before the joiners' units ended (84-91 instances cancelled at
    64, computed for no credit). Not in a round planned before any device came: its units are of batch_size
    and it closes within seconds."""
    age = (timezone.now() - version.created_at).total_seconds()
    if not project.round_open_to_joiners(round_age=age) or not _planned_for_devices(project, version):
        return 0
    waiting = _without_a_unit(version=version, project_id=project.pk)
    if not any(device.available_since() > version.created_at for device in waiting):
        return 0  # the round was planned for them all, those that never take one of its units too
    fractions = device_fractions(project_id=project.pk, devices=_connected(project_id=project.pk))
    sizes = [
        _device_unit_samples(project=project, device=d, age=age, share=fractions.get(d.pk)) for d in waiting
    ]
    size = min(max(project.batch_size, *sizes), project.dataset.train_samples)
    cursor, missing = project.data_cursor, sum(sizes) - _unsent(version)
    created = _round_create(project=project, version=version, size=size, missing=missing)
    if added := project.data_cursor - cursor:
        ModelVersion.objects.filter(pk=version.pk).update(round_target=F("round_target") + added)
    return created


def _planned_for_devices(project: Project, version: ModelVersion) -> bool:
    """Was the round on `version` planned for devices (_device_units), not in units of batch_size?"""
    return WorkUnit.objects.filter(version=version, count__gt=project.batch_size).exists()


def _without_a_unit(*, version: ModelVersion, project_id: int) -> list[Device]:
    """The connected devices that may take the project's work and were never sent a unit of the round on
    `version`."""
    sent = Result.objects.filter(work_unit__version=version, device=OuterRef("pk"))
    devices = _connected(project_id=project_id).filter(~Exists(sent))
    return list(devices.only("observed_gflops", "gflops", "start_ms", "connected_at", "resumed_at"))


def _unsent(version: ModelVersion) -> int:
    """Samples of the round on `version` still to send (a planned unit not sent yet, what a split left):
    work for the joiners first."""
    units = WorkUnit.objects.filter(version=version, status=WorkUnit.Status.OPEN, wanted__gt=0)
    return units.aggregate(n=Sum("count"))["n"] or 0


def _samples_covered(*, project: Project, version: ModelVersion) -> int:
    units = WorkUnit.objects.filter(version=version)
    if project.mode == Project.Mode.ASYNC_SGD:
        # Async has no rounds: keep a buffer of unsent work the size of one round.
        units = units.filter(status=WorkUnit.Status.OPEN, wanted__gt=0, total_results=0)
    else:
        units = units.filter(status__in=[WorkUnit.Status.OPEN, WorkUnit.Status.VALIDATED])
    return units.aggregate(n=Sum("count"))["n"] or 0


def _next_work_unit(
    *, project: Project, version: ModelVersion, size: int, shards: tuple[list[DatasetShard], list[int]]
) -> WorkUnit:
    """The next unsaved work unit at the data cursor (moved past it). `shards`: the training shards by index
    and the sample each starts at. A unit may run on into the next shards, and past the split's end from its
    start (datasets.shard_slices), but never holds a sample twice."""
    index = project.data_cursor % project.dataset.train_samples
    at = bisect.bisect_right(shards[1], index) - 1
    count = min(size, project.dataset.train_samples)
    project.data_cursor += count
    return WorkUnit(
        project=project, version=version, shard=shards[0][at], offset=index - shards[1][at], count=count
    )


# --- sending --------------------------------------------------------------------------------------


# Work units tried per request when some do not fit the device (each one more query, while locked).
MAX_FIT_TRIES = 8


@dataclass(frozen=True)
class Offer:
    """What a `ready` gets: an instance and why its project (spec.json assign_why: the volunteer's only
    choice, its turn by resource share, the only project with work), or none and why (idle_reasons)."""

    result: Result | None
    why: str


def work_unit_assign(*, user: User, device: Device | None = None) -> Result | None:
    return work_unit_offer(user=user, device=device).result


def work_unit_offer(
    *,
    user: User,
    device: Device | None = None,
    preferences: Preferences | None = None,
    memory_mb: float | None = None,
) -> Offer:
    """Send one instance of the next open work unit the volunteer's computing preferences allow, sized for
    their device (speed, memory, largest work unit, what is left of today's download); none while the
    volunteer is paused for a run of invalid results. `preferences`: the device's, if the caller has them."""
    volunteer = volunteer_ensure(user=user)
    if not volunteer.may_work(now=timezone.now()):
        return Offer(None, "backoff")
    if not work_sendable():
        # Once a round is handed out, every volunteer returning a result asks for more and is told `idle`:
        # about one `ready` in two at a crowd-sized round. Nothing to send to anyone is one indexed EXISTS,
        # not the locks and queries of choosing a work unit that fits (issue 15).
        return Offer(None, "no_work")
    if preferences is None:
        preferences = preferences_effective(
            volunteer_id=volunteer.pk, device_id=device.pk if device else None
        )
    with transaction.atomic():
        limits = fitting.limits_for(device=device, preferences=preferences, memory_mb=memory_mb)
        order = shares_order()  # once: every try below ranks the projects the same way
        work_unit, samples, why = _fitting_work_unit(
            user=user,
            preferences=preferences,
            limits=limits,
            order=order.ids,
            device_id=device.pk if device else None,
        )
        if work_unit is None:
            return Offer(None, why)
        request = OfferRequest(user=user, preferences=preferences, device=device, memory_mb=memory_mb)
        result = _send(
            work_unit=work_unit,
            samples=samples,
            request=request,
            volunteer=volunteer,
            limits=limits,
            order=order,
        )
        why = _why_chosen(work_unit=work_unit, user=user, preferences=preferences, running=len(order.ids))
        # Last: every assignment charges the project's usage row, which then stays locked until the commit.
        usage_charge(project_id=work_unit.project_id, flops=stages.unit_flops(work_unit=work_unit))
        return Offer(result, why)


# --- sending in batches ---------------------------------------------------------------------------


@dataclass(frozen=True)
class OfferRequest:
    """One volunteer's `ready` in a batch (work_units_offer), with what its connection holds."""

    user: User
    preferences: Preferences
    device: Device | None = None
    memory_mb: float | None = None


@dataclass
class _Batch:
    """The open work units one batch chooses from: locked, in the order work_unit_offer would take them, and
    which of them each volunteer of the batch holds an instance of already. What its sends change is written
    once (write): at its end, or before a search that reads it."""

    order: Order
    units: dict[int, WorkUnit]
    complete: bool  # every open unit nobody else has locked is listed: what is not here, no search finds
    held: set[tuple[int, int]]  # (work unit, volunteer)
    computing: set[tuple[int, int]]  # (device, version): a round it computes a unit of (_computing)
    charges: dict[int, int]  # flops sent per project, charged once at the end
    todays: dict[int, DeviceDownload]  # the devices' rows of today, locked (fitting.todays_lock)
    unwritten: list[Result] = field(default_factory=list)  # instances sent from the list, not created yet

    def sent(self, *, work_unit: WorkUnit, user_id: int, split: bool) -> None:
        """`split`: its rest became a new unit (lifecycle._split_to_fit), which the list does not hold."""
        self.complete = self.complete and not split
        if work_unit.pk in self.units:  # the search's own copy of a unit listed here: the list's is stale now
            self.units[work_unit.pk] = work_unit
        self.held.add((work_unit.pk, user_id))
        self.charges[work_unit.project_id] = self.charges.get(work_unit.project_id, 0) + stages.unit_flops(
            work_unit=work_unit
        )

    def today(self, device: Device | None) -> DeviceDownload | None:
        """The device's row of today, locked: one object per device, which its sends count into."""
        if device is not None and device.pk not in self.todays:
            self.todays.update(fitting.todays_lock(device_ids=[device.pk]))
        return None if device is None else self.todays[device.pk]

    def write(self) -> None:
        """The sends so far in three statements (work units, devices' days, new instances), where each send
        took three of its own (issue 15)."""
        if not self.unwritten:
            return
        units = {result.work_unit_id: result.work_unit for result in self.unwritten}
        bulk_write(sorted(units.values(), key=lambda unit: unit.pk), SENT_FIELDS)
        devices = {result.device_id for result in self.unwritten if result.device_id is not None}
        bulk_write([self.todays[pk] for pk in sorted(devices)], fitting.DOWNLOAD_FIELDS)
        Result.objects.bulk_create(self.unwritten)
        self.unwritten = []


def work_units_offer(*, requests: list[OfferRequest]) -> list[Offer]:
    """work_unit_offer for several volunteers at once, in their order: a web process gathers the `ready`s
    of its connections while its previous batch runs (workers/offers.py). One transaction; the volunteers'
    rows in one query; the work units taken from one locked list of the open ones, where each `ready`
    compiled and ran its own search (a third of daphne's CPU at 64 volunteers, issue 15); the devices' rows
    of today locked in one statement; what the sends change written in one statement per table; each
    project's usage charged once. A volunteer for whom the first unit in line does not do (its device's
    limits, a pipeline stage unit) gets work_unit_offer's own search, in the same transaction."""
    volunteers = _volunteers(users=[request.user for request in requests])
    now = timezone.now()
    if not work_sendable():
        return [
            Offer(None, "no_work" if volunteers[r.user.pk].may_work(now=now) else "backoff") for r in requests
        ]
    with transaction.atomic():
        order = shares_order()
        working = [r for r in requests if volunteers[r.user.pk].may_work(now=now)]
        batch = _batch_for(order=order, requests=working)
        offers = [_batch_offer(request=r, volunteer=volunteers[r.user.pk], batch=batch) for r in requests]
        batch.write()
        for project_id, flops in sorted(batch.charges.items()):  # last, in id order (as work_unit_offer)
            usage_charge(project_id=project_id, flops=flops)
    return offers


def _volunteers(*, users: list[User]) -> dict[int, Volunteer]:
    """The volunteers' rows in one query; a user without one yet gets it (volunteer_ensure)."""
    found = {v.user_id: v for v in Volunteer.objects.filter(user__in=users)}
    for user in users:
        if user.pk not in found:
            found[user.pk] = volunteer_ensure(user=user)
    return found


def _batch_for(*, order: Order, requests: list[OfferRequest]) -> _Batch:
    """Two open units per request at most (a unit wanted twice, a volunteer holding one already), locked
    (SKIP LOCKED: another process's batch takes the next ones) until the batch commits; and the rows of
    today of as many devices as the list has instances for (the others most likely find none left)."""
    rank = Case(
        *(When(project_id=pk, then=Value(i)) for i, pk in enumerate(order.ids)), default=Value(len(order.ids))
    )
    limit = 2 * len(requests)
    units = list(
        _sendable()
        .select_for_update(skip_locked=True, of=("self",), no_key=True)
        .select_related(*_SENT_WITH)
        .order_by(rank, "version__created_at", "id")[:limit]
    )
    user_ids = [request.user.pk for request in requests]
    held = Result.objects.filter(work_unit__in=units, volunteer_id__in=user_ids)
    wanted = sum(unit.wanted for unit in units)
    devices = [r.device.pk for r in requests if r.device is not None]
    return _Batch(
        order=order,
        units={unit.pk: unit for unit in units},
        complete=len(units) < limit,
        held=set(held.values_list("work_unit_id", "volunteer_id")),
        computing=_computing_rounds(units=units, device_ids=devices),
        charges={},
        todays=fitting.todays_lock(device_ids=devices[:wanted]),
    )


def _batch_offer(*, request: OfferRequest, volunteer: Volunteer, batch: _Batch) -> Offer:
    if not volunteer.may_work(now=timezone.now()):
        return Offer(None, "backoff")
    first = _first_in_line(request=request, batch=batch)
    if first is None and batch.complete:
        # Once a round is handed out, most of a batch finds none left: no search would find one either.
        return Offer(None, "no_work")
    device = request.device
    limits = fitting.limits_for(
        device=device, preferences=request.preferences, memory_mb=request.memory_mb, today=batch.today(device)
    )
    work_unit, samples = _fitting_first(work_unit=first, limits=limits)
    if work_unit is None:
        return _batch_search(request=request, volunteer=volunteer, batch=batch, limits=limits)
    count = work_unit.count
    share = batch.order.fraction(project_id=work_unit.project_id, allows=request.preferences.allows)
    _sending(work_unit=work_unit, samples=samples, volunteer=volunteer, device=device, share=share)
    if limits.today is not None:
        fitting.download_count(today=limits.today, work_unit=work_unit)
    result = Result(work_unit=work_unit, volunteer=request.user, device=device, deadline=_deadline())
    batch.unwritten.append(result)
    return _batch_sent(request=request, result=result, batch=batch, split=work_unit.count < count)


def _batch_search(
    *, request: OfferRequest, volunteer: Volunteer, batch: _Batch, limits: fitting.Limits
) -> Offer:
    """work_unit_offer's search, on the rows as the batch's sends so far left them."""
    batch.write()
    user, device = request.user, request.device
    device_id = device.pk if device else None
    work_unit, samples, why = _fitting_work_unit(
        user=user, preferences=request.preferences, limits=limits, order=batch.order.ids, device_id=device_id
    )
    if work_unit is None:
        return Offer(None, why)
    count = work_unit.count
    result = _send(
        work_unit=work_unit,
        samples=samples,
        request=request,
        volunteer=volunteer,
        limits=limits,
        order=batch.order,
    )
    return _batch_sent(request=request, result=result, batch=batch, split=work_unit.count < count)


def _batch_sent(*, request: OfferRequest, result: Result, batch: _Batch, split: bool) -> Offer:
    # With several projects running, why it was chosen reads the open units without the batch's unwritten
    # sends: a unit of another project handed out earlier in this batch may still count as one it could have
    # had ("share" for "only"). Only that word of the message, never what is sent.
    batch.sent(work_unit=result.work_unit, user_id=request.user.pk, split=split)
    why = _why_chosen(
        work_unit=result.work_unit,
        user=request.user,
        preferences=request.preferences,
        running=len(batch.order.ids),
    )
    return Offer(result, why)


def _first_in_line(*, request: OfferRequest, batch: _Batch) -> WorkUnit | None:
    """The batch's first unit still wanted that the volunteer allows and holds no instance of; a stage unit
    first in line whatever it holds (its own rules: _new_to, swarms.py)."""
    device_id = request.device.pk if request.device else None
    for unit in batch.units.values():
        if unit.wanted <= 0 or not request.preferences.allows(unit.project_id):
            continue
        if (device_id, unit.version_id) in batch.computing:
            continue
        if unit.stage_kind or (unit.pk, request.user.pk) not in batch.held:
            return unit
    return None


def _fitting_first(*, work_unit: WorkUnit | None, limits: fitting.Limits) -> tuple[WorkUnit | None, int]:
    """The unit first in line with the samples the device takes of it, if it fits whole (or, fresh, in
    part); else none, and work_unit_offer's search decides as it would have: it knows stage units, and which
    units and projects to skip when one does not fit."""
    if work_unit is None or work_unit.stage_kind:
        return None, 0
    fit = fitting.fit(work_unit=work_unit, limits=limits)
    if fit.samples and (fit.samples >= work_unit.count or not work_unit.total_results):
        return work_unit, fit.samples
    return None, 0


def _fitting_work_unit(
    *,
    user: User,
    preferences: Preferences,
    limits: fitting.Limits,
    order: list[int],
    device_id: int | None = None,
) -> tuple[WorkUnit | None, int, str]:
    """The next open work unit of an allowed project that fits, with the samples that fit. A work unit that
    does not fit rules out its project for this request, unless it could fit once split (only fresh ones
    are split): then only itself. A stage unit the device's swarm holds for another member rules out its
    stage (projects/swarms.py)."""
    allowed, why = preferences.project_filter(), "no_work"
    for _ in range(MAX_FIT_TRIES):
        work_unit = _next_open_work_unit(user=user, order=order, allowed=allowed, device_id=device_id)
        if work_unit is None:
            return None, 0, why
        fit = fitting.fit(work_unit=work_unit, limits=limits)
        if fit.samples and (fit.samples >= work_unit.count or not work_unit.total_results):
            if _stage_claimed(work_unit=work_unit, device_id=device_id):
                return work_unit, fit.samples, ""
            allowed &= ~Q(project_id=work_unit.project_id, stage=work_unit.stage)
            continue
        why = fit.reason or "too_large"
        allowed &= ~Q(pk=work_unit.pk) if fit.samples else ~Q(project_id=work_unit.project_id)
    return None, 0, why


def _stage_claimed(*, work_unit: WorkUnit, device_id: int | None) -> bool:
    if not work_unit.stage_kind or device_id is None:
        return True
    return swarms.stage_unit_claim(work_unit=work_unit, device_id=device_id)


def _send(
    *,
    work_unit: WorkUnit,
    samples: int,
    request: OfferRequest,
    volunteer: Volunteer,
    limits: fitting.Limits,
    order: Order,
) -> Result:
    device = request.device
    share = order.fraction(project_id=work_unit.project_id, allows=request.preferences.allows)
    _sending(work_unit=work_unit, samples=samples, volunteer=volunteer, device=device, share=share)
    if device is not None:
        fitting.download_record(device=device, work_unit=work_unit, today=limits.today)
    work_unit.save(update_fields=SENT_FIELDS)
    return _instance(work_unit=work_unit, user=request.user, device=device, deadline=_deadline())


SENT_FIELDS = ["wanted", "total_results", "count", "target_results", "min_quorum", "spot_check"]


def _sending(
    *, work_unit: WorkUnit, samples: int, volunteer: Volunteer, device: Device | None, share: float | None
) -> None:
    """What one more instance sent changes in its work unit's row (SENT_FIELDS), not written yet."""
    speed = _device_samples(work_unit=work_unit, device=device, share=share) if device else samples
    _split_to_fit(work_unit=work_unit, samples=min(samples, speed))
    work_unit.wanted -= 1
    work_unit.total_results += 1
    _plan_spot_check(work_unit=work_unit, volunteer=volunteer)


def _deadline() -> datetime:
    return timezone.now() + timedelta(seconds=settings.CROWDTRAIN["WORK_UNIT_DEADLINE_SECONDS"])


def _device_samples(*, work_unit: WorkUnit, device: Device, share: float | None) -> int:
    """What the device computes in the time a unit sent now should take (Project.unit_seconds)."""
    age = (timezone.now() - work_unit.version.created_at).total_seconds()
    return _device_unit_samples(project=work_unit.project, device=device, age=age, share=share)


def _device_unit_samples(*, project: Project, device: Device, age: float, share: float | None = None) -> int:
    """What the device computes in a unit sent `age` seconds into its round: the round is that much older
    when the device starts computing it, after its downloads. Planned from the sending alone, units that must
    end with their round ended as late as their downloads took (up to 2.1 s at 64 volunteers, and the round
    waited for them). `share`: the fraction of its time the device gives a crowd averaging round's project
    when others share it (shares.Order.fraction): at most that fraction of the round, so that it has the
    rest for theirs, and once it has computed theirs, the rest of the round for this one."""
    seconds = project.unit_seconds(round_age=age + device.start_seconds())
    if share is not None and project.crowd_averaging:
        seconds = min(seconds, share * project.target_seconds)
    return project.work_unit_samples(gflops=device.speed_gflops(), seconds=seconds)


def _instance(*, work_unit: WorkUnit, user: User, device: Device | None, deadline: datetime) -> Result:
    old = Result.objects.filter(work_unit=work_unit, volunteer=user).first() if work_unit.stage_kind else None
    if old is None:
        return Result.objects.create(work_unit=work_unit, volunteer=user, device=device, deadline=deadline)
    old.work_unit = work_unit  # as create() leaves it: the consumer reads it in daphne's event loop
    old.reopen(device=device, deadline=deadline)
    return old


def _why_chosen(*, work_unit: WorkUnit, user: User, preferences: Preferences, running: int) -> str:
    """`running`: how many projects run (shares_order); with one, no other could have had work."""
    if preferences.single_choice:
        return "choice"
    if running <= 1:
        return "only"
    others = (
        _sendable()
        .filter(preferences.project_filter())
        .exclude(project_id=work_unit.project_id)
        .exclude(results__volunteer=user)
    )
    return "share" if others.exists() else "only"


def _plan_spot_check(*, work_unit: WorkUnit, volunteer: Volunteer) -> None:
    """Decided once per work unit, when an instance is sent. By replica: one more instance, which the
    scheduler never gives to a volunteer holding one. By the server: it computes the slice's update now,
    while the volunteer does, so that validating the result is only a comparison."""
    project = work_unit.project
    if work_unit.stage_kind:  # stage units are checked by the server, when judged (pipeline.py)
        work_unit.spot_check = work_unit.spot_check or _check_drawn(project=project, volunteer=volunteer)
    elif project.spot_check_by == Project.SpotCheckBy.REPLICA:
        if work_unit.target_results == 1 and _check_drawn(project=project, volunteer=volunteer):
            work_unit.replicate()
            transaction.on_commit(notify.work_available)  # the replica is for someone else
    elif not work_unit.spot_check and _check_drawn(project=project, volunteer=volunteer):
        work_unit.spot_check = True
        if project.flops_per_sample * work_unit.count >= settings.CROWDTRAIN["REFERENCE_MIN_FLOPS"]:
            transaction.on_commit(partial(notify.reference_wanted, work_unit_id=work_unit.pk))


def _check_drawn(*, project: Project, volunteer: Volunteer) -> bool:
    """BOINC's adaptive replication: every result of a volunteer not trusted yet is checked, and a
    `spot_check_rate` share of a trusted one's."""
    trusted = volunteer.is_trusted(threshold=project.trust_threshold)
    return not trusted or random.random() < project.spot_check_rate


def _sendable() -> QuerySet[WorkUnit]:
    running = Project.Status.RUNNING
    return WorkUnit.objects.filter(status=WorkUnit.Status.OPEN, wanted__gt=0, project__status=running)


def work_sendable() -> bool:
    """Is an instance of some running project's work waiting to be sent?"""
    return _sendable().exists()


def _next_open_work_unit(
    *, user: User, order: list[int], allowed: Q | None = None, device_id: int | None = None
) -> WorkUnit | None:
    """The project furthest below its resource share that has work for `user` (shares.py), and its oldest
    open round's work first, so that each project's round keeps moving. One query over the open work units
    (one round's worth per project, fed by the feeder) whatever the history. `allowed`: a condition on the
    work units (the volunteer's choice of projects, those that did not fit). Stage units: those the device's
    swarm membership allows, its own stage's first (projects/swarms.py). `order`: shares.shares_order()."""
    if not order:
        return None
    rank = Case(
        *(When(project_id=pk, then=Value(i)) for i, pk in enumerate(order)), default=Value(len(order))
    )
    return (
        _sendable()
        .filter(allowed or Q())
        .filter(_not_computing_its_round(device_id=device_id))
        .filter(swarms.stage_units_eligible(device_id=device_id))
        .select_for_update(skip_locked=True, of=("self",), no_key=True)
        .filter(_new_to(user=user))
        .select_related(*_SENT_WITH)
        .order_by(rank, *swarms.stage_units_own_first(device_id=device_id), "version__created_at", "id")
        .first()
    )


def _not_computing_its_round(*, device_id: int | None) -> Q:
    """No second unit of a round whose units end with it (Project.units_end_with_round) for a device computing
    one: it would start when the first ends, with the round, and the round would wait for it. A browser asks
    for its next unit as soon as it gets one (prefetch); the heterogeneous benchmark's volunteers doing so
    made its rounds at 64 take 55 s for units of 40 s. Its `ready` is parked instead, and served once that
    unit's result is in (VolunteerConsumer.on_tensors) or when the next round opens."""
    if device_id is None:
        return Q()
    computing = _computing(device_ids=[device_id]).filter(work_unit__version=OuterRef("version"))
    return ~Project.units_end_with_round_q("project__") | Q(~Exists(computing))


def _computing_rounds(*, units: list[WorkUnit], device_ids: list[int]) -> set[tuple[int, int]]:
    """(device, version) for each of the units' rounds that end with them which a device computes a unit of:
    no query unless the units have such a round."""
    versions = {unit.version_id for unit in units if unit.project.units_end_with_round}
    if not versions or not device_ids:
        return set()
    computing = _computing(device_ids=device_ids).filter(work_unit__version_id__in=versions)
    return set(computing.values_list("device_id", "work_unit__version_id"))


def _computing(*, device_ids: list[int]) -> QuerySet[Result]:
    """The devices' instances in progress in rounds whose units end with them."""
    return Result.objects.filter(
        Project.units_end_with_round_q("work_unit__project__"),
        device_id__in=device_ids,
        status=Result.Status.IN_PROGRESS,
    )


# What sending a unit reads: the assign message, fitting and the unit's FLOPs.
_SENT_WITH = (
    "project",
    "version__weights",
    "version__wire_weights",
    "version__wire_delta",
    "shard__blob",
    "project__graph",
)


def _new_to(*, user: User) -> Q:
    """A volunteer gets an instance of a work unit once (BOINC's rule: replicas compared by a quorum come from
    different volunteers). Stage units are never replicated (the server recomputes them), and a stage may
    have one member: it gets a unit again once its earlier instance timed out, was released or cancelled, or a
    unit of its stage would wait for a member that may never come. That instance is then reopened
    (_instance): the database keeps one per volunteer and unit."""
    mine = Result.objects.filter(work_unit=OuterRef("pk"), volunteer=user)
    return ~Exists(mine) | (~Q(stage_kind="") & ~Exists(mine.exclude(status__in=Result.DEAD)))


def _split_to_fit(*, work_unit: WorkUnit, samples: int) -> None:
    """A slow device gets the front of a fresh work unit; the rest becomes a work unit of its own. Never a
    stage unit: its micro-batch is fixed by its step."""
    if work_unit.count <= samples or work_unit.total_results or work_unit.stage_kind:
        return
    shard, offset = shard_position(first=work_unit.shard, offset=work_unit.offset + samples)
    WorkUnit.objects.create(
        project=work_unit.project,
        version=work_unit.version,
        shard=shard,
        offset=offset,
        count=work_unit.count - samples,
    )
    work_unit.count = samples


# --- receiving ------------------------------------------------------------------------------------


def result_receive(
    *,
    user: User,
    work_unit_id: int,
    samples: int,
    loss: float | None,
    compute_ms: int,
    download_ms: int = 0,
    payload: bytes,
    model_version: int | None = None,
    sent_digest: str = "",
) -> ResultOutcome:
    """Store a volunteer's update and queue it for validation. Duplicates and late results are harmless.
    An update claiming another model version than its work unit's is invalid at once (`model_version`
    None: not claimed). `sent_digest`: a stage result's payload went by the peer ring (projects/ring.py)."""
    if len(payload) > settings.CROWDTRAIN["MAX_RESULT_BYTES"]:
        raise ResultError("too_large", "The update is larger than this server accepts.")
    with transaction.atomic():
        result = _result_for(user=user, work_unit_id=work_unit_id)
        if result.status != Result.Status.IN_PROGRESS:
            return result_outcome(result=result)
        _record_arrival(
            result=result, samples=samples, loss=loss, compute_ms=compute_ms, download_ms=download_ms
        )
        wrong_version = _version_problem(result=result, model_version=model_version)
        if wrong_version:
            result.save()
            _refuse(result=result, reason=wrong_version)
        else:
            result.blob = blob_put(data=payload)
            result.digest, result.sent_digest = result.blob.sha256, sent_digest
            result.save()
            transaction.on_commit(lambda: notify.result_received(result_id=result.pk))
    # Read it back: with eager tasks (tests) validation has already run inside on_commit.
    return result_outcome(result=Result.objects.select_related("credit").get(pk=result.pk))


@dataclass(frozen=True)
class Arrival:
    """A result as a connection received it: result_receive's arguments."""

    user: User
    work_unit_id: int
    samples: int
    loss: float | None
    compute_ms: int
    download_ms: int
    payload: bytes
    model_version: int | None = None
    sent_digest: str = ""


# What an arrival writes on its result's row (results_receive writes them for a batch in one statement).
ARRIVAL_FIELDS = [
    "status", "received_at", "samples", "loss", "compute_ms", "download_ms", "blob", "digest", "sent_digest"
]  # fmt: skip


def results_receive(*, arrivals: list[Arrival]) -> list[ResultOutcome | None]:
    """result_receive for several results at once (a web process gathers its connections' results while its
    previous batch runs: workers/arrivals.py): one transaction, the results locked in one query, their blobs'
    rows upserted in one and their own rows written in one, and one validation task for them all, where each
    result was two transactions, seven queries and a task of its own (issue 15). What the batch does not
    handle is None, for the caller to serve alone with result_receive once this committed: an arrival whose
    instance is unknown, not in progress, on another version than claimed or too large (result_receive's
    answers and errors), or locked by another transaction (SKIP LOCKED: a batch never waits for a row)."""
    with transaction.atomic():
        taken = _arrived(arrivals=arrivals)
        blobs = blobs_put(datas=[arrivals[i].payload for i in taken])
        for (i, result), blob in zip(taken.items(), blobs, strict=True):
            a = arrivals[i]
            _record_arrival(
                result=result,
                samples=a.samples,
                loss=a.loss,
                compute_ms=a.compute_ms,
                download_ms=a.download_ms,
            )
            result.blob, result.digest, result.sent_digest = blob, blob.sha256, a.sent_digest
        bulk_write(list(taken.values()), ARRIVAL_FIELDS)
        ids = [result.pk for result in taken.values()]
        if ids:
            transaction.on_commit(lambda: notify.results_received(result_ids=ids))
    outcomes = _outcomes(result_ids=ids)
    return [outcomes[taken[i].pk] if i in taken else None for i in range(len(arrivals))]


def _arrived(*, arrivals: list[Arrival]) -> dict[int, Result]:
    """The arrivals the batch handles, by their place in `arrivals`: their results locked, in id order. By
    two lists, not 32 pairs OR'd (which Django took 40 ms to compile, cProfile): a volunteer's other result
    in flight on one of the batch's units (a replica) is locked with them, and left as it is."""
    units, users = {a.work_unit_id for a in arrivals}, {a.user.pk for a in arrivals}
    locked = Result.objects.select_for_update(of=("self",), no_key=True, skip_locked=True)
    rows = locked.select_related("work_unit__version").filter(
        work_unit_id__in=units, volunteer_id__in=users, status=Result.Status.IN_PROGRESS
    )
    found = {(row.volunteer_id, row.work_unit_id): row for row in rows.order_by("pk")}
    taken: dict[int, Result] = {}
    for i, arrival in enumerate(arrivals):
        # Popped: the same result twice in one batch is one arrival and then, alone, a duplicate.
        result = found.pop((arrival.user.pk, arrival.work_unit_id), None)
        if result is not None and _plain(arrival=arrival, result=result):
            taken[i] = result
    return taken


def _plain(*, arrival: Arrival, result: Result) -> bool:
    too_large = len(arrival.payload) > settings.CROWDTRAIN["MAX_RESULT_BYTES"]
    return not too_large and _version_problem(result=result, model_version=arrival.model_version) is None


def _outcomes(*, result_ids: list[int]) -> dict[int, ResultOutcome]:
    """As the volunteers are answered once the batch committed (with eager tasks, validated already)."""
    results = list(Result.objects.select_related("credit").filter(pk__in=result_ids))
    standings = _standings(user_ids=sorted({result.volunteer_id for result in results}))
    return {
        result.pk: result_outcome(result=result, standing=standings.get(result.volunteer_id, Standing()))
        for result in results
    }


def result_refuse(*, user: User, work_unit_id: int, reason: str) -> bool:
    """The volunteer answered an instance it holds with a result the protocol refuses (a malformed message):
    that instance is invalid at once and its slice goes to someone else, rather than waiting for its
    deadline. False if the volunteer holds no such instance in progress (then nothing changes)."""
    with transaction.atomic():
        result = _result_for(user=user, work_unit_id=work_unit_id)
        if result.status != Result.Status.IN_PROGRESS:
            return False
        result.status, result.received_at = Result.Status.RECEIVED, timezone.now()
        result.save(update_fields=["status", "received_at"])
        _refuse(result=result, reason=reason)
    return True


def _record_arrival(
    *, result: Result, samples: int, loss: float | None, compute_ms: int, download_ms: int
) -> None:
    """The client's timings are its word only: a device can never claim more time than the server saw the
    instance out (they drive the device's speed and the dashboard's compute share, never credit). A unit
    without a loss stores none, whatever the client said (an older page sent 0 for them)."""
    result.status = Result.Status.RECEIVED
    result.received_at = timezone.now()
    result.samples = samples
    result.loss = loss if stages.unit_has_loss(work_unit=result.work_unit) else None
    out_ms = int((result.received_at - result.sent_at).total_seconds() * 1000)
    bound = max(0, min(out_ms, MAX_REPORTED_MS))
    result.compute_ms, result.download_ms = min(max(0, compute_ms), bound), min(max(0, download_ms), bound)


def _version_problem(*, result: Result, model_version: int | None) -> str | None:
    expected = result.work_unit.version.number
    if model_version is None or model_version == expected:
        return None
    return f"computed on model version {model_version}, but the work unit is on version {expected}"


def _refuse(*, result: Result, reason: str) -> None:
    """Invalid without validation (its own words give it away): as validation.py's verdicts, no credit,
    trust reset and the slice wanted again; its volunteer hears it like any verdict."""
    # The work unit's row only (of "self"): locking the joined project's too, while holding the arriving
    # result, crossed project_step, which holds the project and waits for the round's arrivals.
    locked = WorkUnit.objects.select_for_update(of=("self",), no_key=True).select_related("project")
    result.work_unit = locked.get(pk=result.work_unit_id)
    result_invalidate(result=result, reason=reason)
    transaction.on_commit(lambda: notify.results_decided(result_ids=[result.pk]))


def _result_for(*, user: User, work_unit_id: int) -> Result:
    result = (
        Result.objects.select_for_update(of=("self",), no_key=True)
        .select_related("work_unit__version")
        .filter(work_unit_id=work_unit_id, volunteer=user)
        .first()
    )
    if result is not None:
        return result
    if WorkUnit.objects.filter(pk=work_unit_id).exists():
        raise ResultError("not_assigned", f"Work unit {work_unit_id} is not assigned to you.")
    raise ResultError("unknown_work_unit", f"There is no work unit {work_unit_id}.")


@dataclass(frozen=True)
class Standing:
    """A volunteer's credit as its Contribute page shows it: the total and the recent average, read together
    (the page keeps the average that came with the highest total)."""

    total_flops: int = 0
    recent_credit: float = 0.0


def result_outcome(*, result: Result, standing: Standing | None = None) -> ResultOutcome:
    """`standing`: the volunteer's credit, if the caller read it already (else read here)."""
    credit = getattr(result, "credit", None)
    if standing is None:
        standing = _standings(user_ids=[result.volunteer_id]).get(result.volunteer_id, Standing())
    return ResultOutcome(
        work_unit_id=result.work_unit_id,
        status=_outcome_status(result),
        reason=result.reason,
        credit_flops=credit.flops if credit else 0,
        total_credit_flops=standing.total_flops,
        recent_credit=standing.recent_credit,
    )


def _standings(*, user_ids: list[int]) -> dict[int, Standing]:
    now = timezone.now()
    rows = Volunteer.objects.filter(user_id__in=user_ids).only(
        "user_id", "total_flops", "expavg_credit", "expavg_time"
    )
    return {row.user_id: Standing(row.total_flops, row.recent_credit(now=now)) for row in rows}


def _outcome_status(result: Result) -> str:
    if result.status != Result.Status.RECEIVED:
        return "late"
    return str(result.validation)


def results_announce(*, result_ids: list[int]) -> None:
    """Tell each volunteer how its result was judged, once the verdict committed; an invalid result's slice
    is wanted again, so every volunteer hears of work."""
    invalid = False
    results = list(Result.objects.filter(pk__in=result_ids).select_related("credit").order_by("pk"))
    # One query for every volunteer's credit: a validation batch announces dozens of verdicts at once.
    standings = _standings(user_ids=[result.volunteer_id for result in results])
    for result in results:
        outcome = result_outcome(result=result, standing=standings.get(result.volunteer_id, Standing()))
        notify.result_decided(
            user_id=result.volunteer_id,
            work_unit_id=outcome.work_unit_id,
            status=outcome.status,
            reason=outcome.reason,
            credit_flops=outcome.credit_flops,
            total_credit_flops=outcome.total_credit_flops,
            recent_credit=outcome.recent_credit,
        )
        invalid = invalid or result.validation == Result.Validation.INVALID
    if invalid:
        notify.work_available()


# --- giving back, timing out, cancelling -----------------------------------------------------------


def results_release(*, user: User, work_unit_ids: list[int]) -> int:
    """A volunteer disconnected: reopen what it held so others pick it up at once (no penalty)."""
    with transaction.atomic():
        results = list(_in_progress(Q(volunteer=user, work_unit_id__in=work_unit_ids)))
        for result in results:
            result.status = Result.Status.RELEASED
            result.save(update_fields=["status"])
            _reopen(work_unit=result.work_unit, failed=False)
    return len(results)


def results_expire() -> list[int]:
    """Instances past their deadline time out and their work units are sent again (the transitioner)."""
    with transaction.atomic():
        late = list(_in_progress(Q(deadline__lt=timezone.now())))
        for result in late:
            result.status = Result.Status.TIMED_OUT
            result.save(update_fields=["status"])
            _reopen(work_unit=result.work_unit, failed=True)
    return sorted({r.work_unit.project_id for r in late})


def results_unvalidated() -> list[int]:
    """Received results whose validation never ran (see VALIDATION_RETRY_SECONDS), oldest first.
    Queuing one again is harmless: result_validate decides a result once and ignores it afterwards.
    Results that passed their checks and wait for their work unit's quorum are not lost, only waiting."""
    cutoff = timezone.now() - timedelta(seconds=VALIDATION_RETRY_SECONDS)
    return list(_unvalidated(received_before=cutoff).values_list("pk", flat=True)[:VALIDATION_RETRY_BATCH])


def results_give_up() -> list[int]:
    """Received results still unvalidated VALIDATION_GIVE_UP_SECONDS after arrival (the server kept
    failing to judge them) are late: no credit, no penalty, their slice is wanted again and their volunteers
    are told. Returns their ids. Without this the transitioner would queue them again forever."""
    cutoff = timezone.now() - timedelta(seconds=VALIDATION_GIVE_UP_SECONDS)
    stuck = _unvalidated(received_before=cutoff)[:VALIDATION_RETRY_BATCH]
    return [pk for pk in stuck.values_list("pk", flat=True) if _give_up(result_id=pk)]


def _unvalidated(*, received_before: datetime) -> QuerySet[Result]:
    """Received results not judged yet and not waiting for a quorum either, oldest first."""
    return Result.objects.filter(
        status=Result.Status.RECEIVED,
        validation=Result.Validation.PENDING,
        checked=False,
        received_at__lt=received_before,
    ).order_by("received_at")


def _give_up(*, result_id: int) -> bool:
    with transaction.atomic():
        work_unit_id = Result.objects.values_list("work_unit_id", flat=True).get(pk=result_id)
        # Skipped if being validated right now (validation holds its work unit): the next run decides.
        work_units = WorkUnit.objects.select_for_update(skip_locked=True, no_key=True)
        if not work_units.filter(pk=work_unit_id).exists():
            return False
        unvalidated = _unvalidated(received_before=timezone.now()).select_for_update(no_key=True)
        result = unvalidated.filter(pk=result_id).first()
        if result is None:
            return False  # decided meanwhile
        result.status, result.reason = Result.Status.CANCELLED, GAVE_UP
        result.save(update_fields=["status", "reason"])
        _reopen(work_unit=result.work_unit, failed=False)
        transaction.on_commit(lambda: notify.results_decided(result_ids=[result_id]))
    return True


def _in_progress(condition: Q) -> list[Result]:
    return list(
        Result.objects.select_for_update(of=("self",), no_key=True)
        .select_related("work_unit")
        .filter(condition, status=Result.Status.IN_PROGRESS)
        .order_by("pk")
    )


def _reopen(*, work_unit: WorkUnit, failed: bool) -> None:
    work_unit = WorkUnit.objects.select_for_update(no_key=True).get(pk=work_unit.pk)
    if not work_unit.is_open:
        return
    if failed:
        work_unit_fail(work_unit=work_unit)
    else:
        work_unit.wanted += 1
        work_unit.total_results -= 1
        work_unit.save(update_fields=["wanted", "total_results"])


def result_invalidate(*, result: Result, reason: str) -> None:
    """Invalid: no credit, trust reset, and another instance of an open work unit is wanted. The caller
    holds the locks of the result and of its work unit (`result.work_unit`). Refusals (above) and
    validation.py's verdicts alike."""
    result_reject(result=result, reason=reason)
    if result.work_unit.is_open:
        work_unit_fail(work_unit=result.work_unit)


def result_reject(*, result: Result, reason: str) -> None:
    """Invalid, and its volunteer's trust reset; whether its slice is wanted again is the caller's call (a
    quorum decides that for all its results at once)."""
    result.validation, result.reason = Result.Validation.INVALID, reason[:200]
    result.save(update_fields=["validation", "reason", "update_norm", "spot_checked", "checked"])
    volunteer_record_invalid(user_id=result.volunteer_id)


def work_unit_fail(*, work_unit: WorkUnit) -> None:
    """An instance of an open work unit (locked by the caller) timed out or was invalid: send another,
    or give the slice up if it keeps failing (its samples are then fed anew)."""
    work_unit.record_failure()
    work_unit.save(update_fields=["wanted", "error_results", "status"])
    if work_unit.status == WorkUnit.Status.ERRORED:
        results_abandon(work_unit_ids=[work_unit.pk], reason="this work unit failed too often")


def results_awaiting_quorum(*, work_unit_ids: list[int]) -> QuerySet[Result]:
    """Locked, oldest first: results that passed their own checks and wait for their work unit's quorum."""
    return (
        Result.objects.select_for_update(of=("self",), no_key=True)
        .filter(
            work_unit_id__in=work_unit_ids,
            status=Result.Status.RECEIVED,
            validation=Result.Validation.PENDING,
            checked=True,
        )
        .order_by("pk")
    )


def results_abandon(*, work_unit_ids: list[int], reason: str) -> None:
    """Results that passed their checks but still wait for a quorum of work units that will never have
    one (cancelled or errored) are late: no credit, no penalty, and their volunteers are told. (Results
    still in the validation queue are found late when validated.)"""
    waiting = list(results_awaiting_quorum(work_unit_ids=work_unit_ids).values_list("pk", flat=True))
    if not waiting:
        return
    Result.objects.filter(pk__in=waiting).update(status=Result.Status.CANCELLED, reason=reason[:200])
    transaction.on_commit(lambda: notify.results_decided(result_ids=waiting))


def work_units_cancel(*, work_units: list[WorkUnit], reason: str) -> None:
    """Cancel work units and their instances in flight, and tell the volunteers holding them."""
    ids = [w.pk for w in work_units]
    in_flight = Result.objects.filter(work_unit_id__in=ids, status=Result.Status.IN_PROGRESS)
    by_user: dict[int, list[int]] = {}
    for work_unit_id, user_id in in_flight.values_list("work_unit_id", "volunteer_id"):
        by_user.setdefault(user_id, []).append(work_unit_id)
    in_flight.update(status=Result.Status.CANCELLED, reason=reason)
    WorkUnit.objects.filter(pk__in=ids).update(status=WorkUnit.Status.CANCELLED)
    results_abandon(work_unit_ids=ids, reason=reason)
    transaction.on_commit(lambda: notify.work_cancelled(by_user=by_user, reason=reason))
