"""Volunteer-side services: profiles, devices and the credit ledger."""

from __future__ import annotations

from typing import TYPE_CHECKING

from django.contrib.auth.models import User
from django.db import transaction
from django.db.models import F
from django.utils import timezone

from workers.models import CreditEntry, Device, Volunteer

if TYPE_CHECKING:
    from projects.models import Result


def volunteer_ensure(*, user: User) -> Volunteer:
    volunteer, _ = Volunteer.objects.get_or_create(user=user)
    return volunteer


def volunteer_record_invalid(*, user_id: int) -> None:
    """Inside the caller's transaction: the volunteer's row is locked as the plain UPDATE it replaces did."""
    volunteer = Volunteer.objects.select_for_update(no_key=True).filter(user_id=user_id).first()
    if volunteer is None:
        return
    volunteer.record_invalid(now=timezone.now())
    volunteer.save(
        update_fields=["consecutive_valid", "results_invalid", "consecutive_invalid", "no_work_until"]
    )


def credit_grant(*, user: User, result: Result, flops: int) -> CreditEntry:
    """Write one ledger line and bump the volunteer's total in the same transaction."""
    volunteer = volunteer_ensure(user=user)
    entry = CreditEntry.objects.create(
        volunteer=volunteer, project_id=result.work_unit.project_id, result=result, flops=flops
    )
    Volunteer.objects.filter(pk=volunteer.pk).update(
        total_flops=F("total_flops") + flops, results_accepted=F("results_accepted") + 1
    )
    return entry


KNOWN_BACKENDS = {"webgpu", "webgl", "wasm", "cpu", "simulator"}
# Browsers a volunteer may have; beyond it, new ids share the backend's "unknown" device, so that hellos
# with made-up ids cannot grow the table without bound.
MAX_DEVICES_PER_VOLUNTEER = 32


def device_register(
    *, user: User, client_id: str | None, backend: str, gflops: float, user_agent: str
) -> Device:
    """The device a volunteer connects with, one row per browser across its connections. Its numbers are
    hints for scheduling, never for credit."""
    volunteer = volunteer_ensure(user=user)
    key = _device_key(volunteer=volunteer, client_id=client_id, backend=backend)
    now = timezone.now()
    with transaction.atomic():
        device, _ = Device.objects.select_for_update(no_key=True).get_or_create(
            volunteer=volunteer, client_id=key, defaults={"connected_at": now, "disconnected_at": now}
        )
        device.reconnect(backend=backend, gflops=gflops, user_agent=user_agent, now=now)
        device.save()
    device.volunteer = volunteer  # the consumer reads it from async code: no lazy query there
    return device


def _device_key(*, volunteer: Volunteer, client_id: str | None, backend: str) -> str:
    devices = Device.objects.filter(volunteer=volunteer)
    if client_id is not None and (
        devices.filter(client_id=client_id).exists()
        # Ids the server made up contain a colon (browsers' cannot): they do not count.
        or devices.exclude(client_id__contains=":").count() < MAX_DEVICES_PER_VOLUNTEER
    ):
        return client_id
    return f"unknown:{backend if backend in KNOWN_BACKENDS else 'other'}"


def device_disconnect(*, device_id: int) -> None:
    with transaction.atomic():
        device = Device.objects.select_for_update(no_key=True).filter(pk=device_id).first()
        if device is not None and device.disconnected_at is None:
            device.disconnect(now=timezone.now())
            device.save(update_fields=["online_ms", "disconnected_at"])
