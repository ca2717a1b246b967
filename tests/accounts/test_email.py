"""allauth's mail flows, end to end through the site's URLs with Django's locmem outbox: an address given at
sign-up is mailed a link that verifies it; a reset mail's link sets a new password that logs in; password
changes; the limits on reset mails; the mail settings production reads from the environment."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from allauth.account.models import EmailAddress
from django.contrib.auth.models import User
from django.core import mail
from django.test import Client

from tests.integration.test_deploy_check import production
from workers.models import Volunteer

pytestmark = pytest.mark.django_db
ROOT = Path(__file__).resolve().parents[2]
NEW_PASSWORD = "a-brand-new-pass-456"


def link(message: mail.EmailMessage, path: str) -> str:
    """The site-relative link under `path` in a mail's body."""
    found = re.search(rf"https?://[^/\s]+({re.escape(path)}[^\s]+)", str(message.body))
    assert found, message.body
    return found.group(1)


def sign_up(client: Client, **fields: str) -> Any:
    data = {"username": "carol", "password1": "carol-pass-123", "password2": "carol-pass-123"} | fields
    return client.post("/accounts/signup/", data)


def test_an_address_given_at_sign_up_is_verified_by_the_mailed_link(
    client: Client, mailoutbox: list[Any]
) -> None:
    assert sign_up(client, email="carol@example.org").status_code == 302
    user = User.objects.get(username="carol")
    assert Volunteer.objects.filter(user=user).exists()
    address = EmailAddress.objects.get(user=user)
    assert address.email == "carol@example.org" and not address.verified

    assert len(mailoutbox) == 1 and mailoutbox[0].to == ["carol@example.org"]
    assert mailoutbox[0].subject.startswith("[Crowdtrain] ")
    confirm = link(mailoutbox[0], "/accounts/confirm-email/")
    # Opening the link asks to confirm (a mail scanner fetching it verifies nothing); confirming verifies.
    assert client.get(confirm).status_code == 200
    address.refresh_from_db()
    assert not address.verified
    assert client.post(confirm).status_code == 302
    address.refresh_from_db()
    assert address.verified and address.primary


def test_a_forged_verification_link_verifies_nothing(client: Client, mailoutbox: list[Any]) -> None:
    sign_up(client, email="carol@example.org")
    client.post("/accounts/confirm-email/not-a-real-key/")
    assert not EmailAddress.objects.get(email="carol@example.org").verified


def test_sign_up_without_an_address_sends_no_mail(client: Client, mailoutbox: list[Any]) -> None:
    assert sign_up(client).status_code == 302
    assert User.objects.filter(username="carol").exists() and not EmailAddress.objects.exists()
    assert mailoutbox == []
    assert "No e-mail address" in client.get("/account/").content.decode()


def test_a_reset_mails_a_link_that_sets_a_new_password(
    client: Client, volunteer_user: User, mailoutbox: list[Any]
) -> None:
    EmailAddress.objects.create(user=volunteer_user, email="alice@example.org", verified=True, primary=True)
    response = client.post("/accounts/password/reset/", {"email": "alice@example.org"})
    assert response.status_code == 302 and len(mailoutbox) == 1

    reset = link(mailoutbox[0], "/accounts/password/reset/key/")
    form = client.get(reset, follow=True)  # the key moves into the session; the form is on a plain URL
    assert form.status_code == 200 and 'name="password1"' in form.content.decode()
    done = client.post(form.redirect_chain[-1][0], {"password1": NEW_PASSWORD, "password2": NEW_PASSWORD})
    assert done.status_code == 302

    assert Client().post("/accounts/login/", {"login": "alice", "password": NEW_PASSWORD}).status_code == 302
    refused = Client().post("/accounts/login/", {"login": "alice", "password": "alice-pass-123"})
    assert refused.status_code == 200 and "_auth_user_id" not in refused.client.session
    # A reset link works once.
    assert "_auth_user_id" not in client.session
    again = client.get(reset, follow=True).content.decode()
    assert 'name="password1"' not in again


def test_a_reset_for_an_unknown_address_says_nothing_of_accounts(
    client: Client, volunteer_user: User, mailoutbox: list[Any]
) -> None:
    known = client.post("/accounts/password/reset/", {"email": "nobody@example.org"})
    assert known.status_code == 302  # the same answer as for a known address
    assert len(mailoutbox) == 1 and "/accounts/password/reset/key/" not in str(mailoutbox[0].body)


def test_reset_mails_per_address_are_limited(
    client: Client, volunteer_user: User, mailoutbox: list[Any]
) -> None:
    EmailAddress.objects.create(user=volunteer_user, email="alice@example.org", verified=True, primary=True)
    statuses = [
        client.post("/accounts/password/reset/", {"email": "alice@example.org"}).status_code for _ in range(6)
    ]
    assert statuses == [302] * 5 + [429] and len(mailoutbox) == 5
    refused = client.post("/accounts/password/reset/", {"email": "alice@example.org"})
    assert "Too many requests" in refused.content.decode()  # the site's page (templates/429.html)


def test_the_password_is_changed_with_the_old_one(client: Client, volunteer_user: User) -> None:
    client.force_login(volunteer_user)
    wrong = client.post(
        "/accounts/password/change/",
        {"oldpassword": "not-it", "password1": NEW_PASSWORD, "password2": NEW_PASSWORD},
    )
    assert wrong.status_code == 200
    volunteer_user.refresh_from_db()
    assert volunteer_user.check_password("alice-pass-123")
    response = client.post(
        "/accounts/password/change/",
        {"oldpassword": "alice-pass-123", "password1": NEW_PASSWORD, "password2": NEW_PASSWORD},
    )
    assert response.status_code == 302
    volunteer_user.refresh_from_db()
    assert volunteer_user.check_password(NEW_PASSWORD)


def production_mail_settings(**env: str) -> dict[str, Any]:
    """The mail settings a production process reads from this environment."""
    names = ["EMAIL_BACKEND", "EMAIL_HOST", "EMAIL_PORT", "EMAIL_HOST_USER", "EMAIL_HOST_PASSWORD"]
    names += [
        "EMAIL_USE_TLS",
        "EMAIL_USE_SSL",
        "EMAIL_TIMEOUT",
        "DEFAULT_FROM_EMAIL",
        "ACCOUNT_DEFAULT_HTTP_PROTOCOL",
    ]
    code = "import json, sys; from config import settings as s; "
    code += f"json.dump({{n: getattr(s, n) for n in {names}}}, sys.stdout)"
    done = production("-c", code, **env)
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout))


def test_production_sends_through_the_smtp_server_of_the_environment() -> None:
    got = production_mail_settings(
        DJANGO_EMAIL_HOST="smtp.example.org",
        DJANGO_EMAIL_PORT="2525",
        DJANGO_EMAIL_HOST_USER="mailer",
        DJANGO_EMAIL_HOST_PASSWORD="s3cret",
        DJANGO_DEFAULT_FROM_EMAIL="Crowdtrain <volunteers@example.org>",
    )
    assert got == {
        "EMAIL_BACKEND": "django.core.mail.backends.smtp.EmailBackend",
        "EMAIL_HOST": "smtp.example.org",
        "EMAIL_PORT": 2525,
        "EMAIL_HOST_USER": "mailer",
        "EMAIL_HOST_PASSWORD": "s3cret",
        "EMAIL_USE_TLS": True,
        "EMAIL_USE_SSL": False,
        "EMAIL_TIMEOUT": 10,
        "DEFAULT_FROM_EMAIL": "Crowdtrain <volunteers@example.org>",
        "ACCOUNT_DEFAULT_HTTP_PROTOCOL": "https",
    }
    implicit_tls = production_mail_settings(DJANGO_EMAIL_USE_SSL="true", DJANGO_EMAIL_PORT="465")
    assert (implicit_tls["EMAIL_USE_SSL"], implicit_tls["EMAIL_USE_TLS"]) == (True, False)


def test_locally_mail_goes_to_the_console() -> None:
    code = "from config import settings as s; print(s.EMAIL_BACKEND)"
    env = {key: value for key, value in os.environ.items() if not key.startswith("DJANGO_")}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.stdout.strip() == "django.core.mail.backends.console.EmailBackend", done.stderr
