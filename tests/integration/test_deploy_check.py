"""Production settings pass Django's deployment checklist without a single warning."""

from __future__ import annotations

import os
import secrets
import string
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_check_deploy_is_clean_in_production() -> None:
    alphabet = string.ascii_letters + string.digits + "!#%&()*+,-./:;<=>?@[]^_{|}~"
    env = {key: value for key, value in os.environ.items() if not key.startswith("DJANGO_")}
    env |= {
        "DJANGO_ENV": "production",
        "DJANGO_SECRET_KEY": "".join(secrets.choice(alphabet) for _ in range(50)),
        "DJANGO_ALLOWED_HOSTS": "example.org",
        "DJANGO_SETTINGS_MODULE": "config.settings",
    }
    done = subprocess.run(
        [sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
