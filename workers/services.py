"""Volunteer-side services: profiles, devices and the credit ledger."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING

from django.contrib.auth.models import User
from django.db import transaction
from django.utils import timezone

from config.bulk import bulk_write
from projects.swarms import stage_members_leave
from workers.fitting import download_forget_sent
from workers.models import (
    CreditEntry,
    Device,
    Team,
    TeamProjectCredit,
    Volunteer,
    VolunteerProjectCredit,
)
from workers.preferences import Preferences, preferences_effective

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


@dataclass(frozen=True)
class Grant:
    """One accepted result's credit, as credit_grant writes it: to be written with others (credits_grant)."""

    result: Result
    flops: int


def credits_grant(*, grants: list[Grant]) -> None:
    """credit_grant for a batch of results, in bulk, with each device's observed speed (Device.observe, as
    validation does after a grant): one ledger insert, and each kind of row (volunteers, teams, devices,
    per-project rows) read once under its lock and written back once, each grant added in order (the recent
    average is a sequence of updates). Locks in credit_lock's order (volunteers, then teams, each in id
    order), then devices and the per-project rows, which only their owners' grants write."""
    if not grants:
        return
    now = timezone.now()
    volunteers = _locked_volunteers(user_ids={g.result.volunteer_id for g in grants})
    teams = _locked_teams(team_ids={v.team_id for v in volunteers.values() if v.team_id})
    devices = _locked_devices(device_ids={g.result.device_id for g in grants if g.result.device_id})
    mine, ours = _project_rows(grants=grants, volunteers=volunteers, teams=teams, now=now)
    entries = []
    for grant in grants:
        volunteer = volunteers[grant.result.volunteer_id]
        team = teams.get(volunteer.team_id) if volunteer.team_id else None
        device = devices.get(grant.result.device_id or 0)
        entries.append(_entry(grant=grant, volunteer=volunteer, team=team))
        project_id = _project_of(grant)
        rows = [
            volunteer,
            team,
            device,
            mine[volunteer.pk, project_id],
            ours.get((team.pk if team else 0, project_id)),
        ]
        _add_everywhere(rows=rows, flops=grant.flops, now=now)
        _observe(device=device, grant=grant)
        volunteer.results_accepted += 1
        mine[volunteer.pk, project_id].results += 1
    CreditEntry.objects.bulk_create(entries)
    _write_totals(volunteers=volunteers, teams=teams, devices=devices, mine=mine, ours=ours)


def _project_of(grant: Grant) -> int:
    return grant.result.work_unit.project_id


def _entry(*, grant: Grant, volunteer: Volunteer, team: Team | None) -> CreditEntry:
    result = grant.result
    project_id = _project_of(grant)
    return CreditEntry(
        volunteer=volunteer, project_id=project_id, result=result, team=team, flops=grant.flops
    )


def _observe(*, device: Device | None, grant: Grant) -> None:
    if device is not None:
        result = grant.result
        device.observe(flops=grant.flops, compute_ms=result.compute_ms, download_ms=result.download_ms)


Credited = Volunteer | Team | Device | VolunteerProjectCredit | TeamProjectCredit


def _add_everywhere(*, rows: list[Credited | None], flops: int, now: datetime) -> None:
    for row in rows:
        if row is not None:
            row.add_credit(flops=flops, now=now)


def _locked_volunteers(*, user_ids: set[int]) -> dict[int, Volunteer]:
    """By user id; rows created for users who have none (as credit_grant's volunteer_ensure)."""
    locked = Volunteer.objects.select_for_update(no_key=True).filter(user_id__in=user_ids)
    volunteers = {volunteer.user_id: volunteer for volunteer in locked.order_by("user_id")}
    if len(volunteers) < len(user_ids):
        missing = [Volunteer(user_id=user_id) for user_id in user_ids - set(volunteers)]
        Volunteer.objects.bulk_create(missing, ignore_conflicts=True)
        return _locked_volunteers(user_ids=user_ids)
    return volunteers


def _locked_teams(*, team_ids: set[int]) -> dict[int, Team]:
    return {
        team.pk: team
        for team in Team.objects.select_for_update(no_key=True).filter(pk__in=team_ids).order_by("pk")
    }


def _locked_devices(*, device_ids: set[int]) -> dict[int, Device]:
    locked = Device.objects.select_for_update(no_key=True).filter(pk__in=device_ids).order_by("pk")
    return {device.pk: device for device in locked}


def _project_rows(
    *, grants: list[Grant], volunteers: dict[int, Volunteer], teams: dict[int, Team], now: datetime
) -> tuple[dict[tuple[int, int], VolunteerProjectCredit], dict[tuple[int, int], TeamProjectCredit]]:
    """The per-project rows the grants write, created if missing (as credit_grant's get_or_create) and
    locked; keyed by (volunteer or team id, project id). Their owners' locks (held) serialise them."""
    owners = [(volunteers[g.result.volunteer_id], _project_of(g)) for g in grants]
    pairs = {(volunteer.pk, project_id) for volunteer, project_id in owners}
    team_pairs = {(v.team_id, project_id) for v, project_id in owners if v.team_id is not None}
    VolunteerProjectCredit.objects.bulk_create(
        [VolunteerProjectCredit(volunteer_id=v, project_id=p, since=now) for v, p in pairs],
        ignore_conflicts=True,
    )
    TeamProjectCredit.objects.bulk_create(
        [TeamProjectCredit(team_id=t, project_id=p) for t, p in team_pairs], ignore_conflicts=True
    )
    mine = VolunteerProjectCredit.objects.select_for_update(no_key=True).filter(
        volunteer_id__in={v for v, _ in pairs}, project_id__in={p for _, p in pairs}
    )
    ours = TeamProjectCredit.objects.select_for_update(no_key=True).filter(
        team_id__in={t for t, _ in team_pairs}, project_id__in={p for _, p in team_pairs}
    )
    return (
        {(row.volunteer_id, row.project_id): row for row in mine.order_by("pk")},
        {(row.team_id, row.project_id): row for row in ours.order_by("pk")} if team_pairs else {},
    )


def _write_totals(
    *,
    volunteers: dict[int, Volunteer],
    teams: dict[int, Team],
    devices: dict[int, Device],
    mine: dict[tuple[int, int], VolunteerProjectCredit],
    ours: dict[tuple[int, int], TeamProjectCredit],
) -> None:
    fields = list(Volunteer.CREDIT_FIELDS)
    bulk_write(list(volunteers.values()), [*fields, "results_accepted"])
    bulk_write(list(mine.values()), [*fields, "results"])
    bulk_write(list(teams.values()), fields)
    bulk_write(list(devices.values()), [*fields, "observed_gflops", "compute_ms", "start_ms"])
    bulk_write(list(ours.values()), fields)


def credit_lock(*, user_ids: Iterable[int]) -> dict[int, Volunteer]:
    """Inside the caller's transaction, before it credits several volunteers: lock all their rows (in user
    id order), then their teams' (in id order). credit_grant locks a volunteer and then the team; without
    this, two validations crediting volunteers of one team in crossing orders could deadlock. Returns the
    volunteers' rows as locked, by user id."""
    locked = Volunteer.objects.select_for_update(no_key=True).filter(user_id__in=list(user_ids))
    volunteers = {volunteer.user_id: volunteer for volunteer in locked.order_by("user_id")}
    team_ids = {volunteer.team_id for volunteer in volunteers.values() if volunteer.team_id is not None}
    teams = Team.objects.select_for_update(no_key=True).filter(pk__in=team_ids)
    list(teams.order_by("pk").values_list("pk", flat=True))
    return volunteers


def _locked_team(*, team_id: int | None) -> Team | None:
    return None if team_id is None else Team.objects.select_for_update(no_key=True).filter(pk=team_id).first()


def _credit_add(
    row: Credited,
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


@dataclass(frozen=True)
class Hello:
    device: Device
    preferences: Preferences


def device_hello(
    *, user: User, client_id: str | None, backend: str, gflops: float, user_agent: str, connection: str
) -> Hello:
    """A hello's database work in one call: the device registered, the blobs sent to its browser forgotten
    (the page may be fresh), its preferences read. Three calls before, each a hop to a pool thread and a
    pooled connection of its own, with 32 hellos in flight in a reconnect storm."""
    device = device_register(
        user=user,
        client_id=client_id,
        backend=backend,
        gflops=gflops,
        user_agent=user_agent,
        connection=connection,
    )
    download_forget_sent(device_id=device.pk)
    return Hello(device, preferences_effective(volunteer_id=device.volunteer_id, device_id=device.pk))


def _device_key(*, volunteer: Volunteer, client_id: str | None, backend: str) -> str:
    devices = Device.objects.filter(volunteer=volunteer)
    if client_id is not None and (
        devices.filter(client_id=client_id).exists()
        # Ids the server made up contain a colon (browsers' cannot): they do not count.
        or devices.exclude(client_id__contains=":").count() < MAX_DEVICES_PER_VOLUNTEER
    ):
        return client_id
    return f"unknown:{backend if backend in KNOWN_BACKENDS else 'other'}"


def device_pause(*, device_id: int, paused: bool, connection: str) -> None:
    """The device's browser reported a lasting pause, or its end: crowd rounds are planned without it
    meanwhile (projects.lifecycle._connected), and it joins the round it was left out of when the pause ends
    (Device.resumed_at). Only from its current connection (the latest hello's): a
    hidden older tab of the same browser does not pause the one computing."""
    devices, now = Device.objects.filter(pk=device_id, connection=connection), timezone.now()
    if paused:
        devices.update(paused_at=now)
    else:
        devices.filter(paused_at__isnull=False).update(paused_at=None, resumed_at=now)


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
