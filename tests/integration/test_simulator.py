"""Simulated volunteers against the real platform (daphne + Celery on their own PostgreSQL database)."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from websockets.asyncio.client import connect
from websockets.typing import Origin

from tests.conftest import run_async
from tests.e2e.stack import Stack
from workers.simulator import Simulator, SimulatorConfig, SimulatorStats

pytestmark = pytest.mark.slow

# Overridable so that several engineers can run the suite side by side on one PostgreSQL / Redis.
DATABASE = os.environ.get("SIM_STACK_DATABASE", "crowdtrain_sim")
REDIS_DB = int(os.environ.get("SIM_STACK_REDIS_DB", "11"))


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    running = Stack(
        var_dir=tmp_path_factory.mktemp("sim-stack"),
        database=DATABASE,
        redis_db=REDIS_DB,
        # Every spot-checked work unit is recomputed as soon as it is sent (the demo's are small).
        extra_env={"CROWDTRAIN_REFERENCE_MIN_FLOPS": "0"},
    )
    try:
        running.start()
        # A lone attacker may try each work unit of a round once; when it has tried them all it waits
        # for the round to time out, so keep that short (the default is a minute).
        with psycopg.connect(running.database_url) as conn:
            conn.execute("UPDATE projects_project SET round_timeout = 5")
        yield running
    finally:
        running.stop()


def run(stack: Stack, *configs: SimulatorConfig, timeout: float = 240) -> list[SimulatorStats]:
    async def all_of_them() -> list[SimulatorStats]:
        return list(await asyncio.gather(*(Simulator(c).run() for c in configs)))

    return run_async(asyncio.wait_for(all_of_them(), timeout))


def volunteer(stack: Stack, name: str, **overrides: Any) -> SimulatorConfig:
    return SimulatorConfig(url=stack.url, username=name, password="sim-pass-4321", signup=True,
                           gflops=50, bandwidth_mbit=200, latency_ms=5, verdict_timeout_s=10, seed=len(name),
                           **overrides)


def query(stack: Stack, sql: str, *params: Any) -> Any:
    with psycopg.connect(stack.database_url) as conn:
        row = conn.execute(sql, params).fetchone()
    return row[0] if row else None


def ledger(stack: Stack, username: str) -> int:
    return int(query(stack, "SELECT coalesce(sum(c.flops), 0) FROM workers_creditentry c "
                            "JOIN workers_volunteer v ON v.id = c.volunteer_id "
                            "JOIN auth_user u ON u.id = v.user_id WHERE u.username = %s", username))


def valid_samples_times_flops(stack: Stack, username: str) -> int:
    return int(query(stack, "SELECT coalesce(sum(r.samples * p.flops_per_sample), 0) FROM projects_result r "
                            "JOIN projects_workunit w ON w.id = r.work_unit_id "
                            "JOIN projects_project p ON p.id = w.project_id "
                            "JOIN auth_user u ON u.id = r.volunteer_id "
                            "WHERE u.username = %s AND r.validation = 'valid'", username))


def results(stack: Stack, username: str, validation: str) -> int:
    return int(query(stack, "SELECT count(*) FROM projects_result r "
                            "JOIN auth_user u ON u.id = r.volunteer_id "
                            "WHERE u.username = %s AND r.validation = %s", username, validation))


def references(stack: Stack, username: str) -> int:
    """Work units of this volunteer's results that the server recomputed when it sent them."""
    return int(query(stack, "SELECT count(DISTINCT w.id) FROM projects_workunit w "
                            "JOIN projects_result r ON r.work_unit_id = w.id "
                            "JOIN auth_user u ON u.id = r.volunteer_id "
                            "WHERE u.username = %s AND w.spot_check AND w.reference_id IS NOT NULL",
                 username))


def latest_version(stack: Stack, timeout: float = 60) -> int:
    """Highest model version number, waiting for the Celery worker to close pending rounds."""
    deadline = time.monotonic() + timeout
    while True:
        number = int(query(stack, "SELECT coalesce(max(number), 0) FROM projects_modelversion"))
        if number > 0 or time.monotonic() > deadline:
            return number
        time.sleep(1)


def test_honest_volunteers_are_validated_credited_and_train_the_model(stack: Stack) -> None:
    stats = run(stack, volunteer(stack, "sim-honest-1", max_work_units=10),
                volunteer(stack, "sim-honest-2", max_work_units=10, prefetch=True))

    for s in stats:
        assert (s.work_units, s.invalid, s.reconnects, s.errors) == (10, 0, 0, 0), s
        # A result whose round closed while it waited for validation is late (no credit, no penalty).
        assert s.valid >= 5 and s.valid + s.late + s.unanswered == 10, s
        # Credit is server-side FLOPs x samples of the valid results, in the ledger and in `credit` messages.
        assert s.credit_flops == ledger(stack, s.username) == valid_samples_times_flops(stack, s.username)
        assert s.bytes_received > 0 and s.bytes_sent > 0 and s.compute_seconds > 0
        assert 0 < s.compute_share < 1
    assert latest_version(stack) >= 1


def test_nan_updates_are_invalid_and_earn_nothing(stack: Stack) -> None:
    (stats,) = run(stack, volunteer(stack, "sim-nan", max_work_units=3, byzantine="nan"))

    assert (stats.work_units, stats.valid, stats.invalid, stats.credit_flops) == (3, 0, 3, 0), stats
    # int8 (the default codec) cannot even carry NaN: its block scales are non-finite.
    assert all("non-finite" in r or "NaN" in r for r in stats.reasons), stats.reasons
    assert ledger(stack, "sim-nan") == 0
    assert results(stack, "sim-nan", "valid") == 0
    assert results(stack, "sim-nan", "invalid") == 3


@pytest.mark.parametrize("behaviour", ["sign_flip", "scaled", "random"])
def test_tampered_updates_fail_the_spot_check_and_earn_nothing(stack: Stack, behaviour: str) -> None:
    """Untrusted volunteers are recomputed on the server every time, so any tampering is caught."""
    name = f"sim-{behaviour}"
    (stats,) = run(stack, volunteer(stack, name, max_work_units=2, byzantine=behaviour))

    assert (stats.work_units, stats.valid, stats.invalid, stats.credit_flops) == (2, 0, 2, 0), stats
    assert all("recomputation" in r or "norm" in r for r in stats.reasons), stats.reasons
    assert ledger(stack, name) == 0 and results(stack, name, "valid") == 0
    assert references(stack, name) == 2  # computed by the worker while the volunteer computed


def test_replayed_updates_are_invalid(stack: Stack) -> None:
    (stats,) = run(stack, volunteer(stack, "sim-replay", max_work_units=3, byzantine="stale_replay"))

    # The first result is honest work (and paid); resending its bytes for other work units is not.
    assert (stats.work_units, stats.invalid) == (3, 2), stats
    assert all("replay" in r for r in stats.reasons if r.startswith("invalid")), stats.reasons
    assert stats.credit_flops == ledger(stack, "sim-replay") == valid_samples_times_flops(stack, "sim-replay")


def test_an_idle_volunteer_keeps_its_connection(stack: Stack) -> None:
    """Regression: with redis-py 8 (socket_timeout 5 s = channels_redis's BZPOPMIN timeout) the
    consumer's channel-layer read timed out and daphne dropped quiet sockets (requirements.txt pin)."""
    simulator = Simulator(volunteer(stack, "sim-idle"))

    async def scenario() -> dict[str, Any]:
        await simulator.authenticate()
        headers = {"Cookie": simulator.http.cookie_header()}
        ws_url = stack.url.replace("http", "ws") + "/ws/volunteer/"
        async with connect(ws_url, additional_headers=headers, origin=Origin(stack.url)) as ws:
            await ws.send(json.dumps({"type": "hello", "protocol": 1, "device": {"backend": "simulator"}}))
            await ws.recv()
            await asyncio.sleep(20)  # a volunteer computing a long work unit sends nothing for a while
            await ws.send(json.dumps({"type": "ready"}))
            return dict(json.loads(await ws.recv()))

    assert run_async(scenario())["type"] == "assign"


def test_dropped_connections_give_the_work_back(stack: Stack) -> None:
    (stats,) = run(stack, volunteer(stack, "sim-flaky", max_work_units=2, failure_probability=1.0))

    assert (stats.dropped, stats.work_units) == (2, 0)
    time.sleep(2)  # the server releases a dropped connection's work in its disconnect handler
    held = query(stack, "SELECT count(*) FROM projects_result r "
                        "JOIN auth_user u ON u.id = r.volunteer_id "
                        "WHERE u.username = 'sim-flaky' AND r.status = 'in_progress'")
    assert held == 0


def test_local_steps_in_averaging_mode_match_the_server(stack: Stack) -> None:
    """Last in this module: it switches the demo to averaging (local SGD deltas) with fp16 on the wire."""
    with psycopg.connect(stack.database_url) as conn:
        conn.execute("UPDATE projects_project SET mode = 'averaging', codec = 'fp16'")
    honest, flipper = run(stack, volunteer(stack, "sim-local", max_work_units=4),
                          volunteer(stack, "sim-local-flip", max_work_units=2, byzantine="sign_flip"))

    # Both are untrusted, so every delta was recomputed on the server and compared.
    assert (honest.work_units, honest.invalid) == (4, 0) and honest.valid >= 1, honest
    assert honest.credit_flops == ledger(stack, "sim-local") > 0
    assert (flipper.valid, flipper.invalid, flipper.credit_flops) == (0, 2, 0), flipper
