"""accounts/services.py: researcher requests, approval (staff + the Researchers group's exact permissions),
rejection, revocation and API tokens."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import Group, User
from knox.models import AuthToken

from accounts.models import ResearcherRequest
from accounts.selectors import api_token_list, user_is_researcher
from accounts.services import (
    RESEARCHERS_GROUP,
    AccountError,
    api_token_create,
    api_token_revoke,
    researcher_request_approve,
    researcher_request_create,
    researcher_request_reject,
    researcher_revoke,
)

pytestmark = pytest.mark.django_db


@pytest.fixture
def staff(db: None) -> User:
    return User.objects.create_superuser("boss", password="boss-pass-123")


def ask(user: User) -> ResearcherRequest:
    return researcher_request_create(user=user, affiliation="  Vision lab ", purpose=" Digits, then CIFAR ")


def test_approval_makes_a_staff_researcher_with_exactly_the_projects_permissions(
    volunteer_user: User, staff: User
) -> None:
    request = ask(volunteer_user)
    assert (request.affiliation, request.purpose, request.status) == (
        "Vision lab",
        "Digits, then CIFAR",
        "pending",
    )
    assert not user_is_researcher(user=volunteer_user)

    researcher_request_approve(researcher_request=request, by=staff)

    volunteer_user.refresh_from_db()
    request.refresh_from_db()
    assert request.status == "approved" and request.decided_by == staff and request.decided_at is not None
    assert (
        volunteer_user.is_staff
        and not volunteer_user.is_superuser
        and user_is_researcher(user=volunteer_user)
    )
    assert list(volunteer_user.groups.values_list("name", flat=True)) == [RESEARCHERS_GROUP]
    assert volunteer_user.get_all_permissions() == {
        *(
            f"projects.{action}_{model}"
            for model in ("project", "dataset")
            for action in ("add", "change", "delete", "view")
        ),
        *(
            f"projects.view_{model}"
            for model in ("datasetshard", "modelversion", "workunit", "result", "metric")
        ),
    }


def test_the_group_is_restored_if_staff_widened_it(
    volunteer_user: User, other_volunteer: User, staff: User
) -> None:
    researcher_request_approve(researcher_request=ask(volunteer_user), by=staff)
    group = Group.objects.get(name=RESEARCHERS_GROUP)
    from django.contrib.auth.models import Permission

    group.permissions.add(Permission.objects.get(codename="change_user"))
    researcher_request_approve(researcher_request=ask(other_volunteer), by=staff)
    assert not group.permissions.filter(codename="change_user").exists()


def test_rejection_changes_nothing_but_the_request(volunteer_user: User, staff: User) -> None:
    request = researcher_request_reject(researcher_request=ask(volunteer_user), by=staff)
    volunteer_user.refresh_from_db()
    assert request.status == "rejected" and not volunteer_user.is_staff and not volunteer_user.groups.exists()
    assert ask(volunteer_user).status == "pending"  # may ask again


def test_one_pending_request_at_a_time_and_none_for_researchers(volunteer_user: User, staff: User) -> None:
    request = ask(volunteer_user)
    with pytest.raises(AccountError, match="waiting for a decision"):
        ask(volunteer_user)
    researcher_request_approve(researcher_request=request, by=staff)
    with pytest.raises(AccountError, match="researcher already"):
        ask(volunteer_user)


def test_a_request_is_decided_once(volunteer_user: User, staff: User) -> None:
    request = ask(volunteer_user)
    researcher_request_reject(researcher_request=request, by=staff)
    with pytest.raises(AccountError, match="rejected already"):
        researcher_request_approve(researcher_request=ResearcherRequest.objects.get(pk=request.pk), by=staff)
    volunteer_user.refresh_from_db()
    assert not volunteer_user.is_staff


def test_tokens_are_for_researchers_only_and_revoked_by_their_owner(
    volunteer_user: User, researcher: User, other_volunteer: User, staff: User
) -> None:
    with pytest.raises(AccountError, match="Only approved researchers"):
        api_token_create(user=volunteer_user)
    token, secret = api_token_create(user=researcher)
    assert secret.startswith("ct_") and token.digest != secret  # only a hash is stored
    assert list(api_token_list(user=researcher)) == [token]
    assert not api_token_revoke(user=other_volunteer, digest=token.digest)
    assert api_token_revoke(user=researcher, digest=token.digest)
    assert not AuthToken.objects.exists()


def test_revoking_a_researcher_removes_staff_group_and_tokens(volunteer_user: User, staff: User) -> None:
    researcher_request_approve(researcher_request=ask(volunteer_user), by=staff)
    volunteer_user.refresh_from_db()
    api_token_create(user=volunteer_user)
    researcher_revoke(user=volunteer_user)
    volunteer_user.refresh_from_db()
    assert not volunteer_user.is_staff and not volunteer_user.groups.exists()
    assert not AuthToken.objects.filter(user=volunteer_user).exists()
