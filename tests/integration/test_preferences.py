"""Computing preferences honoured by the server (projects.lifecycle.work_unit_offer) and carried by the
volunteer socket (welcome, live `preferences`, `release`, idle reasons): PostgreSQL, Redis channel layer."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from asgiref.sync import async_to_sync
from channels.db import database_sync_to_async
from django.contrib.auth.models import User

from engine import spec
from projects import lifecycle
from projects.models import Project, Result, WorkUnit
from projects.services import project_create, project_start
from tests.integration.test_consumers import HELLO, greet, send
from workers import fitting
from workers.models import Device, DeviceDownload
from workers.preferences import MB, preferences_save
from workers.services import device_register, volunteer_ensure

pytestmark = pytest.mark.django_db(transaction=True)


def save(user: User, *, device: Device | None = None, chosen: list[int] | None = None, **values: Any) -> None:
    defaults: dict[str, Any] = {
        "duty_cycle": 100,
        "pause_when_hidden": True,
        "pause_on_battery": True,
        "battery_min_percent": 0,
        "pause_while_active": False,
        "projects": "any",
        "max_work_unit_mb": None,
        "max_download_mb_per_day": None,
    }
    preferences_save(
        volunteer=volunteer_ensure(user=user),
        device=device,
        values=defaults | values,
        chosen_projects=chosen or [],
    )


def device_of(user: User, client_id: str = "laptop-0001") -> Device:
    return device_register(user=user, client_id=client_id, backend="webgl", gflops=1000.0, user_agent="")


@pytest.fixture
def two_projects(mlp_project: Project, researcher: User) -> tuple[Project, Project]:
    other = project_create(
        owner=researcher,
        name="MLP B",
        dataset=mlp_project.dataset,
        preset="mlp",
        settings={"batch_size": 50, "round_samples": 100},
    )
    return mlp_project, project_start(project=other)


def offers(user: User, n: int, device: Device | None = None) -> list[lifecycle.Offer]:
    return [lifecycle.work_unit_offer(user=user, device=device) for _ in range(n)]


def test_the_server_sends_only_the_projects_a_volunteer_allows(
    two_projects: tuple[Project, Project], volunteer_user: User, other_volunteer: User
) -> None:
    first, second = two_projects
    save(volunteer_user, projects="only", chosen=[second.pk])
    got = offers(volunteer_user, 3)
    assert [(o.result.work_unit.project_id, o.why) for o in got[:2] if o.result] == [
        (second.pk, "choice")
    ] * 2
    assert (got[2].result, got[2].why) == (None, "no_work")  # the first project's work is not for them
    save(other_volunteer, projects="except", chosen=[second.pk])
    got = offers(other_volunteer, 3)
    assert [o.result.work_unit.project_id for o in got[:2] if o.result] == [first.pk] * 2
    assert got[0].why == "only" and got[2].why == "no_work"  # the only allowed project with work


def test_the_project_is_chosen_by_share_when_several_have_work(
    two_projects: tuple[Project, Project], volunteer_user: User
) -> None:
    first, second = two_projects
    got = offers(volunteer_user, 4)
    assert {o.result.work_unit.project_id for o in got if o.result} == {first.pk, second.pk}
    assert [o.why for o in got] == ["share", "share", "share", "only"]  # the last one left: the only one


def test_the_daily_download_is_honoured_per_device(mlp_project: Project, volunteer_user: User) -> None:
    laptop, phone = device_of(volunteer_user), device_of(volunteer_user, "phone-00001")
    first = lifecycle.work_unit_offer(user=volunteer_user, device=laptop).result
    assert first is not None
    total = sum(fitting.work_unit_blobs(first.work_unit).values())
    allowance = math.ceil(total / MB)
    assert allowance * MB < 2 * total  # room for one download of these blobs, not two
    save(volunteer_user, max_download_mb_per_day=allowance)
    fitting.download_forget_sent(device_id=laptop.pk)  # as a new connection does: the blobs count again
    refused = lifecycle.work_unit_offer(user=volunteer_user, device=laptop)
    assert (refused.result, refused.why) == (None, "download_limit")
    assert DeviceDownload.objects.get(device=laptop).bytes == total  # counted once, never over the allowance
    other = lifecycle.work_unit_offer(user=volunteer_user, device=phone)  # the phone has its own day
    assert other.result is not None and DeviceDownload.objects.get(device=phone).bytes == total


def test_memory_and_the_largest_work_unit_size_the_work_units(
    mlp_project: Project, volunteer_user: User
) -> None:
    laptop = device_of(volunteer_user)
    unit = (
        WorkUnit.objects.select_related("project__graph", "shard__blob").filter(project=mlp_project).first()
    )
    assert unit is not None
    params, activations = fitting.model_memory(unit.project.graph)
    fixed = fitting.MODEL_COPIES * params + unit.shard.blob.size
    memory_mb = (fixed + 7 * activations) / fitting.MEMORY_SHARE / MB
    offer = lifecycle.work_unit_offer(user=volunteer_user, device=laptop, memory_mb=memory_mb)
    assert offer.result is not None and offer.result.work_unit.count == 7
    assert WorkUnit.objects.filter(
        project=mlp_project, count=unit.count - 7, total_results=0
    ).exists()  # the rest
    save(volunteer_user, max_work_unit_mb=1)  # less than the shard alone
    refused = lifecycle.work_unit_offer(user=volunteer_user, device=laptop)
    assert (refused.result, refused.why) == (None, "too_large")


# --- over the socket ------------------------------------------------------------------------------------


def test_welcome_carries_the_devices_preferences_and_saving_reaches_it_live(
    mlp_project: Project, volunteer_user: User
) -> None:
    save(volunteer_user, duty_cycle=40, pause_while_active=True)

    async def scenario() -> None:
        communicator = await greet_with_preferences(
            volunteer_user, expect={"duty_cycle": 40, "source": "volunteer"}
        )
        device = await database_sync_to_async(Device.objects.get)(client_id="laptop-0001")
        await database_sync_to_async(save)(
            volunteer_user, device=device, duty_cycle=75, max_download_mb_per_day=9
        )
        pushed = json.loads(await communicator.receive_from(timeout=10))
        assert pushed["type"] == "preferences"
        got = pushed["preferences"]
        assert (got["duty_cycle"], got["source"], got["pause_while_active"]) == (75, "device", False)
        assert got["limits"] == {"projects": "any", "max_work_unit_mb": None, "max_download_mb_per_day": 9}
        await communicator.disconnect()

    async_to_sync(scenario)()


async def greet_with_preferences(user: User, *, expect: dict[str, Any]) -> Any:
    from tests.integration.test_consumers import connect

    communicator = await connect(user)
    connected, _ = await communicator.connect()
    assert connected
    hello = {**HELLO, "device": {**HELLO["device"], "id": "laptop-0001", "memory_mb": 8192}}
    welcome = await send(communicator, hello)
    assert welcome["type"] == "welcome"
    assert {key: welcome["preferences"][key] for key in expect} == expect
    return communicator


def test_a_waiting_browser_gets_work_once_its_preferences_allow_it(
    two_projects: tuple[Project, Project], volunteer_user: User
) -> None:
    first, second = two_projects
    WorkUnit.objects.filter(project=second).update(status=WorkUnit.Status.CANCELLED)
    save(volunteer_user, projects="only", chosen=[second.pk])

    async def scenario() -> None:
        communicator = await greet(volunteer_user)
        assert await send(communicator, {"type": "ready"}) == {"type": "idle", "reason": "no_work"}
        await database_sync_to_async(save)(volunteer_user, projects="any")
        assert json.loads(await communicator.receive_from(timeout=10))["type"] == "preferences"
        assign = json.loads(await communicator.receive_from(timeout=10))
        assert assign["type"] == "assign" and assign["work_unit"]["project"] == {
            "id": first.pk,
            "name": first.name,
            "why": "only",
        }
        await communicator.disconnect()

    async_to_sync(scenario)()


def test_a_lasting_pause_is_recorded_until_it_ends_or_the_page_says_hello_again(volunteer_user: User) -> None:
    """`pause` marks the device paused (crowd rounds are planned without it) and unpaused; a new page's hello
    starts it unpaused. A malformed one is refused and changes nothing (each refusal is also the point at
    which the frames before it were handled)."""
    paused_at = database_sync_to_async(lambda: Device.objects.get(volunteer__user=volunteer_user).paused_at)
    resumed_at = database_sync_to_async(lambda: Device.objects.get(volunteer__user=volunteer_user).resumed_at)

    async def told(communicator: Any, paused: bool) -> None:
        await communicator.send_to(text_data=json.dumps({"type": "pause", "paused": paused}))
        for bad in ({"type": "pause"}, {"type": "pause", "paused": "yes"}, {"type": "pause", "paused": None}):
            reply = await send(communicator, bad)
            assert reply["type"] == "error" and reply["code"] == "bad_message", bad

    async def scenario() -> None:
        communicator = await greet(volunteer_user)
        assert await paused_at() is None
        await told(communicator, True)
        assert await paused_at() is not None
        await told(communicator, False)
        assert await paused_at() is None
        resumed = await resumed_at()  # it joins the round it was left out of (lifecycle._joiners_feed)
        assert resumed is not None
        await told(communicator, False)  # not paused: nothing ended
        assert await resumed_at() == resumed
        await told(communicator, True)
        await communicator.disconnect()
        assert await paused_at() is not None  # disconnected and paused: neither is planned for
        communicator, newer = await greet(volunteer_user), await greet(volunteer_user)  # one device, 2 tabs
        assert await paused_at() is None
        await told(communicator, True)  # the older tab's: the newer one computes
        assert await paused_at() is None
        await told(newer, True)
        assert await paused_at() is not None
        await communicator.disconnect()
        await newer.disconnect()

    async_to_sync(scenario)()


def test_released_work_goes_back_at_once_and_only_what_the_connection_holds(
    mlp_project: Project, volunteer_user: User, other_volunteer: User
) -> None:
    async def scenario() -> None:
        mine, theirs = await greet(volunteer_user), await greet(other_volunteer)
        held = (await send(mine, {"type": "ready"}))["work_unit"]["id"]
        other = (await send(theirs, {"type": "ready"}))["work_unit"]["id"]
        await mine.send_to(text_data=json.dumps({"type": "release", "work_units": [held, other]}))
        # Never to the same volunteer twice, and the round's other unit is `theirs`: nothing left for `mine`.
        assert await send(mine, {"type": "ready"}) == {"type": "idle", "reason": "no_work"}
        statuses = await database_sync_to_async(
            lambda: dict(
                Result.objects.filter(work_unit_id__in=[held, other]).values_list("work_unit", "status")
            )
        )()
        assert statuses == {held: "released", other: "in_progress"}  # `other` is not mine to release
        assert (await send(theirs, {"type": "ready"}))["work_unit"]["id"] == held  # at once, to someone else
        for bad in ([], [1, 2, 3], ["1"], [True], [-1], None):
            reply = await send(mine, {"type": "release", "work_units": bad})
            while reply["type"] == "idle":  # `mine` waits for work: each announcement gets it an idle
                reply = json.loads(await mine.receive_from(timeout=10))
            assert reply["type"] == "error" and reply["code"] == "bad_message", bad
        await mine.disconnect()
        await theirs.disconnect()

    async_to_sync(scenario)()


def test_idle_says_when_the_days_download_is_spent(mlp_project: Project, volunteer_user: User) -> None:
    save(volunteer_user, max_download_mb_per_day=1)  # less than the digits' shard

    async def scenario() -> None:
        communicator = await greet(volunteer_user)
        assert await send(communicator, {"type": "ready"}) == {"type": "idle", "reason": "download_limit"}
        await communicator.disconnect()

    async_to_sync(scenario)()


def test_the_memory_a_browser_reports_bounds_its_work_units(
    mlp_project: Project, volunteer_user: User
) -> None:
    async def scenario() -> None:
        from tests.integration.test_consumers import connect

        communicator = await connect(volunteer_user)
        await communicator.connect()
        small = {**HELLO, "device": {**HELLO["device"], "id": "old-phone-01", "memory_mb": 1}}
        assert (await send(communicator, small))["type"] == "welcome"
        assert await send(communicator, {"type": "ready"}) == {"type": "idle", "reason": "too_large"}
        roomy = {**HELLO, "device": {**HELLO["device"], "id": "old-phone-01", "memory_mb": 8192}}
        assert (await send(communicator, roomy))["type"] == "welcome"  # a hello again: the new numbers count
        assert (await send(communicator, {"type": "ready"}))["type"] == "assign"
        await communicator.disconnect()

    async_to_sync(scenario)()


def test_the_reasons_the_server_gives_are_the_spec_files(
    two_projects: tuple[Project, Project], volunteer_user: User
) -> None:
    """The browser shows a text for each of spec.json's assign_why and idle_reasons, and only for those."""
    first, second = two_projects
    laptop = device_of(volunteer_user)
    save(volunteer_user, projects="only", chosen=[second.pk])
    whys = {o.why for o in offers(volunteer_user, 3, laptop)}
    save(volunteer_user, projects="any")
    whys |= {o.why for o in offers(volunteer_user, 3, laptop)}
    assert whys <= set(spec.PROTOCOL["assign_why"]) | set(spec.PROTOCOL["idle_reasons"])
    assert {"choice", "only", "no_work"} <= whys
