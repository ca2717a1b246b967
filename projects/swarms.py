"""Swarms per stage (issue 14, item 4; docs/pipeline.md "Swarms per stage"): which connected devices serve
which stage of a pipeline project, and so which stage units each device is offered.

- **Membership** (StageMember): a device serving a pipeline project is a member of one of its stages. While
  it is, the scheduler (lifecycle._next_open_work_unit) offers it that stage's units only, so it keeps the
  stage's graph and weights cached (the browser caches them per stage and version). It leaves when it
  disconnects, cleanly or not (workers/liveness.py).
- **Placement**: a device offered a unit of a project it does not serve yet joins the stage with the least
  capacity for its load: its members' summed speed over its FLOPs per step. A stage without members comes
  first; ties go to the stage with the most ready units, then to the first.
- **A stage nobody serves** is open to every device: a member of another stage that takes one of its units
  moves there. A stage whose volunteers all left is served at once, not at the next rebalancing, and fewer
  devices than stages still train (each moves to where the work is). A member's own stage comes first.
- **Routing**: a ready unit goes to the member of its stage expected to finish it first: (units it holds + 1)
  x the unit's FLOPs / its speed (its valid stage results' FLOPs per compute time, else the device's speed).
  A member asking while R units of its stage are ready gets one unless R other connected members with a free
  slot would finish sooner. A unit is held for them for ROUTE_HOLD_SECONDS at most after it became ready, so
  a faster member that never asks (a paused browser) cannot hold work back for long.
- **Rebalancing** (beat, `pipelines_rebalance`): memberships of departed devices, of devices whose volunteer's
  preferences no longer allow the project and of stages that no longer exist go; then at most one member per
  project moves, from a stage with two members or more, and only one that has served its stage for
  REBALANCE_MIN_STAY_SECONDS (no ping-pong). Into a stage without members (the one with the most ready units)
  goes the member whose leaving costs the least capacity; else the one move that raises the smallest stage
  capacity (members' summed speed over the stage's FLOPs per step, the stage that bounds the swarm's
  throughput) by REBALANCE_GAIN at least. Ready-unit queues are not the signal: each step begins with all of
  stage 0's forward units ready, however well the stages are served. Units in flight are not interrupted: a
  moved device finishes them, and its next units are its new stage's.
Each question here is one or two indexed queries. The scheduler's own condition adds three EXISTS on the
member table's (project, device) and (project, stage) indexes to its one query, which data-parallel units
never run (their first term decides; EXPLAIN ANALYZE shows the subplans "never executed").
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

from django.db import transaction
from django.db.models import (
    Case,
    Count,
    Exists,
    F,
    FloatField,
    IntegerField,
    OuterRef,
    Q,
    Subquery,
    Sum,
    Value,
    When,
)
from django.db.models.expressions import Expression
from django.db.models.functions import Coalesce, NullIf
from django.utils import timezone

from engine.spec import MAX_IN_FLIGHT
from projects.models import Project, Result, StageMember, WorkUnit
from projects.stages import project_partition, unit_flops
from workers.models import Device
from workers.preferences import devices_allowing

ROUTE_HOLD_SECONDS = 10.0
REBALANCE_GAIN = 0.2  # a move must raise the smallest stage capacity by this fraction (speeds are noisy)
REBALANCE_MIN_STAY_SECONDS = 60.0


# --- selectors ------------------------------------------------------------------------------------------


def stage_devices(*, project_id: int, stage: int) -> list[int]:
    """Ids of the devices serving `stage` of the project (the peer ring: who receives its activations)."""
    members = StageMember.objects.filter(project_id=project_id, stage=stage).order_by("device_id")
    return list(members.values_list("device_id", flat=True))


def device_stage(*, project_id: int, device_id: int) -> int | None:
    """The stage the device serves in the project, if any."""
    return (
        StageMember.objects.filter(project_id=project_id, device_id=device_id)
        .values_list("stage", flat=True)
        .first()
    )


def stages_adjacent(*, device_id: int, other_id: int) -> bool:
    """Do the two devices serve adjacent stages (k and k + 1, either way) of one project?"""
    theirs = dict(StageMember.objects.filter(device_id=other_id).values_list("project_id", "stage"))
    mine = StageMember.objects.filter(device_id=device_id, project_id__in=list(theirs))
    return any(
        abs(theirs[project] - stage) == 1 for project, stage in mine.values_list("project_id", "stage")
    )


# --- the scheduler's rule -----------------------------------------------------------------------------


def stage_units_eligible(*, device_id: int | None) -> Q:
    """The scheduler's condition for `device_id` (data-parallel units always pass): a unit of the stage it
    serves, of a project it serves no stage of yet (it is placed when it takes one), or of a stage nobody
    serves. No device (a caller without one): any unit, as before swarms."""
    if device_id is None:
        return Q()
    mine = StageMember.objects.filter(device_id=device_id, project_id=OuterRef("project_id"))
    anyone = StageMember.objects.filter(project_id=OuterRef("project_id"), stage=OuterRef("stage"))
    own, joined, served = Exists(mine.filter(stage=OuterRef("stage"))), Exists(mine), Exists(anyone)
    return Q(stage_kind="") | Q(own) | ~Q(joined) | ~Q(served)


def stage_units_own_first(*, device_id: int | None) -> list[Expression]:
    """The scheduler's ordering key (none without a device): the device's own stage's units before units of
    stages it would move to. Data-parallel units are decided by the first WHEN, never running the EXISTS."""
    if device_id is None:
        return []
    own = StageMember.objects.filter(
        device_id=device_id, project_id=OuterRef("project_id"), stage=OuterRef("stage")
    )
    first = Case(
        When(stage_kind="", then=Value(0)),
        When(Exists(own), then=Value(0)),
        default=Value(1),
        output_field=IntegerField(),
    )
    return [first]


def stage_unit_claim(*, work_unit: WorkUnit, device_id: int) -> bool:
    """May the device take this stage unit, which the scheduler found for it (stage_units_eligible)? Places
    the device, or moves it to the unit's stage if nobody serves that, as taking the unit requires. False
    when the unit is held for a member expected to finish it sooner, or the device was just placed on
    another stage (the caller then looks again, under the new membership)."""
    stage = work_unit.stage or 0
    member = StageMember.objects.filter(project_id=work_unit.project_id, device_id=device_id).first()
    if member is None:
        return _place(project=work_unit.project, device_id=device_id).stage == stage
    if member.stage != stage:  # the scheduler offers another stage's unit only when nobody serves that stage
        StageMember.objects.filter(pk=member.pk).update(stage=stage, joined_at=timezone.now())
        return True
    return _first_to_finish(work_unit=work_unit, device_id=device_id)


def _place(*, project: Project, device_id: int) -> StageMember:
    member, _ = StageMember.objects.get_or_create(
        project=project, device_id=device_id, defaults={"stage": _neediest_stage(project=project)}
    )
    return member


def _neediest_stage(*, project: Project) -> int:
    """The stage with the least capacity for its load (no members: none), then the most ready units."""
    loads = [stage.step_flops for stage in project_partition(project=project).stages]
    members = StageMember.objects.filter(project=project, device__disconnected_at__isnull=True)
    speeds = dict(members.values("stage").annotate(total=Sum(_speed())).values_list("stage", "total"))
    ready = _ready_by_stage(project_id=project.pk)
    return min(
        range(len(loads)),
        key=lambda k: (float(speeds.get(k) or 0.0) / max(loads[k], 1), -ready.get(k, 0), k),
    )


def _first_to_finish(*, work_unit: WorkUnit, device_id: int) -> bool:
    """Is the device among the members of the unit's stage expected to finish a unit first, as many as
    there are ready units? (See the module's docstring; a unit ready ROUTE_HOLD_SECONDS goes to anyone.)"""
    if work_unit.created_at < timezone.now() - timedelta(seconds=ROUTE_HOLD_SECONDS):
        return True
    members = _members(project_id=work_unit.project_id, stage=work_unit.stage or 0)
    finish = {device: (held + 1) / speed for device, held, speed in members}
    mine = finish.get(device_id, 0.0)
    sooner = sum(
        1
        for device, held, _ in members
        if device != device_id and held < MAX_IN_FLIGHT and finish[device] < mine
    )
    if not sooner:
        return True
    return sooner < _ready_by_stage(project_id=work_unit.project_id).get(work_unit.stage or 0, 0)


def _members(*, project_id: int, stage: int) -> list[tuple[int, int, float]]:
    """(device id, units it holds, speed) of the stage's connected members."""
    held = (
        Result.objects.filter(device_id=OuterRef("device_id"), status=Result.Status.IN_PROGRESS)
        .order_by()
        .values("device_id")
        .annotate(n=Count("pk"))
        .values("n")
    )
    members = StageMember.objects.filter(
        project_id=project_id, stage=stage, device__disconnected_at__isnull=True
    ).annotate(held=Coalesce(Subquery(held, output_field=IntegerField()), 0), speed=_speed())
    return [(d, int(h), float(s)) for d, h, s in members.values_list("device_id", "held", "speed")]


def _speed() -> Expression:
    """A member's speed in GFLOPS: measured on its stage results, else its device's, else 1."""
    return Coalesce(
        NullIf(F("speed_gflops"), 0.0),
        NullIf(F("device__observed_gflops"), 0.0),
        NullIf(F("device__gflops"), 0.0),
        Value(1.0),
        output_field=FloatField(),
    )


def _ready_by_stage(*, project_id: int) -> dict[int, int]:
    """{stage: its units waiting to be sent} (the scheduler's sendable index)."""
    ready = WorkUnit.objects.filter(project_id=project_id, status=WorkUnit.Status.OPEN, wanted__gt=0)
    rows = ready.exclude(stage_kind="").values("stage").annotate(n=Count("pk")).values_list("stage", "n")
    return {int(stage or 0): int(n) for stage, n in rows}


# --- what members do ----------------------------------------------------------------------------------


def stage_member_observe(*, result: Result) -> None:
    """A valid stage result (in its verdict's transaction): its device's measured speed on the project's
    stage units, which routing reads."""
    if result.device_id is None:
        return
    member = (
        StageMember.objects.select_for_update(no_key=True)
        .filter(project_id=result.work_unit.project_id, device_id=result.device_id)
        .first()
    )
    if member is not None:
        member.observe(flops=unit_flops(work_unit=result.work_unit), compute_ms=result.compute_ms)
        member.save(update_fields=["speed_gflops"])


def stage_members_leave(*, device_ids: list[int]) -> int:
    """The devices departed: they serve no stage any more (the units they held are released by the
    lifecycle, and go to the other members of their stage, or to anyone if the stage is left empty)."""
    deleted, _ = StageMember.objects.filter(device_id__in=device_ids).delete()
    return deleted


# --- rebalancing ----------------------------------------------------------------------------------------


def pipelines_rebalance() -> int:
    """Beat: rebalance every running pipeline project's swarms; returns how many members moved."""
    running = Project.objects.filter(status=Project.Status.RUNNING, mode=Project.Mode.PIPELINE)
    return sum(pipeline_rebalance(project_id=pk) for pk in running.values_list("pk", flat=True))


def pipeline_rebalance(*, project_id: int) -> int:
    """Drop memberships that no longer serve, then move at most one member to the bottleneck stage (see the
    module's docstring). Returns how many members moved (0 or 1)."""
    project = Project.objects.get(pk=project_id)
    loads = [stage.step_flops for stage in project_partition(project=project).stages]
    with transaction.atomic():
        gone = Q(device__disconnected_at__isnull=False) | Q(stage__gte=len(loads)) | _refusing(project_id)
        StageMember.objects.filter(Q(project=project) & gone).delete()
        members = list(
            StageMember.objects.select_for_update(no_key=True, of=("self",))
            .filter(project=project)
            .annotate(speed=_speed())
            .order_by("pk")
        )
        move = _move(members=members, ready=_ready_by_stage(project_id=project_id), loads=loads)
        if move is None:
            return 0
        member, stage = move
        member.stage, member.joined_at = stage, timezone.now()
        member.save(update_fields=["stage", "joined_at"])
    return 1


def _refusing(project_id: int) -> Q:
    """Members whose volunteer's preferences no longer allow the project (changed since they joined): they
    never ask for its units again, and routing held units for them."""
    members = Device.objects.filter(stage_memberships__project_id=project_id)
    return ~Q(device__in=devices_allowing(devices=members, project_id=project_id))


def _move(
    *, members: Sequence[StageMember], ready: dict[int, int], loads: list[int]
) -> tuple[StageMember, int] | None:
    """Which member goes to which stage, if any: into a stage without members, the move that keeps the most
    capacity everywhere; else the move that raises the smallest capacity (summed speed over FLOPs per step)
    by REBALANCE_GAIN at least. Queues are not the signal: every step starts with all M forward units of
    stage 0 ready (GPipe's fill), which says nothing about which stage is short of volunteers."""
    by_stage: dict[int, list[StageMember]] = {k: [] for k in range(len(loads))}
    for member in members:
        by_stage[member.stage].append(member)
    settled = timezone.now() - timedelta(seconds=REBALANCE_MIN_STAY_SECONDS)
    movable = [m for k, ms in by_stage.items() if len(ms) >= 2 for m in ms if m.joined_at <= settled]
    empty = [k for k in by_stage if not by_stage[k]]
    if empty:
        target = max(empty, key=lambda k: (ready.get(k, 0), -k))
        if not movable:
            return None
        best = max(movable, key=lambda m: (_smallest_capacity(by_stage, loads, m, target, empty), -m.pk))
        return best, target
    now = _smallest_capacity(by_stage, loads)
    moves = [(_smallest_capacity(by_stage, loads, m, k), -m.pk, m, k) for m in movable for k in by_stage]
    if not moves:
        return None
    after, _, member, target = max(moves, key=lambda t: t[:2])
    return (member, target) if after > now * (1 + REBALANCE_GAIN) else None


def _smallest_capacity(
    by_stage: dict[int, list[StageMember]],
    loads: list[int],
    moved: StageMember | None = None,
    target: int = 0,
    ignore: Sequence[int] = (),
) -> float:
    """The smallest of the stages' capacities (summed speed / FLOPs per step), `moved` counted in `target`;
    stages in `ignore` (still empty) left out."""

    def capacity(k: int) -> float:
        speeds = [m.speed for m in by_stage[k] if m is not moved]  # type: ignore[attr-defined]
        if moved is not None and k == target:
            speeds.append(moved.speed)  # type: ignore[attr-defined]
        return sum(speeds) / max(loads[k], 1)

    return min((capacity(k) for k in by_stage if k not in ignore or k == target), default=0.0)
