"""Read queries for the leaderboards (volunteers and teams; all projects or one; all-time or recent), team
pages and volunteers' certificates.

Recent average credit is stored as BOINC stores it: expavg_credit as of expavg_time, changed only when credit
is granted. Boards order by its value now, expavg_credit * exp(-(now - expavg_time) * ln 2 / H), which the
database computes (RecentNow below: workers.credit.decayed in SQL, held equal to it by a test), so that one
page of a board is one query however many rows there are. Per-project boards read the per-project rows
(VolunteerProjectCredit, TeamProjectCredit) that credit_grant keeps with the same formula: a project's recent
average is then exactly the volunteer's own, restricted to that project, and never a scan of the ledger.

Ranks: row n of the ordering (ties broken by total credit, then by id, so every row has one rank); a
volunteer's own rank off the current page is 1 + the rows ahead of theirs, counted with the same keys.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any

from django.core.paginator import Page, Paginator
from django.db.models import Count, F, FloatField, Func, Model, Q, QuerySet, Value
from django.db.models.expressions import Combinable
from django.db.models.functions import Coalesce, Exp, Greatest, Least

from projects.models import Project
from workers.credit import HALF_LIFE_SECONDS, MIN_EXPONENT, credit_from_flops
from workers.models import Team, TeamProjectCredit, Volunteer, VolunteerProjectCredit

PAGE_SIZE = 50


class Order(StrEnum):
    TOTAL = "total"
    RECENT = "recent"


class EpochSeconds(Func):
    """Unix seconds of a datetime column, as a double, in PostgreSQL and in SQLite (local runs)."""

    output_field = FloatField()
    template = "EXTRACT(EPOCH FROM %(expressions)s)"

    def as_postgresql(self, compiler: Any, connection: Any, **extra: Any) -> Any:
        return self.as_sql(
            compiler, connection, template="EXTRACT(EPOCH FROM %(expressions)s)::float8", **extra
        )

    def as_sqlite(self, compiler: Any, connection: Any, **extra: Any) -> Any:
        # Django stores aware datetimes as UTC text there; julianday reads it (2440587.5 is 1970-01-01).
        return self.as_sql(
            compiler, connection, template="((julianday(%(expressions)s) - 2440587.5) * 86400.0)", **extra
        )


def recent_now(*, now: datetime, prefix: str = "") -> Combinable:
    """The row's recent average credit decayed to `now` (0 before any credit), in SQL."""
    at = now.timestamp()
    age = Value(at) - Coalesce(EpochSeconds(F(f"{prefix}expavg_time")), Value(at))
    exponent = Least(Greatest(-age * (math.log(2) / HALF_LIFE_SECONDS), Value(MIN_EXPONENT)), Value(0.0))
    return F(f"{prefix}expavg_credit") * Exp(exponent, output_field=FloatField())


@dataclass(frozen=True)
class BoardRow:
    rank: int
    key: int  # the volunteer's or the team's id
    name: str
    total_flops: int
    recent_credit: float
    team: Team | None = None
    members: int | None = None
    country: str = ""

    @property
    def total_credit(self) -> float:
        return credit_from_flops(self.total_flops)


@dataclass(frozen=True)
class Board:
    """One leaderboard, ordered; `kind` is "volunteers" or "teams"."""

    kind: str
    rows: QuerySet[Any]
    order: Order

    def ordering(self) -> tuple[str, ...]:
        if self.order == Order.RECENT:
            return ("-recent", "-total_flops", "pk")
        return ("-total_flops", "-recent", "pk")

    def ordered(self) -> QuerySet[Any]:
        return self.rows.order_by(*self.ordering())


def volunteer_board(*, project_id: int | None, order: Order, now: datetime) -> Board:
    if project_id is None:
        rows: QuerySet[Any] = Volunteer.objects.filter(total_flops__gt=0).select_related("user", "team")
        return Board("volunteers", rows.annotate(recent=recent_now(now=now)), order)
    rows = VolunteerProjectCredit.objects.filter(project_id=project_id, total_flops__gt=0)
    rows = rows.select_related("volunteer__user", "volunteer__team")
    return Board("volunteers", rows.annotate(recent=recent_now(now=now)), order)


def team_board(*, project_id: int | None, order: Order, now: datetime) -> Board:
    """All teams (the list one joins from, credit or not), or the teams with credit in one project."""
    if project_id is None:
        rows: QuerySet[Any] = Team.objects.annotate(members_count=Count("members"))
        return Board("teams", rows.annotate(recent=recent_now(now=now)), order)
    rows = TeamProjectCredit.objects.filter(project_id=project_id, total_flops__gt=0).select_related("team")
    rows = rows.annotate(members_count=Count("team__members"))
    return Board("teams", rows.annotate(recent=recent_now(now=now)), order)


def board_page(*, board: Board, number: Any) -> tuple[Page[Any], list[BoardRow]]:
    """One page (any bad or out-of-range number gives the first or last page) and its rows, ranked."""
    page = Paginator(board.ordered(), PAGE_SIZE).get_page(number)
    start = page.start_index()
    return page, [_row(board, obj, rank=start + i) for i, obj in enumerate(page.object_list)]


def board_find(*, board: Board, key: int | None) -> tuple[BoardRow, int] | None:
    """The row of volunteer or team `key` and the page it is on, or None if it is not on the board."""
    if key is None:
        return None
    field = "pk" if board.rows.model in (Volunteer, Team) else board.kind[:-1]  # "volunteer" / "team"
    mine = board.rows.filter(**{field: key}).first()
    if mine is None:
        return None
    rank = 1 + board.rows.filter(_ahead(board, mine)).count()
    return _row(board, mine, rank=rank), (rank - 1) // PAGE_SIZE + 1


def _ahead(board: Board, mine: Model) -> Q:
    """Rows before `mine` in the board's ordering: lexicographic over its keys."""
    ahead, tied = Q(pk__in=[]), Q()
    for key in board.ordering():
        name = key.lstrip("-")
        value = getattr(mine, name)
        ahead |= tied & Q(**{f"{name}__{'gt' if key.startswith('-') else 'lt'}": value})
        tied &= Q(**{name: value})
    return ahead


def _row(board: Board, obj: Any, *, rank: int) -> BoardRow:
    if board.kind == "teams":
        team = obj if isinstance(obj, Team) else obj.team
        return BoardRow(
            rank,
            team.pk,
            team.name,
            obj.total_flops,
            obj.recent,
            members=obj.members_count,
            country=team.country,
        )
    volunteer = obj if isinstance(obj, Volunteer) else obj.volunteer
    return BoardRow(
        rank,
        volunteer.pk,
        volunteer.public_name(),
        obj.total_flops,
        obj.recent,
        team=volunteer.team,
        country=volunteer.country,
    )


def board_projects() -> QuerySet[Project]:
    """Projects anyone has credit in: the per-project boards there are."""
    return Project.objects.filter(volunteer_credit__total_flops__gt=0).distinct().order_by("name")


# --- team pages and certificates -------------------------------------------------------------------


def volunteer_find(*, user_id: int | None) -> Volunteer | None:
    """The user's volunteer row if there is one (pages only read: no row is created for a visitor)."""
    if user_id is None:
        return None
    return Volunteer.objects.select_related("user", "team").filter(user_id=user_id).first()


@dataclass(frozen=True)
class ProjectShare:
    project_id: int
    name: str
    total_flops: int
    recent_credit: float
    results: int | None = None
    since: datetime | None = None

    @property
    def total_credit(self) -> float:
        return credit_from_flops(self.total_flops)


def team_detail(*, team_id: int) -> Team:
    """The team, its founder and member count (Team.DoesNotExist if there is none)."""
    teams = Team.objects.select_related("founder__volunteer").annotate(members_count=Count("members"))
    return teams.get(pk=team_id)


def team_members(*, team: Team, now: datetime) -> QuerySet[Volunteer]:
    """Members, most credit first, each with `recent` (their recent average now)."""
    members = team.members.select_related("user").annotate(recent=recent_now(now=now))
    return members.order_by("-total_flops", "pk")


def team_projects(*, team: Team, now: datetime) -> list[ProjectShare]:
    rows = team.project_credit.select_related("project").annotate(recent=recent_now(now=now))
    return [
        ProjectShare(row.project_id, row.project.name, row.total_flops, row.recent)
        for row in rows.order_by("-total_flops", "project__name")
    ]


def volunteer_projects(*, volunteer: Volunteer, now: datetime) -> list[ProjectShare]:
    """The volunteer's credit per project (the certificate, the account page)."""
    rows = volunteer.project_credit.select_related("project").annotate(recent=recent_now(now=now))
    return [
        ProjectShare(row.project_id, row.project.name, row.total_flops, row.recent, row.results, row.since)
        for row in rows.order_by("-total_flops", "project__name")
    ]


def volunteer_rank(*, volunteer: Volunteer, now: datetime) -> tuple[int, int] | None:
    """(rank by total credit, volunteers with credit), or None without credit."""
    board = volunteer_board(project_id=None, order=Order.TOTAL, now=now)
    found = board_find(board=board, key=volunteer.pk)
    return (found[0].rank, board.rows.count()) if found else None
