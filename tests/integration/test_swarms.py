"""projects/swarms.py: stage membership, placement, routing, rebalancing and departures, with devices asking
for work through the real scheduler (lifecycle.work_unit_offer) and results judged by the real validation."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import torch
from django.contrib.auth.models import User
from django.db.models import Sum
from django.utils import timezone

from projects import lifecycle, stages, swarms
from projects.models import ModelVersion, Project, Result, StageMember, WorkUnit
from projects.services import version_weights
from tests.integration.test_pipeline_mode import (
    expected_credit,
    pipeline_project,
    send,
    torch_steps,
    users,
)
from workers.liveness import devices_depart, devices_sweep
from workers.models import CreditEntry, Device
from workers.preferences import preferences_save
from workers.services import device_register

Crew = list[tuple[User, Device]]
LONG_AGO = timedelta(seconds=swarms.REBALANCE_MIN_STAY_SECONDS + 1)


def crew(*names: str, gflops: float = 10.0) -> Crew:
    return [
        (
            user,
            device_register(
                user=user, client_id=f"{user.username}-tab", backend="webgl", gflops=gflops, user_agent=""
            ),
        )
        for user in users(*names)
    ]


def offer(member: tuple[User, Device]) -> Result | None:
    user, device = member
    return lifecycle.work_unit_offer(user=user, device=device).result


def stage_of(member: tuple[User, Device], project: Project) -> int | None:
    return swarms.device_stage(project_id=project.pk, device_id=member[1].pk)


def join(project: Project, member: tuple[User, Device], stage: int, **fields: Any) -> None:
    StageMember.objects.create(project=project, device=member[1], stage=stage, **fields)


def fed(project: Project) -> Project:
    """The step's first units (these tests' transactions never commit, so project_start's feed never ran)."""
    lifecycle.work_units_feed(project_id=project.pk)
    return project


def served_long(project: Project) -> None:
    StageMember.objects.filter(project=project).update(joined_at=timezone.now() - LONG_AGO)


def work(project: Project, members: Crew, steps: int) -> dict[int, set[int]]:
    """Every device asks and answers honestly until `steps` steps are published; the stages each device's
    units were of, by device id."""
    seen: dict[int, set[int]] = {device.pk: set() for _, device in members}
    for _ in range(60 * steps):
        if project.current_version().number >= steps:
            return seen
        for user, device in members:
            result = offer((user, device))
            if result is not None:
                seen[device.pk].add(result.work_unit.stage or 0)
                assert send(user, result).status == "valid", Result.objects.get(pk=result.pk).reason
    raise AssertionError("the steps did not complete")


# --- placement and stickiness ---------------------------------------------------------------------------


@pytest.mark.django_db
def test_devices_join_the_stage_that_needs_them_most(researcher: User, digits_dataset: Any) -> None:
    """At a step's start only stage 0 has ready units: the first device serves it; the next fill the stages
    nobody serves (and wait for their units); a fourth joins the stage with the least speed for its FLOPs."""
    project = fed(pipeline_project(researcher, digits_dataset))  # the MLP in 3 stages: fc1 | relu | fc2
    loads = [stage.step_flops for stage in stages.project_partition(project=project).stages]
    first, second, third, fourth = crew("ann", "ben", "cat", "dan")
    held = offer(first)
    assert held is not None and (held.work_unit.stage_kind, held.work_unit.stage) == ("forward", 0)
    assert offer(second) is None and offer(third) is None  # their stages have no ready unit yet
    assert [stage_of(m, project) for m in (first, second, third)] == [0, 1, 2]
    taken = offer(fourth)
    assert stage_of(fourth, project) == loads.index(max(loads)) == 0
    assert taken is not None and taken.work_unit.stage == 0
    assert swarms.stage_devices(project_id=project.pk, stage=0) == sorted([first[1].pk, fourth[1].pk])
    assert swarms.stages_adjacent(device_id=first[1].pk, other_id=second[1].pk)
    assert not swarms.stages_adjacent(device_id=first[1].pk, other_id=third[1].pk)


@pytest.mark.django_db(transaction=True)
def test_each_device_keeps_its_stage_and_the_steps_still_equal_torch_sgd(
    researcher: User, digits_dataset: Any
) -> None:
    """Swarms change who computes a unit, never what is computed: the training math is the unsplit model's
    (as test_pipeline_mode's equality test, here through memberships), and the ledger sums exactly."""
    project = pipeline_project(researcher, digits_dataset)
    members = crew("ann", "ben", "cat")
    seen = work(project, members, steps=2)
    assert sorted(map(tuple, seen.values())) == [(0,), (1,), (2,)]  # one stage each, the whole time
    for _, device in members:
        assert seen[device.pk] == {swarms.device_stage(project_id=project.pk, device_id=device.pk)}
    published = version_weights(version=ModelVersion.objects.get(project=project, number=2))
    for name, value in torch_steps(project, 2).items():
        torch.testing.assert_close(published[name], value, rtol=1e-5, atol=1e-5)
    speeds = dict(StageMember.objects.filter(project=project).values_list("stage", "speed_gflops"))
    assert speeds[0] > 0 and speeds[2] > 0 and speeds[1] == 0  # measured on their results (relu: 0 FLOPs)
    ledger = CreditEntry.objects.filter(project=project).aggregate(total=Sum("flops"))["total"]
    assert ledger == expected_credit(project) > 0


# --- routing ----------------------------------------------------------------------------------------------


@pytest.mark.django_db
def test_a_ready_unit_waits_for_the_member_expected_to_finish_it_first(
    researcher: User, digits_dataset: Any
) -> None:
    project = fed(pipeline_project(researcher, digits_dataset, micro_batches=1))
    slow, fast = crew("slow", "fast")
    join(project, slow, 0, speed_gflops=10.0)
    join(project, fast, 0, speed_gflops=100.0)
    assert offer(slow) is None  # the one ready unit is held for the faster member, who has a free slot
    taken = offer(fast)
    assert taken is not None and taken.work_unit.stage == 0


@pytest.mark.django_db
def test_a_held_unit_goes_to_any_member_once_the_hold_is_over(researcher: User, digits_dataset: Any) -> None:
    """A faster member that never asks (a paused browser) holds a unit back ROUTE_HOLD_SECONDS at most."""
    project = fed(pipeline_project(researcher, digits_dataset, micro_batches=1))
    slow, fast = crew("slow", "fast")
    join(project, slow, 0, speed_gflops=10.0)
    join(project, fast, 0, speed_gflops=100.0)
    assert offer(slow) is None
    ready = WorkUnit.objects.filter(project=project)
    ready.update(created_at=timezone.now() - timedelta(seconds=swarms.ROUTE_HOLD_SECONDS + 1))
    taken = offer(slow)
    assert taken is not None and stage_of(slow, project) == 0


@pytest.mark.django_db
def test_a_member_whose_volunteer_no_longer_allows_the_project_leaves_its_stage(
    researcher: User, digits_dataset: Any
) -> None:
    """A volunteer who turns the project off in their preferences never asks for its units again: routing
    held units for their device until the rebalancer dropped it; the other member then gets them at once."""
    project = fed(pipeline_project(researcher, digits_dataset, micro_batches=1))
    slow, fast = crew("slow", "fast")
    join(project, slow, 0, speed_gflops=10.0)
    join(project, fast, 0, speed_gflops=100.0)
    assert offer(slow) is None  # held for the faster member
    volunteer = fast[0].volunteer
    preferences_save(
        volunteer=volunteer, device=None, values={"projects": "except"}, chosen_projects=[project.pk]
    )
    assert swarms.pipeline_rebalance(project_id=project.pk) == 0
    assert (stage_of(fast, project), stage_of(slow, project)) == (None, 0)
    taken = offer(slow)
    assert taken is not None and taken.work_unit.stage == 0


@pytest.mark.django_db
def test_a_member_holding_units_already_is_not_expected_to_finish_first(
    researcher: User, digits_dataset: Any
) -> None:
    """Expected finish counts what a member holds: the fast member's slots are full, so the slow one works."""
    project = fed(pipeline_project(researcher, digits_dataset, micro_batches=3))
    slow, fast = crew("slow", "fast")
    join(project, slow, 0, speed_gflops=10.0)
    join(project, fast, 0, speed_gflops=100.0)
    assert offer(fast) is not None and offer(fast) is not None  # two in flight: no free slot
    taken = offer(slow)
    assert taken is not None and taken.work_unit.stage == 0


# --- stages left empty, departures, rebalancing ---------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_a_member_takes_the_units_of_a_stage_nobody_serves_and_moves_there(
    researcher: User, digits_dataset: Any
) -> None:
    project = pipeline_project(researcher, digits_dataset, pipeline_stages=2, micro_batches=1)
    first, second, gone = crew("ann", "ben", "gone")
    join(project, first, 0)
    join(project, second, 0)
    join(project, gone, 1)
    devices_depart(left={gone[1].pk: timezone.now()})
    assert swarms.stage_devices(project_id=project.pk, stage=1) == []
    result = offer(first)
    assert result is not None and send(first[0], result).status == "valid"  # the backward unit is ready
    moved = offer(second)
    assert moved is not None and (moved.work_unit.stage_kind, moved.work_unit.stage) == ("backward", 1)
    assert stage_of(second, project) == 1 and stage_of(first, project) == 0


@pytest.mark.django_db
def test_the_rebalancer_fills_a_stage_whose_volunteers_left(researcher: User, digits_dataset: Any) -> None:
    project = pipeline_project(researcher, digits_dataset, pipeline_stages=2)
    slower, faster, gone = crew("slower", "faster", "gone")
    join(project, slower, 0, speed_gflops=5.0)
    join(project, faster, 0, speed_gflops=50.0)
    join(project, gone, 1)
    served_long(project)
    Device.objects.filter(pk=gone[1].pk).update(disconnected_at=timezone.now())  # its departure not seen yet
    assert swarms.pipelines_rebalance() == 1
    assert stage_of(gone, project) is None
    heavier = max((0, 1), key=loads(project).__getitem__)  # the faster goes where the FLOPs are
    assert (stage_of(faster, project), stage_of(slower, project)) == (heavier, 1 - heavier)
    assert swarms.pipeline_rebalance(project_id=project.pk) == 0  # balanced: nothing more to move


def loads(project: Project) -> list[int]:
    return [stage.step_flops for stage in stages.project_partition(project=project).stages]


@pytest.mark.django_db
def test_the_rebalancer_moves_a_member_to_the_bottleneck_but_not_one_that_just_moved(
    researcher: User, digits_dataset: Any
) -> None:
    """Stage 1's one slow member bounds the swarm; one of stage 0's two fast members moves there, and only
    once it has served its stage REBALANCE_MIN_STAY_SECONDS."""
    project = fed(pipeline_project(researcher, digits_dataset, pipeline_stages=2, micro_batches=4))
    load = loads(project)
    a, b, c = crew("a", "b", "c")
    join(project, a, 0, speed_gflops=load[0] / 1e6)
    join(project, b, 0, speed_gflops=load[0] / 1e6)
    join(project, c, 1, speed_gflops=load[1] / 1e8)  # 100x less capacity than stage 0's members
    assert swarms.pipeline_rebalance(project_id=project.pk) == 0  # a and b only just joined stage 0
    served_long(project)
    assert swarms.pipeline_rebalance(project_id=project.pk) == 1
    assert sorted(swarms.stage_devices(project_id=project.pk, stage=1)) == sorted([a[1].pk, c[1].pk])
    served_long(project)
    assert swarms.pipeline_rebalance(project_id=project.pk) == 0  # stage 0 has one member left: none to spare


@pytest.mark.django_db
def test_the_rebalancer_moves_nobody_for_a_steps_fill_when_the_stages_are_served_in_proportion(
    researcher: User, digits_dataset: Any
) -> None:
    """Every step starts with all M forward units of stage 0 ready and none elsewhere (GPipe's fill). With
    each stage's members' speed in proportion to its FLOPs, that queue is no reason to move anyone (it once
    moved a browser off its stage in the end-to-end test, ending its peer link)."""
    project = fed(pipeline_project(researcher, digits_dataset, pipeline_stages=2, micro_batches=4))
    load = loads(project)
    a, b, c = crew("a", "b", "c")
    join(project, a, 0, speed_gflops=load[0] / 1e6)
    join(project, b, 1, speed_gflops=load[1] / 2e6)
    join(project, c, 1, speed_gflops=load[1] / 2e6)
    served_long(project)
    ready = WorkUnit.objects.filter(project=project, status=WorkUnit.Status.OPEN)
    assert set(ready.values_list("stage", flat=True)) == {0} and ready.count() == 4
    assert swarms.pipeline_rebalance(project_id=project.pk) == 0
    assert swarms.stage_devices(project_id=project.pk, stage=0) == [a[1].pk]


@pytest.mark.django_db
def test_memberships_of_stages_that_no_longer_exist_are_dropped(
    researcher: User, digits_dataset: Any
) -> None:
    project = fed(pipeline_project(researcher, digits_dataset, pipeline_stages=2))
    (member,) = crew("ann")
    join(project, member, 2)  # the project was cut in 3 stages when it joined
    swarms.pipeline_rebalance(project_id=project.pk)
    assert stage_of(member, project) is None
    assert offer(member) is not None and stage_of(member, project) == 0  # placed again at its next unit


@pytest.mark.django_db(transaction=True)
def test_a_stages_only_member_gets_a_unit_again_after_its_instance_timed_out(
    researcher: User, digits_dataset: Any, django_assert_num_queries: Any
) -> None:
    """BOINC sends a volunteer one instance of a work unit; a stage unit (never replicated) that its stage's
    only member let time out would then wait for a member that may never come: the member gets it again."""
    project = fed(pipeline_project(researcher, digits_dataset, pipeline_stages=2, micro_batches=1))
    (member,) = crew("ann")
    join(project, member, 0)
    first = offer(member)
    assert first is not None and offer(member) is None  # one unit in the step: held
    Result.objects.filter(pk=first.pk).update(deadline=timezone.now() - timedelta(seconds=1))
    assert lifecycle.results_expire() == [project.pk]
    again = offer(member)
    assert again is not None and again.work_unit_id == first.work_unit_id  # the instance reopened
    with django_assert_num_queries(0):  # its work unit at hand, as for a new one: the consumer is async
        assert again.work_unit.stage_kind == "forward"
    assert again.status == Result.Status.IN_PROGRESS and again.deadline > timezone.now()
    assert send(member[0], again).status == "valid"


@pytest.mark.django_db(transaction=True)
def test_a_member_leaving_mid_unit_costs_only_that_unit(researcher: User, digits_dataset: Any) -> None:
    """Its membership goes and its unit is released (the sweep of a device whose connection died); another
    member of the stage computes it, the step completes and the ledger sums exactly."""
    project = pipeline_project(researcher, digits_dataset, pipeline_stages=2, micro_batches=2)
    first, leaving, staying = crew("ann", "leaving", "staying")
    join(project, first, 0)
    join(project, leaving, 1)
    join(project, staying, 1)
    for _ in range(2):
        result = offer(first)
        assert result is not None and send(first[0], result).status == "valid"
    held = offer(leaving)
    assert held is not None and held.work_unit.stage == 1
    an_hour_ago = timezone.now() - timedelta(hours=1)  # connected then, and silent since
    Device.objects.filter(pk=leaving[1].pk).update(connected_at=an_hour_ago, last_seen=an_hour_ago)
    assert devices_sweep(stale_seconds=60) == 1
    assert stage_of(leaving, project) is None
    assert Result.objects.get(pk=held.pk).status == Result.Status.RELEASED
    work(project, [first, staying], steps=1)
    assert WorkUnit.objects.get(pk=held.work_unit_id).status == WorkUnit.Status.VALIDATED
    others = Result.objects.filter(work_unit__project=project).exclude(pk=held.pk)
    assert not others.exclude(validation=Result.Validation.VALID).exists()
    ledger = CreditEntry.objects.filter(project=project).aggregate(total=Sum("flops"))["total"]
    assert ledger == expected_credit(project) > 0
