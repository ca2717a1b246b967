"""Researchers with API tokens, a second researcher to trespass with, and anonymous clients."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import User
from rest_framework.test import APIClient

from accounts.services import api_token_create, researcher_request_approve, researcher_request_create


def approved_researcher(username: str) -> User:
    """A user who signed up and asked, approved by staff: the real path to a researcher account."""
    user = User.objects.create_user(username, password=f"{username}-pass-123")
    staff = User.objects.filter(is_superuser=True).first() or User.objects.create_superuser(
        "staff", password="x"
    )
    request = researcher_request_create(user=user, affiliation="A lab", purpose="Digits")
    researcher_request_approve(researcher_request=request, by=staff)
    user.refresh_from_db()
    return user


def token_client(user: User) -> APIClient:
    client = APIClient()
    _, token = api_token_create(user=user)
    client.credentials(HTTP_AUTHORIZATION=f"Token {token}")
    return client


@pytest.fixture
def owner(researcher: User) -> User:
    """tests/conftest.py's researcher (staff made by hand) owns the digits dataset and the MLP project."""
    return researcher


@pytest.fixture
def api(owner: User) -> APIClient:
    return token_client(owner)


@pytest.fixture
def intruder(db: None) -> User:
    return approved_researcher("mallory")


@pytest.fixture
def intruder_api(intruder: User) -> APIClient:
    return token_client(intruder)


@pytest.fixture
def anonymous() -> APIClient:
    return APIClient()


@pytest.fixture
def volunteer_api(volunteer_user: User) -> APIClient:
    """A logged-in volunteer (session), not a researcher."""
    client = APIClient()
    client.force_authenticate(volunteer_user)
    return client
