"""Volunteer-side services: profiles, devices and the credit ledger."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import TYPE_CHECKING

from django.contrib.auth.models import User
from django.db import transaction
from django.utils import timezone

from projects.swarms import stage_members_leave
from workers.models import CreditEntry, Device, Team, TeamProjectCredit, Volunteer, VolunteerProjectCredit

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
    """Write one ledger line and add it, in the same transaction, to every total it counts in: the
    volunteer's, their team's (credit earned while a member, as BOINC), the device's and the per-project
    rows, each with its recent average (workers/credit.py). Each row is read under its lock and written
    back, so concurrent grants lose no update; locks go volunteer first, then team (see credit_lock)."""
    volunteer_ensure(user=user)
    now = timezone.now()
    project_id = result.work_unit.project_id
    with transaction.atomic():
        volunteer = Volunteer.objects.select_for_update(no_key=True).get(user=user)
        team = _locked_team(team_id=volunteer.team_id)
        entry = CreditEntry.objects.create(
            volunteer=volunteer, project_id=project_id, result=result, team=team, flops=flops
        )
        volunteer.results_accepted += 1
        _credit_add(volunteer, flops=flops, now=now, also=("results_accepted",))
        if team is not None:
            _credit_add(team, flops=flops, now=now)
        _credit_add_device(device_id=result.device_id, flops=flops, now=now)
        _credit_add_projects(volunteer=volunteer, team=team, project_id=project_id, flops=flops, now=now)
    return entry


def credit_lock(*, user_ids: Iterable[int]) -> None:
    """Inside the caller's transaction, before it credits several volunteers: lock all their rows (in user
    id order), then their teams' (in id order). credit_grant locks a volunteer and then the team; without
    this, two validations crediting volunteers of one team in crossing orders could deadlock."""
    volunteers = Volunteer.objects.select_for_update(no_key=True).filter(user_id__in=list(user_ids))
    team_ids = {team_id for team_id in volunteers.order_by("user_id").values_list("team_id", flat=True)}
    teams = Team.objects.select_for_update(no_key=True).filter(pk__in=team_ids - {None})
    list(teams.order_by("pk").values_list("pk", flat=True))


def _locked_team(*, team_id: int | None) -> Team | None:
    return None if team_id is None else Team.objects.select_for_update(no_key=True).filter(pk=team_id).first()


def _credit_add(
    row: Volunteer | Team | Device | VolunteerProjectCredit | TeamProjectCredit,
    *,
    flops: int,
    now: datetime,
    also: tuple[str, ...] = (),
) -> None:
    row.add_credit(flops=flops, now=now)
    row.save(update_fields=[*row.CREDIT_FIELDS, *also])


def _credit_add_device(*, device_id: int | None, flops: int, now: datetime) -> None:
    # The device's own lock: only its volunteer's grants (serialised by the volunteer's lock) write it.
    device = Device.objects.select_for_update(no_key=True).filter(pk=device_id).first() if device_id else None
    if device is not None:
        _credit_add(device, flops=flops, now=now)


def _credit_add_projects(
    *, volunteer: Volunteer, team: Team | None, project_id: int, flops: int, now: datetime
) -> None:
    """The per-project rows (BOINC's credit_user, credit_team); created at the first credit in a project."""
    mine, _ = VolunteerProjectCredit.objects.select_for_update(no_key=True).get_or_create(
        volunteer=volunteer, project_id=project_id, defaults={"since": now}
    )
    mine.results += 1
    _credit_add(mine, flops=flops, now=now, also=("results",))
    if team is not None:
        ours, _ = TeamProjectCredit.objects.select_for_update(no_key=True).get_or_create(
            team=team, project_id=project_id
        )
        _credit_add(ours, flops=flops, now=now)


KNOWN_BACKENDS = {"webgpu", "webgl", "wasm", "cpu", "simulator"}
# Browsers a volunteer may have; beyond it, new ids share the backend's "unknown" device, so that hellos
# with made-up ids cannot grow the table without bound.
MAX_DEVICES_PER_VOLUNTEER = 32


def device_register(
    *, user: User, client_id: str | None, backend: str, gflops: float, user_agent: str, connection: str = ""
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
        device.reconnect(
            backend=backend, gflops=gflops, user_agent=user_agent, now=now, connection=connection
        )
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


def device_disconnect(*, device_id: int, connection: str | None = None) -> None:
    """The device's connection ended: disconnected, and it serves no pipeline stage any more. Given the
    connection that ended, only if that one is still the device's current one (not a newer tab's)."""
    with transaction.atomic():
        device = Device.objects.select_for_update(no_key=True).filter(pk=device_id).first()
        if device is None or connection not in (None, device.connection):
            return
        if device.disconnected_at is None:
            device.disconnect(now=timezone.now())
            device.save(update_fields=["online_ms", "disconnected_at"])
            stage_members_leave(device_ids=[device_id])
