"""The leaderboard page (frontend/views.py): volunteers all-time and recent, per project, paginated, and the
viewer's own rank highlighted on its page and shown on every other."""

from __future__ import annotations

import re
from datetime import timedelta

from django.contrib.auth.models import User
from django.test import Client
from django.utils import timezone

from projects.models import Project
from tests.workers.conftest import grant, user
from workers.models import Volunteer

GFLOP = 10**9


def names(html: str) -> list[str]:
    if 'id="leaderboard"' not in html:
        return []
    table = html[html.index('id="leaderboard"') :]
    return re.findall(r'<td class="username"><a href="/volunteers/\d+/certificate/">([^<]+)</a>', table)


def test_boards_by_project_and_order(
    client: Client, mlp_project: Project, second_project: Project, volunteer_user: User, other_volunteer: User
) -> None:
    grant(mlp_project, volunteer_user, 50 * GFLOP)
    grant(second_project, other_volunteer, 20 * GFLOP)
    Volunteer.objects.filter(user=volunteer_user).update(expavg_time=timezone.now() - timedelta(days=30))

    assert names(client.get("/leaderboard/").content.decode()) == ["alice", "bob"]
    assert names(client.get("/leaderboard/?order=recent").content.decode()) == ["bob", "alice"]
    html = client.get(f"/leaderboard/?project={second_project.pk}").content.decode()
    assert names(html) == ["bob"] and f'<option value="{second_project.pk}" selected>' in html
    for junk in (
        "?project=abc&order=sideways",
        "?project=-1",
        "?project=99999999999999999999999",
        "?page=%00",
    ):
        response = client.get("/leaderboard/" + junk)
        assert response.status_code == 200 and names(response.content.decode()) == ["alice", "bob"]
    assert names(client.get("/leaderboard/?project=424242").content.decode()) == []


def test_your_rank_is_highlighted_or_shown_above_the_board(client: Client, db: None) -> None:
    volunteers = []
    for i in range(60):
        made = user(f"volunteer{i:02d}", display_name=f"Volunteer {i:02d}")
        Volunteer.objects.filter(user=made).update(total_flops=(1000 - i) * GFLOP)
        volunteers.append(made)
    me = volunteers[57]
    client.force_login(me)

    first = client.get("/leaderboard/").content.decode()
    assert 'id="your-rank"' in first and "#58" in first and "see page 2" in first
    assert 'class="is-me"' not in first and len(names(first)) == 50
    second = client.get("/leaderboard/?page=2").content.decode()
    assert 'id="your-rank"' not in second
    row = re.search(
        r'<tr class="is-me" aria-current="true" data-volunteer="(\d+)">\s*<td class="rank">(\d+)</td>', second
    )
    assert row and int(row.group(1)) == Volunteer.objects.get(user=me).pk and row.group(2) == "58"
    assert names(second)[7] == "Volunteer 57"


def test_a_visitor_sees_no_rank_and_creates_no_row(client: Client, volunteer_user: User, db: None) -> None:
    client.force_login(volunteer_user)
    html = client.get("/leaderboard/").content.decode()
    assert 'id="your-rank"' not in html and not Volunteer.objects.filter(user=volunteer_user).exists()
