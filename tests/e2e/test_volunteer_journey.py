"""A new volunteer trains the demo project in headless Chromium against the real, separately running stack."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import psycopg
import pytest

from devstack.stack import ROOT, Stack

pytestmark = [pytest.mark.e2e, pytest.mark.browser, pytest.mark.slow]
SHOTS = ROOT / "test-artifacts" / "screenshots"
TARGET_ACCURACY = 0.8


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with Stack(var_dir=tmp_path_factory.mktemp("e2e-stack")) as running:
        yield running


def best_accuracy(stack: Stack) -> float:
    with psycopg.connect(stack.database_url) as conn:
        row = conn.execute("SELECT max(value) FROM projects_metric WHERE name = 'test_accuracy'").fetchone()
    return float(row[0]) if row and row[0] is not None else 0.0


def ledger_total(stack: Stack) -> int:
    with psycopg.connect(stack.database_url) as conn:
        row = conn.execute("SELECT coalesce(sum(flops), 0) FROM workers_creditentry").fetchone()
    return int(row[0]) if row else 0


def sign_up(page, stack: Stack, username: str) -> None:
    page.goto(stack.url + "/accounts/signup/")
    page.fill("input[name=username]", username)
    page.fill("input[name=password1]", "Tr41n-the-w0rld!")
    page.fill("input[name=password2]", "Tr41n-the-w0rld!")
    page.click("form button[type=submit]")
    page.wait_for_load_state()


def wait_for_accuracy(page, stack: Stack, minutes: float) -> float:
    deadline = time.monotonic() + minutes * 60
    accuracy = 0.0
    while time.monotonic() < deadline and accuracy <= TARGET_ACCURACY:
        page.wait_for_timeout(3000)
        accuracy = best_accuracy(stack)
    return accuracy


def unsettled(stack: Stack, username: str) -> int:
    with psycopg.connect(stack.database_url) as conn:
        row = conn.execute(
            "SELECT count(*) FROM projects_result r JOIN auth_user u ON u.id = r.volunteer_id "
            "WHERE u.username = %s AND (r.status = 'in_progress' OR "
            "(r.status = 'received' AND r.validation = 'pending'))",
            (username,),
        ).fetchone()
    return int(row[0]) if row else 0


def wait_until_settled(stack: Stack, username: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while unsettled(stack, username):
        assert time.monotonic() < deadline, f"{username}'s results never settled"
        time.sleep(0.2)


def test_new_volunteer_trains_the_demo_to_80_percent(stack: Stack, browser) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    sign_up(page, stack, "newvolunteer")
    page.goto(stack.url + "/contribute/")
    page.click("#contribute")
    page.wait_for_function("document.querySelector('#backend').textContent.trim().length > 0", timeout=60000)
    accuracy = wait_for_accuracy(page, stack, minutes=8)
    page.screenshot(path=str(SHOTS / "contribute.png"), full_page=True)
    assert accuracy > TARGET_ACCURACY, (
        f"test accuracy only {accuracy:.3f}; worker log:\n{stack.log('worker')[-3000:]}"
    )
    backend = page.text_content("#backend") or ""
    assert re.search(r"webgl", backend, re.IGNORECASE), backend
    assert int(page.get_attribute("#credit", "data-flops") or 0) > 0
    page.click("#stop")
    # A result already in flight may still be credited: compare the pages with the ledger once nothing of
    # this volunteer's is in flight or waiting for its verdict.
    wait_until_settled(stack, "newvolunteer")

    total = ledger_total(stack)
    page.goto(stack.url + "/leaderboard/")
    row = page.locator("#leaderboard tr", has_text="newvolunteer")
    assert int(row.locator("[data-flops]").first.get_attribute("data-flops") or 0) == total > 0
    page.screenshot(path=str(SHOTS / "leaderboard.png"), full_page=True)

    page.goto(stack.url + "/admin/login/?next=/admin/dashboard/")
    page.fill("input[name=username]", "admin")
    page.fill("input[name=password]", "admin-e2e-password")
    page.click("input[type=submit]")
    page.wait_for_selector("#total-flops")
    assert int(page.get_attribute("#total-flops", "data-flops") or 0) == total
    page.screenshot(path=str(SHOTS / "admin-dashboard.png"), full_page=True)
    page.close()
