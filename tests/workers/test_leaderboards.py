"""workers/leaderboards.py: boards ordered all-time or by recent average (decayed to now in SQL), per
project, paginated, and anyone's rank found off the current page."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime

import pytest
from django.contrib.auth.models import User
from django.utils import timezone

from projects.models import Project
from tests.workers.conftest import days, grant, user
from workers.leaderboards import (
    PAGE_SIZE,
    Order,
    board_find,
    board_page,
    team_board,
    volunteer_board,
    volunteer_projects,
    volunteer_rank,
)
from workers.models import Team, Volunteer
from workers.teams import team_create

GFLOP = 10**9


def volunteers_with(rows: Sequence[tuple[int, float, float | None]]) -> list[Volunteer]:
    """Volunteers with (total FLOPs, stored average, its age in days) as given, without a ledger."""
    now = timezone.now()
    made = []
    for i, (flops, avg, age) in enumerate(rows):
        volunteer = Volunteer.objects.get(user=user(f"v{i:03d}", display_name=f"Volunteer {i}"))
        volunteer.total_flops, volunteer.expavg_credit = flops, avg
        volunteer.expavg_time = None if age is None else now - days(age)
        volunteer.save()
        made.append(volunteer)
    return made


def test_the_database_decays_the_average_as_workers_credit_does(db: None) -> None:
    """The board's `recent` (SQL) against Volunteer.recent_credit (Python), for averages of every age:
    fresh, a week, a year, a century (exp underflows a double there: PostgreSQL would raise)."""
    volunteers = volunteers_with(
        [(GFLOP, 40.0, 0.001), (GFLOP, 40.0, 7), (GFLOP, 40.0, 365), (GFLOP, 40.0, 36500)]
    )
    now = timezone.now()
    _, rows = board_page(board=volunteer_board(project_id=None, order=Order.TOTAL, now=now), number=1)
    recent = {row.key: row.recent_credit for row in rows}
    for volunteer in volunteers:
        assert recent[volunteer.pk] == pytest.approx(volunteer.recent_credit(now=now), rel=1e-9, abs=1e-300)
    assert recent[volunteers[1].pk] == pytest.approx(20.0, rel=1e-4)  # a week and the test's seconds


def test_all_time_and_recent_orders_differ(
    mlp_project: Project, volunteer_user: User, other_volunteer: User, clock: Callable[[datetime], None]
) -> None:
    start = timezone.now()
    clock(start - days(60))
    grant(mlp_project, volunteer_user, 1000 * GFLOP)  # much, long ago
    clock(start)
    grant(mlp_project, other_volunteer, 10 * GFLOP)  # a little, today
    names = {
        order: [
            row.name
            for row in board_page(board=volunteer_board(project_id=None, order=order, now=start), number=1)[1]
        ]
        for order in Order
    }
    assert names[Order.TOTAL] == ["alice", "bob"]
    assert names[Order.RECENT] == ["bob", "alice"]


def test_a_project_board_counts_that_project_only(
    mlp_project: Project, second_project: Project, volunteer_user: User, other_volunteer: User
) -> None:
    grant(mlp_project, volunteer_user, 5 * GFLOP)
    grant(second_project, other_volunteer, 3 * GFLOP)
    grant(second_project, volunteer_user, 1 * GFLOP)
    now = timezone.now()
    _, rows = board_page(
        board=volunteer_board(project_id=second_project.pk, order=Order.TOTAL, now=now), number=1
    )
    assert [(row.name, row.total_flops, row.rank) for row in rows] == [
        ("bob", 3 * GFLOP, 1),
        ("alice", GFLOP, 2),
    ]
    _, overall = board_page(board=volunteer_board(project_id=None, order=Order.TOTAL, now=now), number=1)
    assert [(row.name, row.total_flops) for row in overall] == [("alice", 6 * GFLOP), ("bob", 3 * GFLOP)]


def test_names_on_boards_are_public_names(mlp_project: Project, volunteer_user: User) -> None:
    volunteer = Volunteer.objects.get_or_create(user=volunteer_user)[0]
    volunteer.display_name = "Ada"
    volunteer.save()
    grant(mlp_project, volunteer_user, GFLOP)
    _, rows = board_page(
        board=volunteer_board(project_id=None, order=Order.TOTAL, now=timezone.now()), number=1
    )
    assert [row.name for row in rows] == ["Ada"]


@pytest.mark.parametrize("order", list(Order))
def test_pages_and_ranks_agree_with_the_ordering_ties_included(db: None, order: Order) -> None:
    """120 volunteers, many tied on one key or both: page n holds ranks 50(n-1)+1..., and board_find gives
    every volunteer the rank and page where the pages show them."""
    specs = [((i % 7) * GFLOP + GFLOP, float(i % 5), (i % 3) * 2.0) for i in range(120)]
    volunteers_with(specs)
    board = volunteer_board(project_id=None, order=order, now=timezone.now())
    shown = {}
    for number in (1, 2, 3):
        page, rows = board_page(board=board, number=number)
        assert [row.rank for row in rows] == list(
            range(PAGE_SIZE * (number - 1) + 1, PAGE_SIZE * (number - 1) + len(rows) + 1)
        )
        shown.update({row.key: (row.rank, number) for row in rows})
    assert len(shown) == 120
    for key, (rank, number) in shown.items():
        found = board_find(board=board, key=key)
        assert found is not None and (found[0].rank, found[1]) == (rank, number)
    first = board_page(board=board, number=1)[1]
    keys = [(row.total_flops, row.recent_credit) for row in first]
    if order == Order.TOTAL:
        assert keys == sorted(keys, key=lambda k: (-k[0], -k[1]))
    else:
        assert keys == sorted(keys, key=lambda k: (-k[1], -k[0]))


def test_bad_page_numbers_give_a_page_and_strangers_no_rank(db: None) -> None:
    volunteers_with([(GFLOP, 1.0, 0.0)])
    board = volunteer_board(project_id=None, order=Order.TOTAL, now=timezone.now())
    for number in ("x", "-3", "99999999999999999999", None, "2"):
        page, rows = board_page(board=board, number=number)
        assert page.number == 1 and len(rows) == 1
    assert board_find(board=board, key=None) is None
    assert board_find(board=board, key=Volunteer.objects.create(user=user("nobody")).pk) is None


def test_the_team_board_lists_every_team_and_project_boards_those_with_credit(
    mlp_project: Project, second_project: Project, volunteer_user: User, other_volunteer: User
) -> None:
    busy = team_create(user=volunteer_user, name="Busy")
    idle = team_create(user=other_volunteer, name="Idle")
    grant(mlp_project, volunteer_user, 2 * GFLOP)
    now = timezone.now()
    _, rows = board_page(board=team_board(project_id=None, order=Order.TOTAL, now=now), number=1)
    assert [(row.name, row.members, row.total_flops) for row in rows] == [
        ("Busy", 1, 2 * GFLOP),
        ("Idle", 1, 0),
    ]
    _, rows = board_page(board=team_board(project_id=mlp_project.pk, order=Order.RECENT, now=now), number=1)
    assert [row.key for row in rows] == [busy.pk]
    found = board_find(board=team_board(project_id=None, order=Order.TOTAL, now=now), key=idle.pk)
    assert found is not None and found[0].rank == 2
    assert (
        board_page(board=team_board(project_id=second_project.pk, order=Order.TOTAL, now=now), number=1)[1]
        == []
    )
    assert Team.objects.count() == 2


def test_a_certificate_lists_projects_and_the_overall_rank(
    mlp_project: Project, second_project: Project, volunteer_user: User, other_volunteer: User
) -> None:
    grant(mlp_project, volunteer_user, 2 * GFLOP)
    grant(second_project, volunteer_user, 5 * GFLOP)
    grant(mlp_project, other_volunteer, 9 * GFLOP)
    volunteer = Volunteer.objects.get(user=volunteer_user)
    now = timezone.now()
    shares = volunteer_projects(volunteer=volunteer, now=now)
    assert [(s.name, s.total_flops, s.results) for s in shares] == [
        ("Second MLP", 5 * GFLOP, 1),
        ("MLP", 2 * GFLOP, 1),
    ]
    assert volunteer_rank(volunteer=volunteer, now=now) == (2, 2)
