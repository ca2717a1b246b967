"""Production settings pass Django's deployment checklist without a single warning."""

from __future__ import annotations

import os
import secrets
import string
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def production(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """`args` run in the repository with production settings (the environment's DJANGO_ names dropped)."""
    alphabet = string.ascii_letters + string.digits + "!#%&()*+,-./:;<=>?@[]^_{|}~"
    base = {key: value for key, value in os.environ.items() if not key.startswith("DJANGO_")}
    base |= {
        "DJANGO_ENV": "production",
        "DJANGO_SECRET_KEY": "".join(secrets.choice(alphabet) for _ in range(50)),
        "DJANGO_ALLOWED_HOSTS": "example.org",
        "DJANGO_SETTINGS_MODULE": "config.settings",
    }
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=base | env, capture_output=True, text=True, timeout=120
    )


def test_check_deploy_is_clean_in_production() -> None:
    done = production("manage.py", "check", "--deploy", "--fail-level", "WARNING")
    assert done.returncode == 0, done.stdout + done.stderr


HASHERS = "from config import settings; print(','.join(settings.PASSWORD_HASHERS))"


def test_production_hashes_new_passwords_with_pbkdf2_and_refuses_md5() -> None:
    """The test suite hashes with MD5 (tests/environment.py); production must not."""
    done = production("-c", HASHERS)
    assert done.stdout.split(",")[0] == "django.contrib.auth.hashers.PBKDF2PasswordHasher", done.stderr
    argon = ",".join(
        f"django.contrib.auth.hashers.{name}" for name in ("Argon2PasswordHasher", "PBKDF2PasswordHasher")
    )
    assert production("-c", HASHERS, DJANGO_PASSWORD_HASHERS=argon).stdout.strip() == argon
    md5 = production("-c", HASHERS, DJANGO_PASSWORD_HASHERS="django.contrib.auth.hashers.MD5PasswordHasher")
    assert md5.returncode != 0 and "MD5 cannot hash new passwords" in md5.stderr
