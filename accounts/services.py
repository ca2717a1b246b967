"""Accounts: researchers' requests, approval (admin for their own projects and datasets) and API tokens; a
volunteer's profile, devices (rename, forget) and the deletion of their account."""

from __future__ import annotations

import secrets

from django.contrib.auth.models import Group, Permission, User
from django.db import transaction
from django.db.models import Exists, OuterRef
from django.utils import timezone
from django.utils.translation import gettext as _
from knox.models import AuthToken

from accounts.models import ResearcherRequest
from accounts.selectors import user_is_researcher
from projects.lifecycle import results_release
from projects.models import Result
from workers.models import ComputingPreferences, Device, Volunteer
from workers.services import volunteer_ensure
from workers.teams import team_leave

RESEARCHERS_GROUP = "Researchers"
# Exactly what the admin needs for a researcher's own rows (projects/admin.py's OwnedAdmin narrows every
# list to them): create and change projects and datasets, look at what training wrote.
RESEARCHER_PERMISSIONS = {
    "projects": {
        "project": ("add", "change", "delete", "view"),
        "dataset": ("add", "change", "delete", "view"),
        "datasetshard": ("view",),
        "modelversion": ("view",),
        "workunit": ("view",),
        "result": ("view",),
        "metric": ("view",),
    },
}


class AccountError(ValueError):
    """A request that cannot be made or decided as asked; the message is shown to the user."""


def researcher_group_ensure() -> Group:
    """The Researchers group, with exactly RESEARCHER_PERMISSIONS (restored if staff changed them)."""
    group, _ = Group.objects.get_or_create(name=RESEARCHERS_GROUP)
    codenames = [
        (app, f"{action}_{model}")
        for app, models in RESEARCHER_PERMISSIONS.items()
        for model, actions in models.items()
        for action in actions
    ]
    permissions = [
        Permission.objects.get(content_type__app_label=app, codename=codename) for app, codename in codenames
    ]
    group.permissions.set(permissions)
    return group


def researcher_request_create(*, user: User, affiliation: str, purpose: str) -> ResearcherRequest:
    if user_is_researcher(user=user):
        raise AccountError(_("You are a researcher already."))
    if user.researcher_requests.filter(status=ResearcherRequest.Status.PENDING).exists():
        raise AccountError(_("Your request is waiting for a decision already."))
    return ResearcherRequest.objects.create(
        user=user, affiliation=affiliation.strip(), purpose=purpose.strip()
    )


@transaction.atomic
def researcher_request_approve(*, researcher_request: ResearcherRequest, by: User) -> ResearcherRequest:
    """The user becomes staff (the admin, limited to their own rows) in the Researchers group."""
    _decide(researcher_request=researcher_request, by=by, status=ResearcherRequest.Status.APPROVED)
    user = researcher_request.user
    user.is_staff = True
    user.save(update_fields=["is_staff"])
    user.groups.add(researcher_group_ensure())
    return researcher_request


@transaction.atomic
def researcher_request_reject(*, researcher_request: ResearcherRequest, by: User) -> ResearcherRequest:
    _decide(researcher_request=researcher_request, by=by, status=ResearcherRequest.Status.REJECTED)
    return researcher_request


def _decide(*, researcher_request: ResearcherRequest, by: User, status: str) -> None:
    locked = ResearcherRequest.objects.select_for_update().get(pk=researcher_request.pk)
    if locked.status != ResearcherRequest.Status.PENDING:
        raise AccountError(f"This request was {locked.status} already.")
    researcher_request.status = status
    researcher_request.decided_at = timezone.now()
    researcher_request.decided_by = by
    researcher_request.save(update_fields=["status", "decided_at", "decided_by"])


def researcher_revoke(*, user: User) -> None:
    """Back to a volunteer: no admin, no group, every API token revoked."""
    with transaction.atomic():
        user.is_staff = False
        user.save(update_fields=["is_staff"])
        user.groups.remove(*Group.objects.filter(name=RESEARCHERS_GROUP))
        AuthToken.objects.filter(user=user).delete()


def api_token_create(*, user: User) -> tuple[AuthToken, str]:
    """A new token for an approved researcher: (its row, the token itself, shown once and never stored)."""
    if not user_is_researcher(user=user):
        raise AccountError(
            _("Only approved researchers may create API tokens: request a researcher account.")
        )
    return AuthToken.objects.create(user=user)


def api_token_revoke(*, user: User, digest: str) -> bool:
    """Revoke one of the user's own tokens; False if they have no such token."""
    deleted, _ = AuthToken.objects.filter(user=user, digest=digest).delete()
    return deleted > 0


# --- a volunteer's own account ------------------------------------------------------------------------


def volunteer_profile_update(*, user: User, display_name: str, country: str, url: str) -> Volunteer:
    """Only the profile's columns are written: a grant committing meanwhile keeps its totals."""
    volunteer = volunteer_ensure(user=user)
    volunteer.display_name, volunteer.country, volunteer.url = display_name, country, url
    volunteer.save(update_fields=["display_name", "country", "url"])
    return volunteer


def device_rename(*, user: User, device_id: int, name: str) -> Device:
    """Rename one of the user's own devices (Device.DoesNotExist for anyone else's, or a forgotten one)."""
    with transaction.atomic():
        device = _own_device(user=user, device_id=device_id)
        device.name = name
        device.save(update_fields=["name"])
    return device


def device_forget(*, user: User, device_id: int) -> bool:
    """Forget one of the user's own devices; True if its row was deleted, False if it was kept, hidden.

    A device that never computed anything (no result, no credit, not connected) goes. One that did stays,
    hidden and detached from its browser (Device.forget): its credit is part of the host totals that the
    statistics export and the ledger must agree on, and its results keep pointing at it. The lock on the
    device alone: credit_grant locks a volunteer, then the device, so this takes nothing before it."""
    with transaction.atomic():
        device = _own_device(user=user, device_id=device_id)
        if _unused(device):
            device.delete()
            return True
        device.forget(now=timezone.now())
        device.save(update_fields=["client_id", "name", "user_agent", "forgotten_at"])
    return False


def _own_device(*, user: User, device_id: int) -> Device:
    devices = Device.objects.select_for_update(of=("self",))
    return devices.get(pk=device_id, volunteer__user=user, forgotten_at__isnull=True)


def _unused(device: Device) -> bool:
    return (
        device.total_flops == 0
        and device.disconnected_at is not None
        and not Result.objects.filter(device=device).exists()
    )


def account_delete(*, user: User) -> User | None:
    """Delete the user; their credit stays, anonymised, so that every total (the ledger's, each project's,
    each team's, each device's) is what it was. Returns the stand-in that now holds it (None for a user
    who never had a result: nothing to keep).

    The user row goes, with their e-mail addresses, password, tokens and requests. Their volunteer row,
    results and devices move to a stand-in user of their own: inactive, no password, no e-mail, a random
    `deleted-...` name that nothing links to the old one. (projects.Result and workers.Volunteer need a
    user; one stand-in per deleted account keeps "one result per volunteer and work unit" true.) The
    profile, device names and browsers' descriptions and the computing preferences are erased, and the
    volunteer leaves their team (a founder hands it on, as on leaving; the team keeps the credit earned).

    Refused (AccountError) while the user owns projects or datasets: deleting those would delete other
    volunteers' credit with them. Work in progress is released first, so no round waits for it; then the
    results are locked before the volunteer row, the order validation locks them in."""
    if user.projects.exists() or user.datasets.exists():
        raise AccountError(
            _("You own projects or datasets: delete them or ask staff to hand them over first.")
        )
    held = Result.objects.filter(volunteer=user, status=Result.Status.IN_PROGRESS)
    results_release(user=user, work_unit_ids=list(held.values_list("work_unit_id", flat=True)))
    with transaction.atomic():
        # Locked first: a result being assigned meanwhile (it needs the user row) waits, then fails, rather
        # than slipping in between the move below and the delete.
        list(User.objects.select_for_update().filter(pk=user.pk).values_list("pk", flat=True))
        stand_in = _stand_in() if user.results.exists() else None
        if stand_in is not None:
            Result.objects.filter(volunteer=user).update(volunteer=stand_in)
        volunteer = Volunteer.objects.filter(user=user).first()
        if volunteer is not None and volunteer.team_id is not None:
            team_leave(user=user, team_id=volunteer.team_id)
        if volunteer is not None and stand_in is not None:
            _volunteer_anonymise(volunteer=volunteer, stand_in=stand_in)
        user.delete()  # with it, a volunteer row that has no result (so no credit) to keep
    return stand_in


def _stand_in() -> User:
    stand_in = User(username=f"deleted-{secrets.token_hex(6)}", is_active=False)
    stand_in.set_unusable_password()
    stand_in.save()
    return stand_in


def _volunteer_anonymise(*, volunteer: Volunteer, stand_in: User) -> None:
    volunteer = Volunteer.objects.select_for_update().get(pk=volunteer.pk)
    volunteer.user = stand_in
    volunteer.display_name, volunteer.country, volunteer.url = "", "", ""
    volunteer.save(update_fields=["user", "display_name", "country", "url"])
    ComputingPreferences.objects.filter(volunteer=volunteer).delete()
    devices = Device.objects.filter(volunteer=volunteer)
    unused = devices.filter(total_flops=0, disconnected_at__isnull=False)
    unused.exclude(Exists(Result.objects.filter(device=OuterRef("pk")))).delete()
    for device in devices.select_for_update():
        device.forget(now=timezone.now())
        device.save(update_fields=["client_id", "name", "user_agent", "forgotten_at"])
