"""Volunteer accounts: sign-up creates the Django user and its Volunteer profile together."""

from __future__ import annotations

from django.contrib.auth import get_user_model
from django.db import transaction

from workers.models import Volunteer


@transaction.atomic
def volunteer_create(*, username: str, password: str) -> Volunteer:
    """Create a (non-staff) user and its Volunteer profile; the caller has validated the credentials."""
    user = get_user_model().objects.create_user(username=username, password=password)
    return Volunteer.objects.create(user=user)
