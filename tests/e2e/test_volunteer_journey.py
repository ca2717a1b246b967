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
    # The demo sends new versions as int8 deltas: this browser built some from the version it held.
    assert page.evaluate("() => self.crowdtrainContribute.state().weightsByDelta") >= 1
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


# --- issue 13's journey: accounts, preferences, teams, boards, data, reset, deletion ---------------------

PASSWORD, NEW_PASSWORD = "Tr41n-the-w0rld!", "An0ther-l0ng-one!"
HIDE = """(hidden) => {
  Object.defineProperty(document, "hidden", {value: hidden, configurable: true});
  const state = hidden ? "hidden" : "visible";
  Object.defineProperty(document, "visibilityState", {value: state, configurable: true});
  document.dispatchEvent(new Event("visibilitychange"));
}"""
UNITS_DONE = "() => self.crowdtrainContribute.steps().length"
PAUSE = "() => self.crowdtrainContribute.state().pause"


def mailed_link(stack: Stack, path: str, seen: int = 0) -> str:
    """The newest link to `path` in the mails daphne printed (the console backend, as locally)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        links = re.findall(rf"http://127\.0\.0\.1:\d+{re.escape(path)}\S+/", stack.log("web"))
        if len(links) > seen:
            return links[-1]
        time.sleep(0.5)
    raise AssertionError(f"no mail with a link to {path}; web log:\n{stack.log('web')[-2000:]}")


def log_in(page, stack: Stack, username: str, password: str) -> None:
    page.goto(stack.url + "/accounts/login/")
    page.fill("input[name=login]", username)
    page.fill("input[name=password]", password)
    page.click("main form button[type=submit]")
    page.wait_for_load_state()
    assert page.locator("#nav-user").count() == 1, f"{username} is not logged in"


def log_out(page) -> None:
    page.click("form[action$='/accounts/logout/'] button")
    page.wait_for_load_state()


def query(stack: Stack, sql: str, *args: object) -> list[tuple]:
    with psycopg.connect(stack.database_url) as conn:
        return list(conn.execute(sql, args).fetchall())


def ledger(stack: Stack) -> tuple[int, dict[int, int], int]:
    """The ledger's sum, its sum per project, and the sum of the volunteers' running totals."""
    total = ledger_total(stack)
    per_project = dict(
        query(stack, "SELECT project_id, sum(flops)::bigint FROM workers_creditentry GROUP BY 1")
    )
    totals = query(stack, "SELECT coalesce(sum(total_flops), 0)::bigint FROM workers_volunteer")[0][0]
    return total, per_project, int(totals)


def found_team(browser, stack: Stack) -> str:
    """Another volunteer founds a team for ours to join."""
    page = browser.new_page()
    sign_up(page, stack, "teamfounder")
    page.goto(stack.url + "/teams/new/")
    page.fill("#team-form input[name=name]", "Journey Team")
    page.click("#team-form button[type=submit]")
    page.wait_for_selector("#team-name")
    url = page.url
    page.close()
    return url


def train_then_hide_and_show(page) -> None:
    page.click("#contribute")
    page.wait_for_function(f"({UNITS_DONE})() >= 2", timeout=180_000)
    page.evaluate(HIDE, True)
    at_hide = page.evaluate(UNITS_DONE)
    page.wait_for_function(f"({PAUSE})() === 'hidden'", timeout=10_000)
    page.wait_for_timeout(8000)
    assert page.evaluate(UNITS_DONE) <= at_hide + 1, "training went on in a hidden tab"
    assert "Paused" in page.title(), page.title()
    page.evaluate(HIDE, False)
    page.wait_for_function(f"({UNITS_DONE})() >= {at_hide + 3}", timeout=180_000)
    page.click("#stop")


def test_a_volunteers_account_from_sign_up_to_deletion(stack: Stack, browser) -> None:
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.goto(stack.url + "/accounts/signup/")
    page.fill("input[name=username]", "journey")
    page.fill("input[name=email]", "journey@example.org")
    page.fill("input[name=password1]", PASSWORD)
    page.fill("input[name=password2]", PASSWORD)
    page.click("main form button[type=submit]")
    page.goto(mailed_link(stack, "/accounts/confirm-email/"))
    page.click("main form button[type=submit]")
    assert query(stack, "SELECT verified FROM account_emailaddress WHERE email = 'journey@example.org'") == [
        (True,)
    ]
    log_out(page)
    log_in(page, stack, "journey", PASSWORD)

    page.goto(stack.url + "/account/preferences/")
    page.fill("#preferences-form input[name=duty_cycle]", "50")
    page.check("#preferences-form input[name=pause_when_hidden]")
    page.click("#preferences-form button[type=submit]")
    page.wait_for_load_state()
    assert query(
        stack,
        "SELECT p.duty_cycle, p.pause_when_hidden FROM workers_computingpreferences p "
        "JOIN workers_volunteer v ON v.id = p.volunteer_id JOIN auth_user u ON u.id = v.user_id "
        "WHERE u.username = 'journey' AND p.device_id IS NULL",
    ) == [(50, True)]

    page.goto(found_team(browser, stack))
    page.click("#join-team")
    page.wait_for_selector("#leave-team")

    page.goto(stack.url + "/contribute/")
    train_then_hide_and_show(page)
    wait_until_settled(stack, "journey")

    project = query(
        stack,
        "SELECT c.project_id FROM workers_creditentry c JOIN workers_volunteer v ON v.id = c.volunteer_id "
        "JOIN auth_user u ON u.id = v.user_id WHERE u.username = 'journey' LIMIT 1",
    )[0][0]
    page.goto(f"{stack.url}/leaderboard/?project={project}")
    assert "journey" in (page.text_content("#leaderboard tr.is-me, #your-rank") or "")
    page.goto(f"{stack.url}/teams/?project={project}")
    assert "Journey Team" in (page.text_content("tr.is-me") or "")

    data = page.request.get(stack.url + "/account/export/").json()
    mine = sum(entry["flops"] for entry in data["credit_entries"])
    assert (
        mine
        == query(
            stack,
            "SELECT sum(c.flops)::bigint FROM workers_creditentry c "
            "JOIN workers_volunteer v ON v.id = c.volunteer_id "
            "JOIN auth_user u ON u.id = v.user_id WHERE u.username = 'journey'",
        )[0][0]
        > 0
    )

    log_out(page)
    page.goto(stack.url + "/accounts/password/reset/")
    page.fill("input[name=email]", "journey@example.org")
    page.click("main form button[type=submit]")
    page.goto(mailed_link(stack, "/accounts/password/reset/key/"))
    page.fill("input[name=password1]", NEW_PASSWORD)
    page.fill("input[name=password2]", NEW_PASSWORD)
    page.click("main form button[type=submit]")
    log_in(page, stack, "journey", NEW_PASSWORD)

    before = ledger(stack)
    page.goto(stack.url + "/account/delete/")
    page.fill("#delete-form input[name=password]", NEW_PASSWORD)
    page.click("#delete-form button[type=submit]")
    page.wait_for_load_state()
    assert query(stack, "SELECT count(*) FROM auth_user WHERE username = 'journey'") == [(0,)]
    after = ledger(stack)
    assert after == before and after[0] == after[2], (before, after)
    page.close()
