"""`manage.py ensure_admin`: an admin exists afterwards; a generated password is shown once, never stored."""

from __future__ import annotations

import io
import re

import pytest
from django.contrib.auth.models import User
from django.core.management import call_command

pytestmark = pytest.mark.django_db


def ensure_admin() -> str:
    out = io.StringIO()
    call_command("ensure_admin", stdout=out)
    return out.getvalue()


def test_generated_password_is_printed_once_and_works(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CROWDTRAIN_ADMIN_USER", raising=False)
    monkeypatch.delenv("CROWDTRAIN_ADMIN_PASSWORD", raising=False)
    first = ensure_admin()
    password = re.search(r"with password: (\S+)", first).group(1)  # type: ignore[union-attr]
    admin = User.objects.get(username="admin")
    assert admin.is_superuser and admin.is_staff and admin.check_password(password)
    assert password not in admin.password  # only the hash is stored
    second = ensure_admin()
    assert "exists" in second and password not in second
    assert User.objects.filter(is_superuser=True).count() == 1


def test_credentials_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CROWDTRAIN_ADMIN_USER", "root-of-all")
    monkeypatch.setenv("CROWDTRAIN_ADMIN_PASSWORD", "first-Secret-123")
    assert "first-Secret-123" not in ensure_admin()
    assert User.objects.get(username="root-of-all").check_password("first-Secret-123")

    monkeypatch.setenv("CROWDTRAIN_ADMIN_PASSWORD", "second-Secret-456")
    ensure_admin()
    assert User.objects.get(username="root-of-all").check_password("second-Secret-456")
