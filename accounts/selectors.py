"""Who is a researcher, their requests and their API tokens; what a volunteer's account page shows."""

from __future__ import annotations

from dataclasses import dataclass

from allauth.account.models import EmailAddress
from django.contrib.auth.models import AnonymousUser, User
from django.db.models import Count, Q, QuerySet, Sum
from django.utils import timezone
from django.utils.functional import Promise
from django.utils.translation import gettext_lazy as _
from knox.models import AuthToken

from accounts.models import ResearcherRequest
from projects.models import Result
from workers.models import CreditEntry, Device, Volunteer

RECENT_RESULTS = 20


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


# --- a volunteer's own account ------------------------------------------------------------------------


def account_email(*, user: User) -> EmailAddress | None:
    """The address resets go to: the primary one, else the first given."""
    return EmailAddress.objects.filter(user=user).order_by("-primary", "pk").first()


def account_devices(*, volunteer: Volunteer) -> QuerySet[Device]:
    """The volunteer's devices, forgotten ones left out, most recently seen first."""
    return Device.objects.filter(volunteer=volunteer, forgotten_at__isnull=True).order_by("-last_seen", "-pk")


@dataclass(frozen=True)
class ProjectCredit:
    project_id: int
    name: str
    results: int
    flops: int


def account_credit_by_project(*, volunteer: Volunteer) -> list[ProjectCredit]:
    """The volunteer's ledger lines summed per project, most credit first."""
    rows = (
        CreditEntry.objects.filter(volunteer=volunteer)
        .values("project_id", "project__name")
        .annotate(results=Count("pk"), flops=Sum("flops"))
        .order_by("-flops", "project_id")
    )
    return [
        ProjectCredit(row["project_id"], row["project__name"], row["results"], int(row["flops"]))
        for row in rows
    ]


@dataclass(frozen=True)
class Outcome:
    """How a result ended, for people: a word, and a state the page colours (ok, bad, waiting, neutral)."""

    label: str | Promise
    state: str


OUTCOMES: dict[str, Outcome] = {
    Result.Status.IN_PROGRESS: Outcome(_("Computing"), "waiting"),
    Result.Status.RECEIVED: Outcome(_("Waiting for validation"), "waiting"),
    Result.Status.TIMED_OUT: Outcome(_("Timed out"), "bad"),
    Result.Status.CANCELLED: Outcome(_("Cancelled by the project"), "neutral"),
    Result.Status.RELEASED: Outcome(_("Handed back (page closed)"), "neutral"),
}
VALID = Outcome(_("Valid, credited"), "ok")
INVALID = Outcome(_("Invalid"), "bad")


def result_outcome(result: Result) -> Outcome:
    """A verdict, once there is one, says more than the status."""
    if result.validation == Result.Validation.VALID:
        return VALID
    if result.validation == Result.Validation.INVALID:
        return INVALID
    return OUTCOMES.get(result.status, Outcome(result.status, "neutral"))


def account_results_recent(*, user: User, limit: int = RECENT_RESULTS) -> list[Result]:
    """The user's latest results, each with `outcome` and `credit_flops` (0 without a ledger line)."""
    results = list(
        Result.objects.filter(volunteer=user)
        .select_related("work_unit__project", "credit")
        .order_by("-sent_at", "-pk")[:limit]
    )
    for result in results:
        result.outcome = result_outcome(result)  # type: ignore[attr-defined]
        credit = getattr(result, "credit", None)
        result.credit_flops = credit.flops if credit else 0  # type: ignore[attr-defined]
    return results
