"""/account/ in Chromium: a volunteer logs in, renames a device, forgets another, downloads their data; the
page fits a phone's width. Screenshots (desktop 1280x800, phone 390x844) go to test-artifacts/screenshots/."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.accounts.conftest import PASSWORD, History, fresh_limits, history  # noqa: F401
from workers.models import Device
from workers.services import volunteer_ensure

pytestmark = [pytest.mark.browser, pytest.mark.slow]
SHOTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "screenshots"
OVERFLOW = "() => document.documentElement.scrollWidth - document.documentElement.clientWidth"


@pytest.fixture(autouse=True, scope="module")
def orm_beside_playwright() -> Iterator[None]:
    """As in test_project_page.py: Playwright's sync API leaves its loop marked running in this thread."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
        yield


def log_in(context: Any, url: str) -> Any:
    page = context.new_page()
    page.goto(f"{url}/accounts/login/?next=/account/")
    page.fill("input[name=login]", "alice")
    page.fill("input[name=password]", PASSWORD)
    page.click("form.stacked-form button[type=submit]")
    page.wait_for_url(f"{url}/account/")
    return page


def test_a_volunteer_manages_the_account_in_a_browser(
    live_server: Any,
    history: History,  # noqa: F811
    own_browser: Any,
) -> None:
    volunteer = volunteer_ensure(user=history.user)
    volunteer.display_name, volunteer.country, volunteer.url = "Alice L.", "NZ", "https://alice.example.org/"
    volunteer.save()
    Device.objects.filter(pk=history.laptop.pk).update(name="Work laptop")
    SHOTS.mkdir(parents=True, exist_ok=True)

    context = own_browser.new_context(viewport={"width": 1280, "height": 800}, accept_downloads=True)
    page = log_in(context, live_server.url)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))

    phone_row = f"tr[data-device='{history.phone.pk}']"
    page.fill(f"{phone_row} input[name=name]", "Pixel in the kitchen")
    page.click(f"{phone_row} .rename-form button")
    page.wait_for_selector("text=Device renamed.")
    assert Device.objects.get(pk=history.phone.pk).name == "Pixel in the kitchen"

    with page.expect_download() as download:
        page.click("#export-link")
    data = json.loads(Path(download.value.path()).read_text())
    assert data["account"]["username"] == "alice" and len(data["results"]) == 4
    page.screenshot(path=str(SHOTS / "account.png"), full_page=True)

    page.click(f"{phone_row} details.forget summary")
    page.click(f"{phone_row} .forget-form button")
    page.wait_for_selector("text=Device forgotten.")
    assert page.locator("tr[data-device]").count() == 1
    assert page.evaluate(OVERFLOW) == 0 and errors == []
    context.close()

    phone = own_browser.new_context(
        viewport={"width": 390, "height": 844}, device_scale_factor=2, is_mobile=True, has_touch=True
    )
    page = log_in(phone, live_server.url)
    page.screenshot(path=str(SHOTS / "account-phone.png"), full_page=True)
    assert page.evaluate(OVERFLOW) == 0  # wide tables scroll inside their cards, never the page
    assert page.is_visible("#profile-form") and page.is_visible("#delete-link")
    phone.close()
