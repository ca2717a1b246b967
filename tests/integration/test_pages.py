"""Public pages, the staff dashboard, the JSON API and the blob endpoint, through Django's test client."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.utils import timezone

from frontend.templatetags.crowdtrain import format_flops
from projects.models import Metric, Project, Result, WorkUnit
from workers.models import CreditEntry, Team, Volunteer
from workers.services import credit_grant


def data_flops(html: str, element_id: str) -> int:
    match = re.search(rf'id="{element_id}"[^>]*data-flops="(\d+)"', html)
    assert match, f"no #{element_id} with data-flops"
    return int(match.group(1))


def accepted_result(project: Project, user: User, count: int = 50) -> Result:
    version = project.current_version()
    shard = project.dataset.shards.get(split="train", index=0)
    work_unit = WorkUnit.objects.create(
        project=project, version=version, shard=shard, offset=0, count=count, status=WorkUnit.Status.VALIDATED
    )
    return Result.objects.create(
        work_unit=work_unit,
        volunteer=user,
        status=Result.Status.RECEIVED,
        validation=Result.Validation.VALID,
        samples=count,
        loss=1.0,
        deadline=timezone.now(),
    )


# --- sign-up, log in, log out ---------------------------------------------------------------------


def test_signup_creates_user_and_volunteer_and_logs_in(client: Client, db: None) -> None:
    response = client.post(
        "/accounts/signup/",
        {"username": "carol", "password1": "a-Long-pass-4821", "password2": "a-Long-pass-4821"},
    )

    assert response.status_code == 302 and response["Location"] == "/contribute/"
    user = User.objects.get(username="carol")
    assert Volunteer.objects.get(user=user).total_flops == 0
    assert not user.is_staff and user.check_password("a-Long-pass-4821")
    assert client.session["_auth_user_id"] == str(user.pk)


def test_signup_errors_are_shown_and_nothing_is_created(client: Client, db: None) -> None:
    response = client.post(
        "/accounts/signup/", {"username": "dave", "password1": "a-Long-pass-4821", "password2": "x"}
    )

    assert response.status_code == 200
    assert "same password each time" in response.content.decode()
    assert not User.objects.filter(username="dave").exists()
    assert Volunteer.objects.count() == 0


def test_signup_refuses_a_taken_username(client: Client, volunteer_user: User) -> None:
    response = client.post(
        "/accounts/signup/",
        {"username": "alice", "password1": "a-Long-pass-4821", "password2": "a-Long-pass-4821"},
    )
    assert response.status_code == 200
    assert "already exists" in response.content.decode()
    assert Volunteer.objects.count() == 0


def test_login_and_post_logout(client: Client, volunteer_user: User) -> None:
    assert client.get("/accounts/login/").status_code == 200
    response = client.post("/accounts/login/", {"login": "alice", "password": "alice-pass-123"})
    assert response.status_code == 302 and response["Location"] == "/contribute/"

    home = client.get("/").content.decode()
    assert 'id="nav-user" href="/account/">alice<' in home and 'action="/accounts/logout/"' in home
    client.get("/accounts/logout/")  # a GET only asks to confirm: logging out is a POST
    assert "_auth_user_id" in client.session
    response = client.post("/accounts/logout/")
    assert response.status_code == 302 and "_auth_user_id" not in client.session


def test_nav_for_anonymous_volunteer_and_staff(
    client: Client, volunteer_user: User, researcher: User
) -> None:
    anonymous = client.get("/").content.decode()
    assert (
        'href="/accounts/login/"' in anonymous
        and 'href="/accounts/signup/"' in anonymous
        and "/admin/" not in anonymous
    )

    client.force_login(volunteer_user)
    assert 'href="/admin/"' not in client.get("/").content.decode()
    client.force_login(researcher)
    assert 'href="/admin/"' in client.get("/").content.decode()


def test_contribute_requires_login(client: Client, db: None) -> None:
    response = client.get("/contribute/")
    assert response.status_code == 302 and response["Location"].startswith(
        "/accounts/login/?next=/contribute/"
    )


def test_contribute_page_ensures_a_volunteer_profile(client: Client, researcher: User) -> None:
    client.force_login(researcher)  # e.g. a staff account created without signing up
    response = client.get("/contribute/")
    assert response.status_code == 200
    assert response.context["volunteer"] == Volunteer.objects.get(user=researcher)


# --- home, leaderboard ----------------------------------------------------------------------------


def test_home_lists_running_projects_with_latest_accuracy(client: Client, mlp_project: Project) -> None:
    version = mlp_project.current_version()
    Metric.objects.create(project=mlp_project, version=version, name="test_accuracy", value=0.873)
    Project.objects.filter(pk=mlp_project.pk).update(status=Project.Status.RUNNING)

    html = client.get("/").content.decode()
    assert "MLP" in html and "87%" in html

    Project.objects.filter(pk=mlp_project.pk).update(status=Project.Status.PAUSED)
    assert f'data-project-id="{mlp_project.pk}"' not in client.get("/").content.decode()


def test_leaderboard_orders_volunteers_by_flops(client: Client, db: None) -> None:
    team = Team.objects.create(name="GPU Gang")
    rows = [("low", 5_000, 1, None), ("top", 4_500_000_000_000, 7, team), ("mid", 1_230_000_000, 3, None)]
    for name, flops, accepted, their_team in rows:
        user = User.objects.create_user(name, password="pw-not-used-123")
        Volunteer.objects.create(user=user, total_flops=flops, results_accepted=accepted, team=their_team)
    Volunteer.objects.create(user=User.objects.create_user("idle"))

    html = client.get("/leaderboard/").content.decode()
    table = html[html.index('id="leaderboard"') : html.index("</table>", html.index('id="leaderboard"'))]
    usernames = re.findall(
        r'<td class="username"><a href="/volunteers/\d+/certificate/">(\w+)</a></td>', table
    )
    assert usernames == ["top", "mid", "low"]
    assert [int(v) for v in re.findall(r'data-flops="(\d+)"', table)] == [
        4_500_000_000_000,
        1_230_000_000,
        5_000,
    ]
    assert "4.5 TFLOP" in table and "1.23 GFLOP" in table and "GPU Gang" in table
    assert "10.4" in table  # 4.5e12 FLOPs in credit (4.32e11 FLOPs each)


@pytest.mark.parametrize(
    ("flops", "text"),
    [(0, "0 FLOP"), (999, "999 FLOP"), (1234, "1.23 kFLOP"), (1.23e9, "1.23 GFLOP"), (4.5e12, "4.5 TFLOP")],
)
def test_flops_filter(flops: float, text: str) -> None:
    assert format_flops(flops) == text


# --- staff dashboard ------------------------------------------------------------------------------


def test_dashboard_is_staff_only(client: Client, volunteer_user: User) -> None:
    assert client.get("/admin/dashboard/")["Location"].startswith("/admin/login/")
    client.force_login(volunteer_user)
    assert client.get("/admin/dashboard/")["Location"].startswith("/admin/login/")


def test_dashboard_totals_equal_the_ledger(
    client: Client, researcher: User, mlp_project: Project, volunteer_user: User, other_volunteer: User
) -> None:
    credit_grant(
        user=volunteer_user, result=accepted_result(mlp_project, volunteer_user), flops=3_000_000_000
    )
    credit_grant(user=other_volunteer, result=accepted_result(mlp_project, other_volunteer), flops=7_654_321)
    credit_grant(user=volunteer_user, result=accepted_result(mlp_project, volunteer_user), flops=11)
    ledger = sum(CreditEntry.objects.values_list("flops", flat=True))

    client.force_login(researcher)
    html = client.get("/admin/dashboard/").content.decode()

    assert data_flops(html, "total-flops") == ledger == 3_007_654_332
    assert "3.01 GFLOP" in html and 'id="volunteer-count">2<' in html
    by_volunteer = html[html.index('id="flops-by-volunteer"') :]
    assert by_volunteer.index("alice") < by_volunteer.index("bob")
    assert f'data-flops="{ledger}"' in html[html.index('id="flops-by-project"') :]
    rate_json = re.search(r'id="rate-data"[^>]*>(.*?)</script>', html, re.S)
    assert rate_json is not None
    rate = json.loads(rate_json.group(1))
    assert len(rate["values"]) == 60 and sum(rate["values"]) * 60 == pytest.approx(ledger)


def test_admin_index_links_to_the_dashboard(client: Client, researcher: User) -> None:
    client.force_login(researcher)
    assert 'href="/admin/dashboard/"' in client.get("/admin/").content.decode()


# --- JSON API -------------------------------------------------------------------------------------


def test_api_lists_running_projects_with_metrics(client: Client, mlp_project: Project) -> None:
    version = mlp_project.current_version()
    Metric.objects.create(project=mlp_project, version=version, name="test_accuracy", value=0.5)
    Metric.objects.create(project=mlp_project, version=version, name="test_loss", value=1.5)

    page = client.get("/api/projects/").json()
    projects: list[dict[str, Any]] = page["results"]
    assert page["count"] == 1 and [p["name"] for p in projects] == ["MLP"]
    assert projects[0]["current_version"] == 0 and projects[0]["dataset"] == "digits"
    assert projects[0]["metrics"] == {"test_accuracy": 0.5, "test_loss": 1.5}

    series = client.get(f"/api/projects/{mlp_project.pk}/metrics/").json()
    assert [(m["version"], m["name"], m["value"]) for m in series["metrics"]] == [
        (0, "test_accuracy", 0.5),
        (0, "test_loss", 1.5),
    ]
    Project.objects.filter(pk=mlp_project.pk).update(status=Project.Status.DRAFT)
    assert client.get("/api/projects/").json()["results"] == []
    assert client.get(f"/api/projects/{mlp_project.pk}/metrics/").status_code == 404
