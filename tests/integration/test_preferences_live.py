"""Computing preferences end to end: a volunteer in Chromium (WebGL) sets them on /account/preferences/,
and the real server (daphne on PostgreSQL and Redis, Celery tasks run in place) honours them while the
Contribute page trains: an opted-out project gets none of their work, and a daily download set while
training stops the work once spent. Screenshots of both pages go to test-artifacts/screenshots/."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from devstack.stack import ROOT, Stack

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.timeout(900)]
# Overridable so that several engineers can run the suite side by side on one PostgreSQL / Redis.
DATABASE = os.environ.get("PREFS_STACK_DATABASE", "crowdtrain_prefs")
REDIS_DB = int(os.environ.get("PREFS_STACK_REDIS_DB", "12"))
SHOTS = ROOT / "test-artifacts" / "screenshots"
MB = 2**20
USERNAME, PASSWORD = "prefs-volunteer", "Pr3fs-volunteer!"
SETUP = f"""
from django.contrib.auth.models import User
from projects.datasets import dataset_create_from_npz
from projects.services import project_create, project_start
from tests.conftest import mnist_arrays, npz_bytes
owner = User.objects.get(username="admin")
x, y = mnist_arrays(per_class=150)
dataset = dataset_create_from_npz(
    owner=owner, name="digits", data=npz_bytes(x=x[:1400], y=y[:1400], x_test=x[1400:], y_test=y[1400:])
)
for name in ("Digits A", "Digits B"):
    settings = {{"batch_size": 32, "round_samples": 64, "learning_rate": 0.1}}
    project = project_create(owner=owner, name=name, dataset=dataset, preset="mlp", settings=settings)
    project_start(project=project)
User.objects.create_user({USERNAME!r}, password={PASSWORD!r})
"""


class PreferencesStack(Stack):
    """daphne alone with Celery's tasks run in place: enough for assigning and validating one volunteer's
    work, at a fraction of the whole stack's processes."""

    def start(self) -> None:
        self.fresh_database()
        self.manage_all(("ensure_admin",), ("shell", "--verbosity", "0", "--command", SETUP))
        self.spawn_processes()

    def spawn_processes(self) -> None:
        self._spawn("web", "-m", "daphne", "-b", "127.0.0.1", "-p", str(self.port), "config.asgi:application")
        self._wait_for_http(self.startup_timeout)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with PreferencesStack(
        var_dir=tmp_path_factory.mktemp("prefs-stack"),
        database=DATABASE,
        redis_db=REDIS_DB,
        extra_env={"CELERY_TASK_ALWAYS_EAGER": "1"},
        startup_timeout=300,
    ) as running:
        yield running


def query(stack: Stack, sql: str, *params: Any) -> Any:
    with psycopg.connect(stack.database_url) as conn:
        row = conn.execute(sql, params).fetchone()
    return row[0] if row else None


def results_by_project(stack: Stack) -> dict[str, int]:
    with psycopg.connect(stack.database_url) as conn:
        rows = conn.execute(
            "SELECT p.name, count(*) FROM projects_result r JOIN auth_user u ON u.id = r.volunteer_id "
            "JOIN projects_workunit w ON w.id = r.work_unit_id "
            "JOIN projects_project p ON p.id = w.project_id WHERE u.username = %s GROUP BY p.name",
            (USERNAME,),
        ).fetchall()
    return dict(rows)


def downloaded_today(stack: Stack) -> int:
    return int(query(stack, "SELECT coalesce(sum(bytes), 0) FROM workers_devicedownload") or 0)


def wait_until(condition: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def log_in(page: Any, stack: Stack) -> None:
    page.goto(stack.url + "/accounts/login/")
    page.fill("input[name=login]", USERNAME)
    page.fill("input[name=password]", PASSWORD)
    page.click("form button[type=submit]")
    page.wait_for_load_state()


def save_preferences(page: Any, stack: Stack, fill: dict[str, str], tick: list[str]) -> None:
    page.goto(stack.url + "/account/preferences/")
    for name, value in fill.items():
        page.fill(f"input[name={name}]", value)
    for selector in tick:
        page.check(selector)
    with page.expect_navigation():
        page.click("#save-preferences")
    assert page.locator(".message-success").count() == 1, page.locator(".errorlist").all_text_contents()


def test_the_server_honours_an_opt_out_and_the_daily_download_set_while_training(
    stack: Stack, browser: Any
) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    settings_page = context.new_page()
    log_in(settings_page, stack)
    opted_out = query(stack, "SELECT id FROM projects_project WHERE name = 'Digits A'")
    save_preferences(
        settings_page,
        stack,
        {"duty_cycle": "100"},
        ["input[name=projects][value=except]", f"input[name=chosen_projects][value='{opted_out}']"],
    )

    page = context.new_page()
    page.goto(stack.url + "/contribute/")
    page.click("#contribute")
    wait_until(lambda: sum(results_by_project(stack).values()) >= 6, 300, "six work units")
    assert set(results_by_project(stack)) == {"Digits B"}  # Digits A had work all along, and got none
    page.wait_for_function("() => document.title === '▶ Training Digits B — Crowdtrain'", timeout=60_000)
    assert page.text_content("#project-why") == "the only project with work for you"
    assert "not the projects you left out" in (page.text_content("#preferences-summary") or "")
    page.screenshot(path=str(SHOTS / "contribute.png"))
    page.set_viewport_size({"width": 390, "height": 844})
    page.screenshot(path=str(SHOTS / "contribute-phone.png"))
    page.set_viewport_size({"width": 1280, "height": 800})

    # A day's download of what was spent so far and one more megabyte, set while the page trains.
    allowance = math.ceil(downloaded_today(stack) / MB) + 1
    save_preferences(settings_page, stack, {"max_download_mb_per_day": str(allowance)}, [])
    settings_page.screenshot(path=str(SHOTS / "preferences.png"), full_page=True)
    settings_page.set_viewport_size({"width": 390, "height": 844})
    settings_page.screenshot(path=str(SHOTS / "preferences-phone.png"), full_page=True)
    page.wait_for_function(
        "() => document.getElementById('pause-reason').dataset.reason === 'download_limit'", timeout=300_000
    )
    assert downloaded_today(stack) <= allowance * MB
    assert page.title() == "⏸ Paused (download limit) — Crowdtrain"
    page.screenshot(path=str(SHOTS / "contribute-paused.png"))
    assert "preferences updated" in (page.text_content("#log") or "")  # live, without a reload
    sent = sum(results_by_project(stack).values())
    time.sleep(5)
    assert sum(results_by_project(stack).values()) == sent  # nothing more is sent today
    page.click("#stop")
    context.close()
