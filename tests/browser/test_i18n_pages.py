"""The volunteer's pages in French in Chromium (a browser whose language is French, no switcher used): every
page says lang="fr", its scripts run without errors, and the longer French texts break no layout: nothing is
wider than the window, on a desktop or a phone, and no button, tab or header is narrower than its words.
Screenshots go to test-artifacts/screenshots/ (docs/screenshots holds copies: home-fr.png, account-fr.png)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.accounts.conftest import PASSWORD, History, fresh_limits, history  # noqa: F401
from workers.models import Volunteer

pytestmark = [pytest.mark.browser, pytest.mark.slow]
SHOTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "screenshots"
OVERFLOW = "() => document.documentElement.scrollWidth - document.documentElement.clientWidth"
# Elements narrower than their own text: a word that does not fit its button, tab or table header.
CLIPPED = """() => [...document.querySelectorAll('.button, .tabs a, th, dt, .nav-links a, label')]
  .filter((e) => e.offsetParent !== null && e.scrollWidth > e.clientWidth + 1)
  .map((e) => e.textContent.trim())"""


@pytest.fixture(autouse=True, scope="module")
def orm_beside_playwright() -> Iterator[None]:
    """As in test_project_page.py: Playwright's sync API leaves its loop marked running in this thread."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
        yield


def pages(story: History) -> list[str]:
    first, _ = story.projects
    volunteer = Volunteer.objects.get(user=story.user)
    return [
        "/",
        "/account/",
        "/leaderboard/",
        "/teams/",
        f"/teams/{story.team.pk}/",
        f"/volunteers/{volunteer.pk}/certificate/",
        f"/projects/{first.pk}/",
    ]


def look(page: Any, url: str) -> None:
    page.goto(url)
    page.wait_for_load_state("networkidle")
    assert page.get_attribute("html", "lang") == "fr", url
    assert page.evaluate(OVERFLOW) == 0, url
    assert page.evaluate(CLIPPED) == [], url


@pytest.mark.parametrize(
    ("size", "options"),
    [
        ("desktop", {"viewport": {"width": 1280, "height": 800}}),
        ("phone", {"viewport": {"width": 390, "height": 844}, "is_mobile": True, "has_touch": True}),
    ],
)
def test_the_pages_in_french_fit_and_run(
    live_server: Any,
    history: History,  # noqa: F811
    own_browser: Any,
    size: str,
    options: dict[str, Any],
) -> None:
    context = own_browser.new_context(locale="fr-FR", **options)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    SHOTS.mkdir(parents=True, exist_ok=True)

    look(page, f"{live_server.url}/")
    assert (
        page.text_content("h1")
        == "Entraînons des réseaux de neurones ensemble, directement dans votre navigateur."
    )
    if size == "desktop":
        page.screenshot(path=str(SHOTS / "home-fr.png"))
    page.goto(f"{live_server.url}/accounts/login/?next=/account/")
    assert page.text_content("h1") == "Se connecter"
    page.fill("input[name=login]", "alice")
    page.fill("input[name=password]", PASSWORD)
    page.click("form.stacked-form button[type=submit]")
    page.wait_for_url(f"{live_server.url}/account/")
    for path in pages(history):
        look(page, f"{live_server.url}{path}")
    look(page, f"{live_server.url}/account/")
    assert page.text_content("#devices h2") == "Appareils"
    if size == "desktop":
        page.screenshot(path=str(SHOTS / "account-fr.png"))
    assert errors == []
    context.close()
