"""Client-reported numbers (issue 9, items 1 and 3): timings are bounded by what the server saw, a claimed
model version is checked, and nothing a client claims changes its credit. Through the real services on
PostgreSQL, with Celery eager as in tests/integration."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from asgiref.sync import async_to_sync
from channels.db import database_sync_to_async
from django.contrib.auth.models import User

from projects import lifecycle
from projects.lifecycle import ResultOutcome
from projects.models import Project, Result, WorkUnit
from tests.integration.test_consumers import greet, send
from tests.integration.volunteer import honest_update, judged
from workers import selectors
from workers.models import CreditEntry, Device, Volunteer

pytestmark = pytest.mark.django_db(transaction=True)
HUGE = 2**63 - 1


@pytest.fixture
def device(volunteer_user: User) -> Device:
    volunteer = Volunteer.objects.create(user=volunteer_user, consecutive_valid=3)
    return Device.objects.create(volunteer=volunteer, backend="webgl", gflops=10.0)


def _assign(user: User, device: Device | None = None) -> Result:
    result = lifecycle.work_unit_assign(user=user, device=device)
    assert result is not None
    return result


def _receive(user: User, result: Result, **claims: Any) -> ResultOutcome:
    """An honest update, with whatever the client claims about it."""
    work_unit = WorkUnit.objects.select_related("project", "version", "shard__blob").get(
        pk=result.work_unit_id
    )
    sent = {"samples": work_unit.count, "loss": 1.0, "compute_ms": 5, "download_ms": 0, **claims}
    return lifecycle.result_receive(
        user=user, work_unit_id=work_unit.pk, payload=honest_update(work_unit), **sent
    )


def _out_ms(result: Result) -> int:
    stored = Result.objects.get(pk=result.pk)
    assert stored.received_at is not None
    return int((stored.received_at - stored.sent_at).total_seconds() * 1000)


@pytest.mark.parametrize("claimed", [HUGE, 2**31 - 1, 10**6])
def test_claimed_compute_time_is_bounded_by_the_time_the_work_was_out(
    mlp_project: Project, volunteer_user: User, device: Device, claimed: int
) -> None:
    result = _assign(volunteer_user, device)
    outcome = _receive(volunteer_user, result, compute_ms=claimed, download_ms=claimed)
    assert outcome.status == "valid", outcome.reason

    stored, out_ms = judged(result), _out_ms(result)
    assert 0 <= stored.compute_ms <= out_ms and 0 <= stored.download_ms <= out_ms
    device.refresh_from_db()
    assert device.compute_ms == stored.compute_ms  # the device's speed and time use the bounded figure
    assert math.isfinite(device.observed_gflops)
    share = selectors.compute_share()
    assert share is not None and share <= 1.0  # the dashboard never shows more compute than time


def test_device_speed_stays_finite_and_within_its_column(device: Device) -> None:
    device.observe(flops=10**9, compute_ms=HUGE)
    device.compute_ms = HUGE - 10
    device.observe(flops=HUGE, compute_ms=2**31 - 1)
    device.observe(flops=10**9, compute_ms=-5)
    device.save()
    device.refresh_from_db()
    assert device.compute_ms <= HUGE and math.isfinite(device.observed_gflops)


def test_an_update_claiming_another_model_version_is_invalid(
    mlp_project: Project, volunteer_user: User, device: Device
) -> None:
    result = _assign(volunteer_user, device)
    version = mlp_project.current_version().number
    outcome = _receive(volunteer_user, result, model_version=version + 999)
    assert (outcome.status, outcome.credit_flops) == ("invalid", 0)
    assert (
        outcome.reason
        == f"computed on model version {version + 999}, but the work unit is on version {version}"
    )
    stored = judged(result)
    assert (stored.status, stored.validation, stored.blob_id) == ("received", "invalid", None)
    assert Volunteer.objects.get(user=volunteer_user).consecutive_valid == 0
    assert WorkUnit.objects.get(pk=result.work_unit_id).wanted == 1  # its slice is sent again
    assert not CreditEntry.objects.exists()


@pytest.mark.parametrize(
    ("claims", "credited"),
    [
        ({}, True),
        ({"compute_ms": 1}, True),
        ({"compute_ms": HUGE, "download_ms": HUGE}, True),
        ({"model_version": 0}, True),
        ({"samples": 5000}, False),
        ({"samples": 49}, False),
        ({"model_version": 999}, False),
        ({"model_version": -1}, False),
    ],
)
def test_credit_is_the_servers_flops_whatever_the_client_claims(
    mlp_project: Project, volunteer_user: User, device: Device, claims: dict[str, int], credited: bool
) -> None:
    result = _assign(volunteer_user, device)
    outcome = _receive(volunteer_user, result, **claims)
    expected = mlp_project.flops_per_sample * result.work_unit.count if credited else 0
    assert outcome.credit_flops == expected == Volunteer.objects.get(user=volunteer_user).total_flops
    assert sum(CreditEntry.objects.values_list("flops", flat=True)) == expected


def test_the_socket_passes_the_claimed_model_version_on(mlp_project: Project, volunteer_user: User) -> None:
    async def scenario() -> dict[str, Any]:
        communicator = await greet(volunteer_user)
        unit = (await send(communicator, {"type": "ready"}))["work_unit"]
        work_unit = await database_sync_to_async(
            WorkUnit.objects.select_related("project", "version", "shard__blob").get
        )(pk=unit["id"])
        payload = await database_sync_to_async(honest_update)(work_unit)
        meta = {
            "type": "result",
            "work_unit": unit["id"],
            "model_version": unit["model_version"] + 999,
            "samples": 50,
            "loss": 2.3,
            "timings": {"download_ms": 1, "compute_ms": 2},
        }
        await communicator.send_to(text_data=json.dumps(meta))
        await communicator.send_to(bytes_data=payload)
        ack: dict[str, Any] = json.loads(await communicator.receive_from(timeout=10))
        await communicator.disconnect()
        return ack

    ack = async_to_sync(scenario)()
    assert (ack["type"], ack["status"], ack["credit_flops"]) == ("ack", "invalid", 0)
    assert "model version 999" in ack["reason"]
