"""Issue 9, finding 5: logins (public and admin) and sign-ups are throttled per address and per account.

Found: 200 wrong logins at 4.4/s, then the right password logged in; 50 wrong admin logins; 50 sign-ups from
one address. The counters live in the real Redis cache (django-ratelimit); "the window passes" moves the
limiter's clock, never a sleep.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest
import redis
from django.conf import settings as django_settings
from django.contrib.auth.models import User
from django.test import Client, RequestFactory

from frontend.throttle import client_ip

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("fresh_limiter")]
WRONG = "not-the-password"
REFUSED = "Too many failed log-ins"


def log_in(
    client: Client, username: str, password: str, path: str = "/accounts/login/", ip: str = "127.0.0.1"
) -> Any:
    field = "username" if path.startswith("/admin/") else "login"  # allauth's form calls it "login"
    return client.post(path, {field: username, "password": password}, REMOTE_ADDR=ip)


def test_the_limiter_counts_in_the_real_redis_cache(client: Client, volunteer_user: User) -> None:
    assert django_settings.CACHES["default"]["BACKEND"] == "django.core.cache.backends.redis.RedisCache"
    log_in(client, "alice", WRONG)
    prefix = django_settings.RATELIMIT_CACHE_PREFIX  # type: ignore[misc]  # set by fresh_limiter (tests/conftest.py)
    keys = redis.Redis.from_url(django_settings.REDIS_URL).keys(f"*{prefix}*")
    assert len(keys) == 2  # one counter for the address, one for the account


def test_the_right_password_is_refused_after_ten_wrong_ones_until_the_window_passes(
    client: Client, volunteer_user: User, window_passes: Any
) -> None:
    for _ in range(10):
        wrong = log_in(client, "alice", WRONG)
        assert wrong.status_code == 200 and "password you specified are not correct" in wrong.content.decode()

    refused = log_in(client, "alice", "alice-pass-123")
    assert refused.status_code == 429 and REFUSED in refused.content.decode()
    assert "_auth_user_id" not in client.session

    window_passes()
    accepted = log_in(client, "alice", "alice-pass-123")
    assert accepted.status_code == 302 and client.session["_auth_user_id"] == str(volunteer_user.pk)


def test_one_address_guessing_many_accounts_is_throttled(
    client: Client, volunteer_user: User, other_volunteer: User
) -> None:
    for i in range(10):
        log_in(client, f"guess-{i}", WRONG, ip="203.0.113.7")

    assert log_in(client, "alice", "alice-pass-123", ip="203.0.113.7").status_code == 429
    assert log_in(client, "bob", "bob-pass-123", ip="198.51.100.1").status_code == 302


def test_one_account_guessed_from_many_addresses_is_throttled(
    client: Client, volunteer_user: User, other_volunteer: User
) -> None:
    for i in range(10):
        log_in(client, "alice", WRONG, ip=f"203.0.113.{i + 1}")

    assert log_in(client, "alice", "alice-pass-123", ip="198.51.100.1").status_code == 429
    assert log_in(client, "bob", "bob-pass-123", ip="198.51.100.1").status_code == 302


def test_successful_logins_do_not_count(client: Client, volunteer_user: User) -> None:
    """Many simulated volunteers (or a lab behind one NAT) log in from one address: only failures count."""
    for _ in range(15):
        assert log_in(client, "alice", "alice-pass-123").status_code == 302
        client.post("/accounts/logout/")


def test_the_admin_login_shares_the_limit(client: Client, researcher: User, window_passes: Any) -> None:
    for _ in range(5):
        log_in(client, "researcher", WRONG)
    for _ in range(5):
        wrong = log_in(client, "researcher", WRONG, path="/admin/login/")
        assert wrong.status_code == 200 and "correct username and password" in wrong.content.decode()

    refused = log_in(client, "researcher", "research-pass-123", path="/admin/login/")
    assert refused.status_code == 429 and REFUSED in refused.content.decode()
    assert "_auth_user_id" not in client.session

    window_passes()
    accepted = log_in(client, "researcher", "research-pass-123", path="/admin/login/")
    assert accepted.status_code == 302 and client.session["_auth_user_id"] == str(researcher.pk)


def test_forwarded_for_is_ignored_unless_trusted(client: Client, volunteer_user: User) -> None:
    for i in range(10):
        form = {"login": f"guess-{i}", "password": WRONG}
        client.post("/accounts/login/", form, HTTP_X_FORWARDED_FOR=f"10.0.0.{i}")
    assert log_in(client, "alice", "alice-pass-123").status_code == 429


@pytest.mark.parametrize(
    ("hops", "forwarded", "remote", "expected"),
    [
        (0, "192.0.2.1", "127.0.0.1", "127.0.0.1"),
        (1, "192.0.2.1", "127.0.0.1", "192.0.2.1"),
        (1, "spoofed, 192.0.2.1", "127.0.0.1", "192.0.2.1"),
        (2, "192.0.2.9, 192.0.2.1", "127.0.0.1", "192.0.2.9"),
        (2, "192.0.2.1", "127.0.0.1", "127.0.0.1"),  # fewer hops than trusted: the proxy was bypassed
        (1, "not-an-address", "127.0.0.1", "127.0.0.1"),
        (0, "", "garbage", "0.0.0.0"),
        (0, "", "2001:db8::1", "2001:db8::1"),
    ],
)
def test_client_ip(settings: Any, hops: int, forwarded: str, remote: str, expected: str) -> None:
    settings.CROWDTRAIN_TRUSTED_PROXIES = hops
    request = RequestFactory().get("/", HTTP_X_FORWARDED_FOR=forwarded, REMOTE_ADDR=remote)
    assert client_ip(request) == expected


def sign_up(client: Client, username: str, ip: str = "127.0.0.1") -> Any:
    form = {"username": username, "password1": "a-Long-pass-4821", "password2": "a-Long-pass-4821"}
    response = client.post("/accounts/signup/", form, REMOTE_ADDR=ip)
    client.cookies.clear()  # signed up and logged in: log out for the next one
    return response


def test_sign_ups_per_address_are_limited(client: Client, settings: Any, window_passes: Any) -> None:
    settings.CROWDTRAIN_SIGNUP_RATE = "5/h"  # the production default
    for i in range(5):
        assert sign_up(client, f"volunteer{i}").status_code == 302

    refused = sign_up(client, "volunteer5")
    assert refused.status_code == 429 and "Too many sign-ups" in refused.content.decode()
    assert not User.objects.filter(username="volunteer5").exists()
    assert sign_up(client, "elsewhere", ip="198.51.100.1").status_code == 302

    window_passes()
    assert sign_up(client, "volunteer5").status_code == 302


def test_failed_sign_ups_do_not_count(client: Client, settings: Any) -> None:
    settings.CROWDTRAIN_SIGNUP_RATE = "2/h"
    for _ in range(5):
        bad = client.post(
            "/accounts/signup/", {"username": "x", "password1": "a-Long-pass-4821", "password2": "no"}
        )
        assert bad.status_code == 200
    assert sign_up(client, "finally").status_code == 302


def test_production_defaults() -> None:
    env = {**os.environ, "DJANGO_ENV": "production", "DJANGO_SECRET_KEY": "x" * 50}
    for name in ("CROWDTRAIN_LOGIN_RATE", "CROWDTRAIN_SIGNUP_RATE", "DJANGO_PASSWORD_HASHERS"):
        env.pop(name, None)
    code = "import django; django.setup(); from django.conf import settings as s; "
    code += "print(s.CROWDTRAIN_LOGIN_RATE, s.CROWDTRAIN_SIGNUP_RATE, s.CROWDTRAIN_TRUSTED_PROXIES)"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["10/m", "5/h", "0"], done.stderr
