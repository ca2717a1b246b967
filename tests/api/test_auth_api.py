"""accounts/api.py: tokens from HTTP Basic for approved researchers, throttled like every login."""

from __future__ import annotations

import base64
from typing import Any

import pytest
from django.contrib.auth.models import User
from knox.models import AuthToken
from rest_framework.test import APIClient

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("fresh_limiter")]


def basic(username: str, password: str) -> dict[str, Any]:
    return {"HTTP_AUTHORIZATION": "Basic " + base64.b64encode(f"{username}:{password}".encode()).decode()}


def test_an_approved_researcher_gets_a_working_expiring_token(intruder: User) -> None:
    response = APIClient().post("/api/auth/login/", **basic("mallory", "mallory-pass-123"))
    assert response.status_code == 200 and response.json()["expiry"] is not None
    token = response.json()["token"]
    assert token.startswith("ct_") and AuthToken.objects.filter(user=intruder).count() == 1
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {token}")
    assert client.get("/api/me/").json() == {"username": "mallory", "is_researcher": True}


def test_a_wrong_password_is_401_and_guessing_is_throttled(intruder: User) -> None:
    for _ in range(10):
        assert APIClient().post("/api/auth/login/", **basic("mallory", "wrong")).status_code == 401
    refused = APIClient().post("/api/auth/login/", **basic("mallory", "mallory-pass-123"))
    assert refused.status_code == 429 and "Too many failed log-ins" in refused.json()["detail"]
    assert not AuthToken.objects.filter(user=intruder).exists()


def test_a_revoked_researcher_loses_tokens_and_access(intruder: User, intruder_api: APIClient) -> None:
    from accounts.services import researcher_revoke

    researcher_revoke(user=intruder)
    assert intruder_api.get("/api/me/").status_code == 401
    client = APIClient()
    client.force_authenticate(intruder)
    assert client.get("/api/datasets/").status_code == 403
