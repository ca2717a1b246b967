"""Researcher accounts: requests, approval (admin for their own projects and datasets) and API tokens."""

from __future__ import annotations

from django.contrib.auth.models import Group, Permission, User
from django.db import transaction
from django.utils import timezone
from knox.models import AuthToken

from accounts.models import ResearcherRequest
from accounts.selectors import user_is_researcher

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
        raise AccountError("You are a researcher already.")
    if user.researcher_requests.filter(status=ResearcherRequest.Status.PENDING).exists():
        raise AccountError("Your request is waiting for a decision already.")
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
        raise AccountError("Only approved researchers may create API tokens: request a researcher account.")
    return AuthToken.objects.create(user=user)


def api_token_revoke(*, user: User, digest: str) -> bool:
    """Revoke one of the user's own tokens; False if they have no such token."""
    deleted, _ = AuthToken.objects.filter(user=user, digest=digest).delete()
    return deleted > 0
