"""frontend/team_pages.py through Django's test client: the team list and board, a team's page, creating,
editing (founder only), joining, leaving, handing over and claiming."""

from __future__ import annotations

import re

import pytest
from django.contrib.auth.models import User
from django.test import Client

from projects.models import Project
from tests.workers.conftest import grant, user
from workers.models import Team, Volunteer
from workers.teams import team_create, team_join

GFLOP = 10**9


def test_anyone_sees_the_teams_and_a_team_page(
    client: Client, mlp_project: Project, volunteer_user: User
) -> None:
    team = team_create(
        user=volunteer_user,
        name="Open Gradients",
        description="Line one\nLine <two>",
        url="https://og.example/",
    )
    Volunteer.objects.filter(user=volunteer_user).update(display_name="Ada L.")
    grant(mlp_project, volunteer_user, 432 * GFLOP)  # one credit

    html = client.get("/teams/").content.decode()
    assert f'href="/teams/{team.pk}/"' in html and "Open Gradients" in html and "/teams/new/" not in html
    page = client.get(f"/teams/{team.pk}/").content.decode()
    assert f'id="team-total" data-flops="{432 * GFLOP}">1.00<' in page
    assert "Line <br>Line &lt;two&gt;" in page or "Line one<br>Line &lt;two&gt;" in page
    assert "Ada L." in page and "alice" not in page  # public names only
    assert 'id="team-members-count">1<' in page and "Log in to join" in page
    assert client.get("/teams/999999/").status_code == 404
    assert client.get("/teams/99999999999999999999999/").status_code == 404


def test_create_a_team_from_the_form(client: Client, volunteer_user: User) -> None:
    assert client.get("/teams/new/").status_code == 302  # log in first
    client.force_login(volunteer_user)
    response = client.post(
        "/teams/new/", {"name": "  Brand   New ", "description": "Hi", "url": "", "country": "NL"}
    )
    team = Team.objects.get()
    assert response.status_code == 302 and response["Location"] == f"/teams/{team.pk}/"
    assert (team.name, team.country, team.founder) == ("Brand New", "NL", volunteer_user)
    assert Volunteer.objects.get(user=volunteer_user).team == team


@pytest.mark.parametrize(
    "data",
    [
        {"name": "brand new"},  # taken, ignoring case
        {"name": "   "},
        {"name": "x" * 101},
        {"name": "Evil\u202eeman"},  # right-to-left override
        {"name": "Fine", "url": "javascript:alert(1)"},
        {"name": "Fine", "country": "XX"},
        {"name": "Fine", "description": "d" * 4001},
    ],
)
def test_bad_team_forms_are_refused(
    client: Client, volunteer_user: User, other_volunteer: User, data: dict[str, str]
) -> None:
    team_create(user=other_volunteer, name="Brand New")
    client.force_login(volunteer_user)
    response = client.post("/teams/new/", {"description": "", "url": "", "country": "", **data})
    assert response.status_code == 400 and Team.objects.count() == 1
    assert 'class="errorlist' in response.content.decode()


def test_join_leave_and_switch(client: Client, volunteer_user: User, other_volunteer: User) -> None:
    first = team_create(user=other_volunteer, name="First")
    second = team_create(user=user("carol"), name="Second")
    client.force_login(volunteer_user)
    assert client.get(f"/teams/{first.pk}/join/").status_code == 405  # a POST only
    assert client.post(f"/teams/{first.pk}/join/").status_code == 302
    assert Volunteer.objects.get(user=volunteer_user).team == first
    page = client.get(f"/teams/{first.pk}/").content.decode()
    assert 'id="leave-team"' in page and 'id="edit-team"' not in page
    client.post(f"/teams/{second.pk}/join/")
    assert Volunteer.objects.get(user=volunteer_user).team == second
    client.post(f"/teams/{first.pk}/leave/")  # not in it any more: nothing happens
    assert Volunteer.objects.get(user=volunteer_user).team == second
    client.post(f"/teams/{second.pk}/leave/")
    assert Volunteer.objects.get(user=volunteer_user).team is None
    assert client.post("/teams/424242/join/").status_code == 404


def test_only_the_founder_edits_and_hands_over(
    client: Client, volunteer_user: User, other_volunteer: User
) -> None:
    team = team_create(user=volunteer_user, name="Founded")
    team_join(user=other_volunteer, team_id=team.pk)
    client.force_login(other_volunteer)
    assert client.get(f"/teams/{team.pk}/edit/").status_code == 403
    assert client.post(f"/teams/{team.pk}/edit/", {"name": "Taken over"}).status_code == 403
    assert client.post(f"/teams/{team.pk}/founder/", {"founder": other_volunteer.pk}).status_code == 403
    assert Team.objects.get().founder == volunteer_user

    client.force_login(volunteer_user)
    page = client.get(f"/teams/{team.pk}/").content.decode()
    assert 'id="edit-team"' in page and re.search(rf'<option value="{other_volunteer.pk}">bob</option>', page)
    response = client.post(
        f"/teams/{team.pk}/edit/",
        {"name": "Renamed", "description": "New", "url": "https://r.example/", "country": ""},
    )
    assert response.status_code == 302 and Team.objects.get().name == "Renamed"
    client.post(f"/teams/{team.pk}/founder/", {"founder": user("stranger").pk})  # not a member: refused
    assert Team.objects.get().founder == volunteer_user
    client.post(f"/teams/{team.pk}/founder/", {"founder": other_volunteer.pk})
    assert Team.objects.get().founder == other_volunteer
    assert client.get(f"/teams/{team.pk}/edit/").status_code == 403


def test_a_member_claims_a_founderless_team(
    client: Client, volunteer_user: User, other_volunteer: User
) -> None:
    team = team_create(user=other_volunteer, name="Orphan")
    team_join(user=volunteer_user, team_id=team.pk)
    other_volunteer.delete()
    client.force_login(volunteer_user)
    assert 'id="claim-team"' in client.get(f"/teams/{team.pk}/").content.decode()
    assert client.post(f"/teams/{team.pk}/claim/").status_code == 302
    assert Team.objects.get().founder == volunteer_user
    assert client.post(f"/teams/{team.pk}/claim/").status_code == 403  # it has a founder now


def test_the_team_board_highlights_your_team_off_the_current_page(
    client: Client, volunteer_user: User, db: None
) -> None:
    for i in range(55):
        Team.objects.create(name=f"Team {i:02d}", total_flops=(100 - i) * GFLOP)
    mine = team_create(user=volunteer_user, name="Mine, ranked last")
    client.force_login(volunteer_user)
    html = client.get("/teams/").content.decode()
    assert 'id="your-team"' in html and "#56" in html and "?page=2" in html
    assert 'class="is-me"' not in html
    html = client.get("/teams/?page=2").content.decode()
    assert re.search(rf'<tr class="is-me" aria-current="true" data-team="{mine.pk}">', html)
