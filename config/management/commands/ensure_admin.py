"""`manage.py ensure_admin`: make sure an admin account exists, without ever storing a plaintext password."""

from __future__ import annotations

import os
import secrets
from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand

DEFAULT_USERNAME = "admin"


def admin_username() -> str:
    return os.environ.get("CROWDTRAIN_ADMIN_USER") or DEFAULT_USERNAME


class Command(BaseCommand):
    help = (
        "Create the admin user (CROWDTRAIN_ADMIN_USER, default 'admin') if missing. The password comes from "
        "CROWDTRAIN_ADMIN_PASSWORD, or is generated and printed once."
    )

    def handle(self, *args: Any, **options: Any) -> None:
        User = get_user_model()
        username = admin_username()
        password = os.environ.get("CROWDTRAIN_ADMIN_PASSWORD") or ""
        user = User.objects.filter(username=username).first()
        if user is not None:
            if password and not user.check_password(password):
                user.set_password(password)
                user.save(update_fields=["password"])
                self.stdout.write(f"Admin user '{username}': password set from CROWDTRAIN_ADMIN_PASSWORD.")
            else:
                self.stdout.write(f"Admin user '{username}' exists.")
            return
        generated = not password
        password = password or secrets.token_urlsafe(12)
        User.objects.create_superuser(username=username, email="", password=password)
        if not generated:
            self.stdout.write(f"Created admin user '{username}' (password from CROWDTRAIN_ADMIN_PASSWORD).")
            return
        self.stdout.write(
            self.style.WARNING(
                f"Created admin user '{username}' with password: {password}\n"
                "  This is shown only once and is not stored anywhere in plaintext. Change it with\n"
                f"  `.venv/bin/python manage.py changepassword {username}` or at /admin/password_change/."
            )
        )
