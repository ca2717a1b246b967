"""Volunteer-side services: profiles, devices and the credit ledger."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django.contrib.auth.models import User
from django.db.models import F
from django.utils import timezone

from workers.models import CreditEntry, Device, Volunteer

if TYPE_CHECKING:
    from projects.models import Result


def volunteer_ensure(*, user: User) -> Volunteer:
    volunteer, _ = Volunteer.objects.get_or_create(user=user)
    return volunteer


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


def device_register(*, user: User, device: dict[str, Any]) -> Device:
    """Record the device a volunteer connects with; the numbers are hints for scheduling, never for credit."""
    volunteer = volunteer_ensure(user=user)
    return Device.objects.create(
        volunteer=volunteer,
        backend=str(device.get("backend", "unknown"))[:20],
        gflops=_finite_float(device.get("gflops")),
        user_agent=str(device.get("user_agent", ""))[:300],
    )


def _finite_float(value: Any) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return 0.0
    return number if 0.0 <= number < 1e9 else 0.0


def device_disconnect(*, device_id: int) -> None:
    Device.objects.filter(pk=device_id, disconnected_at=None).update(disconnected_at=timezone.now())
