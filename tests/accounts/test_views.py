"""The "your account" page: asking for a researcher account, and a researcher's API tokens (shown once,
revoked by their owner only)."""

from __future__ import annotations

import re

import pytest
from django.contrib.auth.models import User
from django.test import Client
from knox.models import AuthToken

from accounts.models import ResearcherRequest
from accounts.services import api_token_create

pytestmark = pytest.mark.django_db


def test_the_page_needs_a_login(client: Client) -> None:
    response = client.get("/account/")
    assert response.status_code == 302 and response["Location"].startswith("/accounts/login/?next=/account/")


def test_a_volunteer_asks_for_a_researcher_account(client: Client, volunteer_user: User) -> None:
    client.force_login(volunteer_user)
    page = client.get("/account/").content.decode()
    assert "Request a researcher account" in page and 'id="api-tokens"' not in page

    response = client.post("/account/researcher/", {"affiliation": "Vision lab", "purpose": "Digits"})
    assert response.status_code == 302
    request = ResearcherRequest.objects.get(user=volunteer_user)
    assert (request.affiliation, request.status) == ("Vision lab", "pending")
    assert "is waiting for staff to decide" in client.get("/account/").content.decode()
    again = client.post("/account/researcher/", {"affiliation": "Vision lab", "purpose": "Digits"})
    assert again.status_code == 409 and ResearcherRequest.objects.count() == 1


def test_an_empty_request_is_refused_with_the_fields_errors(client: Client, volunteer_user: User) -> None:
    client.force_login(volunteer_user)
    response = client.post("/account/researcher/", {"affiliation": "", "purpose": "x" * 2001})
    assert response.status_code == 400 and "This field is required" in response.content.decode()
    assert not ResearcherRequest.objects.exists()


def test_volunteers_cannot_create_tokens(client: Client, volunteer_user: User) -> None:
    client.force_login(volunteer_user)
    page = client.post("/account/tokens/", follow=True).content.decode()
    assert "Only approved researchers" in page and not AuthToken.objects.exists()


def test_a_researcher_creates_a_token_sees_it_once_and_revokes_it(client: Client, researcher: User) -> None:
    client.force_login(researcher)
    page = client.post("/account/tokens/", follow=True).content.decode()
    token = re.search(r"<code>(ct_[0-9a-f]+)</code>", page)
    assert token is not None and AuthToken.objects.filter(user=researcher).count() == 1
    assert token.group(1) not in client.get("/account/").content.decode()  # shown once
    assert client.get("/api/me/", HTTP_AUTHORIZATION=f"Token {token.group(1)}").status_code == 200

    digest = AuthToken.objects.get(user=researcher).digest
    assert (
        "Token revoked"
        in client.post("/account/tokens/revoke/", {"digest": digest}, follow=True).content.decode()
    )
    assert not AuthToken.objects.exists()


def test_nobody_revokes_anothers_token(client: Client, researcher: User, other_volunteer: User) -> None:
    token, _ = api_token_create(user=researcher)
    client.force_login(other_volunteer)
    page = client.post("/account/tokens/revoke/", {"digest": token.digest}, follow=True).content.decode()
    assert "No such token" in page and AuthToken.objects.filter(pk=token.pk).exists()


def test_the_account_page_does_not_list_anothers_tokens(client: Client, researcher: User) -> None:
    other = User.objects.create_user("other-researcher", password="x-pass-123456", is_staff=True)
    token, _ = api_token_create(user=other)
    client.force_login(researcher)
    assert token.token_key not in client.get("/account/").content.decode()
