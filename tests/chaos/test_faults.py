"""Chaos on the real stack (daphne + Celery worker + beat, PostgreSQL, a private Redis), MNIST MLP demo,
honest simulated volunteers at full speed. Each test: train a little, inject one fault, require training
to go on for a few more versions, stop the volunteers, let the transitioner settle, check the books.

One stack serves all the tests (starting one costs more than a test): every test only asks for progress
beyond the version it found, and the invariants hold over the whole history anyway.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest

from tests.chaos.harness import (
    Crowd,
    crowd_of,
    latest_version,
    scalar,
    settle,
    storage_reclaimed,
    violations,
    wait_for_storage_sweep,
    wait_for_validation_backlog,
    wait_for_version,
    wait_until_holding,
)
from tests.chaos.stack import ChaosStack

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # the first includes starting the stack

BEFORE, AFTER = 1, 2  # versions of progress required before the fault, and after it
# A liveness bound, not a speed target: generous, so that a loaded machine is not mistaken for a stall.
PROGRESS_TIMEOUT = 150.0


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChaosStack]:
    with ChaosStack(var_dir=tmp_path_factory.mktemp("chaos-stack")) as running:
        yield running


@pytest.fixture
def healthy(stack: ChaosStack) -> ChaosStack:
    stack.ensure_running()
    return stack


def progress(stack: ChaosStack, versions: int) -> int:
    """Wait for `versions` more versions; the version reached."""
    target = latest_version(stack) + versions
    reached = wait_for_version(stack, target, PROGRESS_TIMEOUT)
    assert reached >= target, f"training stalled at v{reached} (wanted v{target}):\n{tail(stack)}"
    return reached


def tail(stack: ChaosStack) -> str:
    return "\n".join(f"--- {name}.log\n{stack.log(name)[-1500:]}" for name in ("worker", "web"))


def released(stack: ChaosStack) -> int:
    return int(scalar(stack, "SELECT count(*) FROM projects_result WHERE status = 'released'"))


def check_books(stack: ChaosStack, crowd: Crowd) -> None:
    """After the crowd stopped: nobody gave up, and every invariant holds once things settled."""
    assert crowd.crashed() == {}
    settle(stack)
    broken = violations(stack)
    assert broken == {}, f"invariants broken: {broken}\n{tail(stack)}"
    # Beat's storage sweep ran throughout (tests/chaos/stack.py): decided updates were deleted meanwhile.
    assert wait_for_storage_sweep(stack)[1] > 0


def test_volunteers_killed_mid_work_unit(healthy: ChaosStack) -> None:
    released_before = released(healthy)
    with crowd_of(healthy) as crowd:
        for i in range(2):
            crowd.join(f"steady-{i}")
            crowd.join(f"flaky-{i}", failure_probability=0.3)  # drops the TCP connection before sending
        progress(healthy, BEFORE)
        doomed = [f"doomed-{i}" for i in range(3)]  # and some just vanish while holding a work unit
        for name in doomed:
            crowd.join(name)
        for name in doomed:
            assert wait_until_holding(healthy, name)
            crowd.kill(name)
        progress(healthy, AFTER)
    assert crowd.total("dropped") > 0
    assert released(healthy) > released_before  # the dropped work went back to the pool
    check_books(healthy, crowd)


def test_celery_worker_killed_mid_training(healthy: ChaosStack) -> None:
    with crowd_of(healthy) as crowd:
        for i in range(3):
            crowd.join(f"worker-chaos-{i}")
        progress(healthy, BEFORE)
        # Kill while a result that just arrived waits for validation: most likely mid-task.
        assert wait_for_validation_backlog(healthy)
        healthy.restart("worker", signal.SIGKILL)
        progress(healthy, AFTER)
    check_books(healthy, crowd)


def test_a_worker_that_dies_on_its_own_is_started_again(healthy: ChaosStack) -> None:
    """As kombu's restore of unacknowledged messages can kill a worker when Redis restarts: nothing revives
    it but the restart policy (the watchdog here, docker compose's and `make run`'s in deployments)."""
    restarted_before = healthy.restarted.count("worker")
    with crowd_of(healthy) as crowd:
        for i in range(3):
            crowd.join(f"worker-dies-{i}")
        progress(healthy, BEFORE)
        assert wait_for_validation_backlog(healthy)
        healthy.processes["worker"].kill()  # not `healthy.kill`, which holds it for the test to revive
        progress(healthy, AFTER)  # the worker alone steps the project: no progress without it
    assert healthy.restarted.count("worker") == restarted_before + 1
    check_books(healthy, crowd)


def test_daphne_restarted(healthy: ChaosStack) -> None:
    with crowd_of(healthy) as crowd:
        for i in range(3):
            crowd.join(f"web-chaos-{i}")
        progress(healthy, BEFORE)
        healthy.restart("web", signal.SIGTERM)  # a deploy: every WebSocket drops at once
        progress(healthy, AFTER)
    assert crowd.total("reconnects") > 0
    check_books(healthy, crowd)


def test_redis_restarted(healthy: ChaosStack) -> None:
    with crowd_of(healthy) as crowd:
        for i in range(3):
            crowd.join(f"redis-chaos-{i}")
        progress(healthy, BEFORE)
        # Comes back empty: queued tasks, unacked deliveries and channel-layer groups are gone.
        healthy.restart_redis()
        progress(healthy, AFTER)
    # Every consumer died with its Redis connection: the volunteers had to come back.
    assert crowd.total("reconnects") + crowd.rejected_handshakes > 0
    check_books(healthy, crowd)


def test_storage_reclaimed_while_volunteers_come_and_go(healthy: ChaosStack) -> None:
    """Enough versions for old ones to be pruned (every 3rd kept) while the sweep deletes blobs every
    2 s with no grace period; every blob a row refers to must still be on disk (check_books)."""
    with crowd_of(healthy) as crowd:
        for i in range(3):
            crowd.join(f"storage-{i}", failure_probability=0.2)
        progress(healthy, 5)
    pruned, released = storage_reclaimed(healthy)
    assert pruned > 0 and released > 0, (pruned, released)
    check_books(healthy, crowd)
