"""Staff approve and reject researcher requests with admin actions; an approved researcher's admin shows
only their own rows, and not the requests."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import User
from django.test import Client

from accounts.models import ResearcherRequest
from accounts.services import researcher_request_create
from projects.models import Project

pytestmark = pytest.mark.django_db
CHANGELIST = "/admin/accounts/researcherrequest/"


@pytest.fixture
def staff_client(client: Client) -> Client:
    client.force_login(User.objects.create_superuser("boss", password="boss-pass-123"))
    return client


def act(client: Client, action: str, *requests: ResearcherRequest) -> str:
    form = {"action": action, "_selected_action": [str(r.pk) for r in requests]}
    return client.post(CHANGELIST, form, follow=True).content.decode()


def test_approve_and_reject_actions(
    staff_client: Client, volunteer_user: User, other_volunteer: User
) -> None:
    first = researcher_request_create(user=volunteer_user, affiliation="Lab A", purpose="Digits")
    second = researcher_request_create(user=other_volunteer, affiliation="Lab B", purpose="Text")
    assert "Lab A" in staff_client.get(CHANGELIST).content.decode()

    assert "1 request(s) approved" in act(staff_client, "approve", first)
    assert "1 request(s) rejected" in act(staff_client, "reject", second)
    page = act(staff_client, "approve", second)
    assert "was rejected already" in page and "0 request(s) approved" in page

    volunteer_user.refresh_from_db()
    other_volunteer.refresh_from_db()
    assert volunteer_user.is_staff and not other_volunteer.is_staff


def test_an_approved_researchers_admin_shows_only_their_own(
    client: Client, volunteer_user: User, mlp_project: Project
) -> None:
    from accounts.services import researcher_request_approve

    boss = User.objects.create_superuser("boss", password="boss-pass-123")
    request = researcher_request_create(user=volunteer_user, affiliation="Lab", purpose="Digits")
    researcher_request_approve(researcher_request=request, by=boss)
    client.force_login(volunteer_user)

    index = client.get("/admin/").content.decode()
    assert "/admin/projects/project/" in index and "/admin/accounts/" not in index
    assert "/admin/auth/user/" not in index
    assert "MLP" not in client.get("/admin/projects/project/").content.decode()  # someone else's
    assert client.get(f"/admin/projects/project/{mlp_project.pk}/change/").status_code in (302, 403, 404)
    assert client.get(CHANGELIST).status_code == 403
    assert client.get("/admin/projects/project/add/").status_code == 200
