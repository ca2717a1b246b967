"""Who is a researcher, their requests and their API tokens."""

from __future__ import annotations

from django.contrib.auth.models import AnonymousUser, User
from django.db.models import Q, QuerySet
from django.utils import timezone
from knox.models import AuthToken

from accounts.models import ResearcherRequest


def user_is_researcher(*, user: User | AnonymousUser) -> bool:
    """Approved researchers are staff (the admin shows them only their own rows); staff and superusers made
    by hand count too."""
    return bool(user.is_authenticated and user.is_active and user.is_staff)


def researcher_request_latest(*, user: User) -> ResearcherRequest | None:
    return user.researcher_requests.order_by("-created_at").first()


def api_token_list(*, user: User) -> QuerySet[AuthToken]:
    """The user's unexpired tokens, newest first."""
    live = Q(expiry__isnull=True) | Q(expiry__gt=timezone.now())
    return AuthToken.objects.filter(live, user=user).order_by("-created")
