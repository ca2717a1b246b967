"""All of a user's data as one JSON document (GET /account/export/), written piece by piece: an account with
years of results costs one page of rows in memory at a time, never the whole document.

What is theirs: the account (username, e-mail addresses, dates), the volunteer profile and team, devices
(forgotten ones too), every ledger line and result, computing preferences, researcher requests and API
tokens' public prefixes. Nothing else: no password hash, no token digests, no browser ids (a device's
client_id lets a browser be taken for that device), nobody else's rows."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from allauth.account.models import EmailAddress
from django.contrib.auth.models import User
from django.core.serializers.json import DjangoJSONEncoder
from django.db.models import F, Model, QuerySet
from django.utils import timezone
from knox.models import AuthToken

from accounts.models import ResearcherRequest
from accounts.selectors import result_outcome, user_is_researcher
from projects.models import Result
from workers.credit import credit_from_flops
from workers.models import ComputingPreferences, CreditEntry, Device, Volunteer

FORMAT_VERSION = 1
PAGE_ROWS = 1000

M = TypeVar("M", bound=Model)
Row = dict[str, Any]


def account_export(*, user: User) -> Iterator[str]:
    """The document in pieces; joined, one JSON object."""
    volunteer = Volunteer.objects.filter(user=user).select_related("team").first()
    sections: list[tuple[str, Any]] = [
        ("format", FORMAT_VERSION),
        ("exported_at", timezone.now()),
        ("account", _account(user)),
        ("volunteer", _volunteer(volunteer) if volunteer else None),
    ]
    lists: list[tuple[str, Iterable[Row]]] = [
        ("devices", _pages(Device.objects.filter(volunteer=volunteer), _device)),
        ("credit_entries", _pages(CreditEntry.objects.filter(volunteer=volunteer), _credit_entry)),
        ("results", _pages(_results(user), _result)),
        ("computing_preferences", map(_preferences, _preference_rows(volunteer))),
        ("researcher_requests", map(_researcher_request, user.researcher_requests.order_by("pk"))),
        ("api_tokens", _api_tokens(user)),
    ]
    yield "{"
    for index, (key, value) in enumerate(sections):
        yield f"{',' if index else ''}{_dump(key)}: {_dump(value)}"
    for key, rows in lists:
        yield from _array(key, rows)
    yield "}\n"


def _dump(value: Any) -> str:
    return json.dumps(value, cls=DjangoJSONEncoder, ensure_ascii=False)


def _array(key: str, rows: Iterable[Row]) -> Iterator[str]:
    yield f", {_dump(key)}: ["
    for index, row in enumerate(rows):
        yield ("," if index else "") + _dump(row)
    yield "]"


def _pages(queryset: QuerySet[M], to_row: Callable[[M], Row]) -> Iterator[Row]:
    """By primary key, a page at a time (no server-side cursor to keep open between pieces)."""
    last = 0
    while page := list(queryset.filter(pk__gt=last).order_by("pk")[:PAGE_ROWS]):
        yield from map(to_row, page)
        last = page[-1].pk


def _account(user: User) -> Row:
    addresses = EmailAddress.objects.filter(user=user).order_by("pk")
    return {
        "username": user.get_username(),
        "email_addresses": [
            {"email": a.email, "verified": a.verified, "primary": a.primary} for a in addresses
        ],
        "date_joined": user.date_joined,
        "last_login": user.last_login,
        "is_researcher": user_is_researcher(user=user),
    }


def _volunteer(volunteer: Volunteer) -> Row:
    team = volunteer.team
    return {
        "id": volunteer.pk,
        "display_name": volunteer.display_name,
        "public_name": volunteer.public_name(),
        "country": volunteer.country,
        "url": volunteer.url,
        "team": {"id": team.pk, "name": team.name} if team else None,
        "team_joined_at": volunteer.team_joined_at,
        "total_flops": volunteer.total_flops,
        "total_credit": volunteer.total_credit(),
        "recent_average_credit": volunteer.recent_credit(now=timezone.now()),
        "results_accepted": volunteer.results_accepted,
        "results_invalid": volunteer.results_invalid,
        "created_at": volunteer.created_at,
    }


def _device(device: Device) -> Row:
    return {
        "id": device.pk,
        "name": device.name,
        "backend": device.backend,
        "benchmark_gflops": device.gflops,
        "observed_gflops": device.observed_gflops,
        "total_flops": device.total_flops,
        "total_credit": device.total_credit(),
        "compute_ms": device.compute_ms,
        "online_ms": device.online_ms,
        "user_agent": device.user_agent,
        "created_at": device.created_at,
        "last_seen": device.last_seen,
        "forgotten_at": device.forgotten_at,
    }


def _credit_entry(entry: CreditEntry) -> Row:
    return {
        "id": entry.pk,
        "project_id": entry.project_id,
        "result_id": entry.result_id,
        "team_id": entry.team_id,
        "flops": entry.flops,
        "credit": credit_from_flops(entry.flops),
        "created_at": entry.created_at,
    }


def _results(user: User) -> QuerySet[Result]:
    return Result.objects.filter(volunteer=user).annotate(project_id=F("work_unit__project_id"))


def _result(result: Result) -> Row:
    return {
        "id": result.pk,
        "project_id": result.project_id,  # type: ignore[attr-defined]
        "work_unit_id": result.work_unit_id,
        "device_id": result.device_id,
        "status": result.status,
        "validation": result.validation,
        "outcome": str(result_outcome(result).label),
        "reason": result.reason,
        "samples": result.samples,
        "loss": result.loss,
        "compute_ms": result.compute_ms,
        "download_ms": result.download_ms,
        "sent_at": result.sent_at,
        "received_at": result.received_at,
    }


def _preference_rows(volunteer: Volunteer | None) -> list[ComputingPreferences]:
    rows = ComputingPreferences.objects.filter(volunteer=volunteer).prefetch_related("chosen_projects")
    return list(rows.order_by("pk")) if volunteer else []


def _preferences(row: ComputingPreferences) -> Row:
    """Every stored field, whatever the preferences grow to hold (the model is the preferences page's)."""
    skip = {"id", "volunteer"}
    fields = {f.attname: getattr(row, f.attname) for f in row._meta.concrete_fields if f.name not in skip}
    return fields | {"chosen_project_ids": sorted(p.pk for p in row.chosen_projects.all())}


def _researcher_request(request: ResearcherRequest) -> Row:
    return {
        "affiliation": request.affiliation,
        "purpose": request.purpose,
        "status": request.status,
        "created_at": request.created_at,
        "decided_at": request.decided_at,
    }


def _api_tokens(user: User) -> Iterator[Row]:
    for token in AuthToken.objects.filter(user=user).order_by("created"):
        yield {"token_prefix": token.token_key, "created": token.created, "expiry": token.expiry}
