"""Teams, leaderboards and the certificate in Chromium: your row highlighted, your rank shown from another
page, joining a team with its button, the certificate as it prints; on a desktop and a phone screen.
Screenshots go to test-artifacts/screenshots (docs/screenshots holds copies)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.utils import timezone

from projects.models import Project
from tests.workers.conftest import grant, user
from workers.models import Team, Volunteer
from workers.teams import team_create, team_join

pytestmark = [pytest.mark.browser, pytest.mark.slow]
SHOTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "screenshots"
DESKTOP = {"width": 1280, "height": 800}
PHONE = {"width": 390, "height": 844}
GFLOP = 10**9
NAMES = [
    "Ada L.", "Grace H.", "Alan T.", "Katherine J.", "Edsger D.", "Barbara L.", "Donald K.", "Frances A.",
    "John M.", "Radia P.", "Ken T.", "Margaret H.", "Dennis R.", "Hedy L.", "Tim B.", "Sophie W.",
]  # fmt: skip
TEAMS = [
    ("Gradient Descenders", "FR", "Volunteers from Lyon and beyond. Our lab's old GPUs train at night."),
    ("Backprop Brigade", "DE", "Every GPU counts."),
    ("Tensor Tamers", "US", ""),
    ("Lab 42", "JP", "A university lab that trains between experiments."),
    ("Night Owls", "", "We leave our tabs open overnight."),
]  # fmt: skip


@pytest.fixture(autouse=True, scope="module")
def orm_beside_playwright() -> Iterator[None]:
    """As tests/browser/test_project_page.py: nothing here is async, Playwright only waits on its browser."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
        yield


def at(moment: datetime, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(timezone, "now", lambda: moment)


@pytest.fixture
def community(mlp_project: Project, second_project: Project, monkeypatch: pytest.MonkeyPatch) -> User:
    """64 volunteers with real credit over eight weeks in two projects, five teams; returns "Maria S.", who
    computed a lot three months ago (4th all-time) and nothing lately (far down the recent board)."""
    rng = random.Random(13)
    now = timezone.now()
    maria = user("maria", display_name="Maria S.", country="ES")
    founders = [user(f"founder{i}", display_name=f"{NAMES[i]}") for i in range(len(TEAMS))]
    teams = [
        team_create(user=f, name=name, description=text, country=country)
        for f, (name, country, text) in zip(founders, TEAMS, strict=True)
    ]
    people = founders + [
        user(f"volunteer{i}", display_name=f"{NAMES[i % len(NAMES)]} {i}") for i in range(58)
    ]
    for person in people[len(TEAMS) :]:
        if rng.random() < 0.7:
            team_join(user=person, team_id=rng.choice(teams).pk)
    team_join(user=maria, team_id=teams[0].pk)
    for person in people:
        for _ in range(rng.randint(1, 3)):
            at(now - timedelta(days=rng.uniform(0, 56)), monkeypatch)
            project = mlp_project if rng.random() < 0.6 else second_project
            grant(project, person, int(rng.lognormvariate(3.5, 1.0) * 432 * GFLOP))
    # Between the 3rd and the 4th of the others, all of it 90 days ago.
    totals = sorted(Volunteer.objects.exclude(user=maria).values_list("total_flops", flat=True), reverse=True)
    share = (totals[2] + totals[3]) // 2 // 3
    at(now - timedelta(days=90), monkeypatch)
    for project in (mlp_project, mlp_project, second_project):
        grant(project, maria, share)
    monkeypatch.undo()
    Volunteer.objects.update(created_at=now - timedelta(days=120))
    Volunteer.objects.filter(team__isnull=False).update(team_joined_at=now - timedelta(days=100))
    Team.objects.update(created_at=now - timedelta(days=110))
    return maria


def logged_in(browser: Any, who: User, live_server: Any, viewport: dict[str, int]) -> Any:
    client = Client()
    client.force_login(who)
    context = browser.new_context(viewport=viewport)
    cookie = client.cookies["sessionid"].value
    context.add_cookies([{"name": "sessionid", "value": cookie, "url": live_server.url}])
    return context


def shot(page: Any, name: str, *, full_page: bool = False) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / name), full_page=full_page)


def test_leaderboards_show_your_rank_on_desktop_and_phone(
    live_server: Any, community: User, own_browser: Any
) -> None:
    me = Volunteer.objects.get(user=community)
    context = logged_in(own_browser, community, live_server, DESKTOP)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))

    page.goto(f"{live_server.url}/leaderboard/")
    mine = page.locator("#leaderboard tr.is-me")
    assert mine.count() == 1 and mine.get_attribute("data-volunteer") == str(me.pk)
    assert mine.locator("td.rank").text_content() == "4"
    plain = page.locator("#leaderboard tbody tr:not(.is-me)").first
    colour = "(el) => getComputedStyle(el).backgroundColor"
    assert mine.evaluate(colour) != plain.evaluate(colour)
    shot(page, "leaderboard.png")

    page.select_option("#board-project", label="Second MLP")  # submits the filter form
    page.wait_for_url("**/leaderboard/?project=*")
    assert page.locator("#leaderboard tbody tr").count() > 0

    phone = context.new_page()
    phone.set_viewport_size(PHONE)
    phone.goto(f"{live_server.url}/leaderboard/?order=recent")
    banner = phone.locator("#your-rank")
    assert banner.is_visible() and phone.locator("#leaderboard tr.is-me").count() == 0
    shot(phone, "leaderboard-phone.png")
    banner.locator("a").click()
    phone.wait_for_url("**page=2*")
    assert phone.locator("#leaderboard tr.is-me").count() == 1
    width = phone.evaluate("document.documentElement.scrollWidth")
    assert width <= PHONE["width"], f"the page scrolls sideways on a phone ({width}px)"
    assert errors == []
    context.close()


def test_a_team_page_and_joining_with_its_button(live_server: Any, community: User, own_browser: Any) -> None:
    team = Team.objects.get(name="Gradient Descenders")
    founder = team.founder
    assert founder is not None
    context = logged_in(own_browser, founder, live_server, DESKTOP)
    page = context.new_page()
    page.goto(f"{live_server.url}/teams/{team.pk}/")
    assert page.is_visible("#edit-team") and page.text_content("#team-name") == "Gradient Descenders"
    total = int(page.get_attribute("#team-total", "data-flops") or 0)
    team.refresh_from_db()
    assert total == team.total_flops > 0
    shot(page, "team.png")
    page.goto(f"{live_server.url}/teams/")
    assert page.locator("#team-board tr.is-me").count() == 1
    shot(page, "teams.png")
    context.close()

    newcomer = user("newcomer", display_name="New Volunteer")
    context = logged_in(own_browser, newcomer, live_server, PHONE)
    phone = context.new_page()
    phone.goto(f"{live_server.url}/teams/{team.pk}/")
    members = phone.text_content("#team-members-count")
    phone.click("#join-team")
    phone.wait_for_selector("#leave-team")
    assert int(phone.text_content("#team-members-count") or 0) == int(members or 0) + 1
    assert Volunteer.objects.get(user=newcomer).team_id == team.pk
    width = phone.evaluate("document.documentElement.scrollWidth")
    assert width <= PHONE["width"], f"the page scrolls sideways on a phone ({width}px)"
    phone.evaluate("window.scrollTo(0, 0)")
    shot(phone, "team-phone.png")
    context.close()


def test_the_certificate_prints_without_the_site_around_it(
    live_server: Any, community: User, own_browser: Any
) -> None:
    me = Volunteer.objects.get(user=community)
    context = own_browser.new_context(viewport=DESKTOP)
    page = context.new_page()
    page.goto(f"{live_server.url}/volunteers/{me.pk}/certificate/")
    assert page.text_content("#certificate-name") == "Maria S."
    assert page.is_visible(".site-header") and page.is_visible("#print-certificate")
    shot(page, "certificate.png", full_page=True)
    page.emulate_media(media="print")
    assert not page.is_visible(".site-header") and not page.is_visible("#print-certificate")
    assert not page.is_visible(".site-footer") and page.is_visible("#certificate-projects")
    shot(page, "certificate-print.png")
    pdf = page.pdf(format="A4", landscape=True, prefer_css_page_size=True)
    pages = pdf.count(b"/Type /Page") - pdf.count(b"/Type /Pages")
    assert pages == 1, f"the certificate prints on {pages} pages"
    context.close()
