"""Simulated volunteers against the real platform (daphne + Celery on their own PostgreSQL database)."""

from __future__ import annotations

import asyncio
import http.server
import json
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest
from websockets.asyncio.client import connect
from websockets.typing import Origin

from devstack.stack import Stack
from tests.conftest import run_async
from workers.simulator import Http, Simulator, SimulatorConfig, SimulatorError, SimulatorStats, simulate_all

pytestmark = pytest.mark.slow

# Overridable so that several engineers can run the suite side by side on one PostgreSQL / Redis.
DATABASE = os.environ.get("SIM_STACK_DATABASE", "crowdtrain_sim")
REDIS_DB = int(os.environ.get("SIM_STACK_REDIS_DB", "11"))


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    # Every spot-checked work unit is recomputed as soon as it is sent (the demo's are small). A lone
    # attacker may try each work unit of a round once; when it has tried them all it waits for the round to
    # time out, so keep that short (the default is a minute).
    with Stack(
        var_dir=tmp_path_factory.mktemp("sim-stack"),
        database=DATABASE,
        redis_db=REDIS_DB,
        extra_env={"CROWDTRAIN_REFERENCE_MIN_FLOPS": "0"},
        round_timeout=5,
    ) as running:
        yield running


def run(stack: Stack, *configs: SimulatorConfig, timeout: float = 240) -> list[SimulatorStats]:
    return run_async(asyncio.wait_for(simulate_all(list(configs)), timeout))


def volunteer(stack: Stack, name: str, **overrides: Any) -> SimulatorConfig:
    # Verdicts may queue behind other validations on a loaded machine: wait for them, not for a clock.
    defaults: dict[str, Any] = {
        "gflops": 50,
        "bandwidth_mbit": 200,
        "latency_ms": 5,
        "verdict_timeout_s": 120,
        "seed": len(name),
    }
    return SimulatorConfig(
        url=stack.url, username=name, password="sim-pass-4321", signup=True, **(defaults | overrides)
    )


def query(stack: Stack, sql: str, *params: Any) -> Any:
    with psycopg.connect(stack.database_url) as conn:
        row = conn.execute(sql, params).fetchone()
    return row[0] if row else None


def execute(stack: Stack, sql: str, *params: Any) -> None:
    with psycopg.connect(stack.database_url) as conn:
        conn.execute(sql, params)


def ledger(stack: Stack, username: str) -> int:
    return int(
        query(
            stack,
            "SELECT coalesce(sum(c.flops), 0) FROM workers_creditentry c "
            "JOIN workers_volunteer v ON v.id = c.volunteer_id "
            "JOIN auth_user u ON u.id = v.user_id WHERE u.username = %s",
            username,
        )
    )


def valid_samples_times_flops(stack: Stack, username: str) -> int:
    return int(
        query(
            stack,
            "SELECT coalesce(sum(r.samples * p.flops_per_sample), 0) FROM projects_result r "
            "JOIN projects_workunit w ON w.id = r.work_unit_id "
            "JOIN projects_project p ON p.id = w.project_id "
            "JOIN auth_user u ON u.id = r.volunteer_id "
            "WHERE u.username = %s AND r.validation = 'valid'",
            username,
        )
    )


def results(stack: Stack, username: str, validation: str) -> int:
    return int(
        query(
            stack,
            "SELECT count(*) FROM projects_result r "
            "JOIN auth_user u ON u.id = r.volunteer_id "
            "WHERE u.username = %s AND r.validation = %s",
            username,
            validation,
        )
    )


def unjudged_on_time(stack: Stack, username: str) -> int:
    """Results the server received while their round was open that did not get a verdict on their merits.
    A round closes only once each of them is judged, so this is 0 whichever process ran first."""
    return int(
        query(
            stack,
            "SELECT count(*) FROM projects_result r "
            "JOIN auth_user u ON u.id = r.volunteer_id "
            "WHERE u.username = %s AND r.received_at IS NOT NULL "
            "AND r.validation NOT IN ('valid', 'invalid')",
            username,
        )
    )


def aggregated(stack: Stack, username: str) -> int:
    return int(
        query(
            stack,
            "SELECT count(*) FROM projects_result r "
            "JOIN auth_user u ON u.id = r.volunteer_id "
            "WHERE u.username = %s AND r.aggregated",
            username,
        )
    )


def wait_until(stack: Stack, sql: str, *params: Any, timeout: float = 120) -> Any:
    """Poll the database until `sql` returns something truthy: the explicit wait for a state the Celery
    worker reaches on its own schedule (no fixed sleeps)."""
    deadline = time.monotonic() + timeout
    while not (value := query(stack, sql, *params)):
        assert time.monotonic() < deadline, f"timed out waiting for: {sql} {params}"
        time.sleep(0.2)
    return value


def references(stack: Stack, username: str) -> int:
    """Work units of this volunteer's results that the server recomputed when it sent them."""
    return int(
        query(
            stack,
            "SELECT count(DISTINCT w.id) FROM projects_workunit w "
            "JOIN projects_result r ON r.work_unit_id = w.id "
            "JOIN auth_user u ON u.id = r.volunteer_id "
            "WHERE u.username = %s AND w.spot_check AND w.reference_id IS NOT NULL",
            username,
        )
    )


def latest_version(stack: Stack) -> int:
    """Highest model version number, once the Celery worker has published at least one."""
    return int(wait_until(stack, "SELECT max(number) FROM projects_modelversion WHERE number > 0"))


def test_honest_volunteers_are_validated_credited_and_train_the_model(stack: Stack) -> None:
    # New versions go down as int8 deltas (projects.services._wire): the volunteers build each version from
    # the last, check it against its content address, and are spot-checked on it (untrusted: every unit).
    execute(stack, "UPDATE projects_project SET weights_delta_codec = 'int8'")
    stats = run(
        stack,
        volunteer(stack, "sim-honest-1", max_work_units=10),
        volunteer(stack, "sim-honest-2", max_work_units=10, prefetch=True),
    )

    for s in stats:
        assert (s.work_units, s.invalid, s.reconnects, s.errors, s.unanswered) == (10, 0, 0, 0, 0), s
        # Late only when the round closed (at its 5 s timeout) while the result was on its way: every result
        # the server received in time was judged, and judged valid.
        assert s.valid >= 1 and s.valid + s.late == 10, s
        assert unjudged_on_time(stack, s.username) == 0 and results(stack, s.username, "invalid") == 0
        assert s.valid == results(stack, s.username, "valid"), s
        # Credit is server-side FLOPs x samples of the valid results, in the ledger and in `credit` messages.
        assert s.credit_flops == ledger(stack, s.username) == valid_samples_times_flops(stack, s.username)
        assert s.bytes_received > 0 and s.bytes_sent > 0 and s.compute_seconds > 0
        assert 0 < s.compute_share < 1
    assert latest_version(stack) >= 1
    assert sum(s.weights_by_delta for s in stats) >= 1, stats
    execute(stack, "UPDATE projects_project SET weights_delta_codec = ''")


@contextmanager
def rounds_held_open(stack: Stack) -> Iterator[None]:
    """No round closes while the test's lone volunteer works (no target it can reach, no timeout), so none of
    its results can be late and exact counts hold however the processes interleave (with the module's 5 s
    timeout a loaded machine closed a round under a replay, which then was late, not invalid)."""
    samples = query(stack, "SELECT round_samples FROM projects_project")
    execute(stack, "UPDATE projects_project SET round_samples = 16 * batch_size, round_timeout = 3600")
    try:
        yield
    finally:
        execute(stack, "UPDATE projects_project SET round_samples = %s, round_timeout = 5", samples)


def test_nan_updates_are_invalid_and_earn_nothing(stack: Stack) -> None:
    with rounds_held_open(stack):
        (stats,) = run(stack, volunteer(stack, "sim-nan", max_work_units=2, byzantine="nan"))
    # (a third would wait out the back-off two invalid results in a row earn: tests/security/test_backoff.py)

    assert (stats.work_units, stats.valid, stats.invalid, stats.credit_flops) == (2, 0, 2, 0), stats
    # int8 (the default codec) cannot even carry NaN: its block scales are non-finite.
    assert all("non-finite" in r or "NaN" in r for r in stats.reasons), stats.reasons
    assert ledger(stack, "sim-nan") == 0
    assert results(stack, "sim-nan", "valid") == 0
    assert results(stack, "sim-nan", "invalid") == 2


@pytest.mark.parametrize("behaviour", ["sign_flip", "scaled", "random"])
def test_tampered_updates_fail_the_spot_check_and_earn_nothing(stack: Stack, behaviour: str) -> None:
    """Untrusted volunteers are recomputed on the server every time, so any tampering is caught."""
    name = f"sim-{behaviour}"
    with rounds_held_open(stack):
        (stats,) = run(stack, volunteer(stack, name, max_work_units=2, byzantine=behaviour))

    assert (stats.work_units, stats.valid, stats.invalid, stats.credit_flops) == (2, 0, 2, 0), stats
    assert all("recomputation" in r or "norm" in r for r in stats.reasons), stats.reasons
    assert ledger(stack, name) == 0 and results(stack, name, "valid") == 0
    assert references(stack, name) == 2  # computed by the worker while the volunteer computed


def test_replayed_updates_are_invalid(stack: Stack) -> None:
    with rounds_held_open(stack):
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
    # The server releases a dropped connection's work in its disconnect handler, not at the deadline.
    released = wait_until(
        stack,
        "SELECT count(*) FILTER (WHERE r.status = 'released') = 2 "
        "AND count(*) FILTER (WHERE r.status = 'in_progress') = 0 "
        "FROM projects_result r JOIN auth_user u ON u.id = r.volunteer_id "
        "WHERE u.username = 'sim-flaky'",
        timeout=30,
    )
    assert released


def test_local_steps_in_averaging_mode_match_the_server(stack: Stack) -> None:
    """Last in this module: it switches the demo to averaging (local SGD deltas) with fp16 on the wire.

    The rounds are held open while the two volunteers work (no target they can reach, no timeout), so no
    result can be late and every verdict is exact, however the processes interleave; then the rounds close
    and the honest deltas, and only they, are aggregated."""
    with psycopg.connect(stack.database_url) as conn:
        conn.execute(
            "UPDATE projects_project SET mode = 'averaging', codec = 'fp16', "
            "round_samples = 16 * batch_size, round_timeout = 3600"
        )
    honest, flipper = run(
        stack,
        volunteer(stack, "sim-local", max_work_units=4),
        volunteer(stack, "sim-local-flip", max_work_units=2, byzantine="sign_flip"),
    )

    # Both are untrusted, so every delta was recomputed on the server and compared.
    assert (honest.work_units, honest.valid, honest.invalid, honest.late, honest.unanswered) == (
        4,
        4,
        0,
        0,
        0,
    ), honest
    paid = valid_samples_times_flops(stack, "sim-local")
    assert honest.credit_flops == ledger(stack, "sim-local") == paid > 0
    assert (flipper.work_units, flipper.valid, flipper.invalid, flipper.late, flipper.credit_flops) == (
        2,
        0,
        2,
        0,
        0,
    ), flipper
    assert all("recomputation" in r for r in flipper.reasons), flipper.reasons
    assert results(stack, "sim-local-flip", "invalid") == 2 and ledger(stack, "sim-local-flip") == 0

    with psycopg.connect(stack.database_url) as conn:
        conn.execute("UPDATE projects_project SET round_timeout = 1")
    # The transitioner closes the expired rounds: the honest deltas are averaged into the next versions.
    wait_until(
        stack,
        "SELECT count(*) = 4 FROM projects_result r JOIN auth_user u ON u.id = r.volunteer_id "
        "WHERE u.username = 'sim-local' AND r.aggregated",
    )
    assert aggregated(stack, "sim-local-flip") == 0


class _CutOff(http.server.BaseHTTPRequestHandler):
    """Promises 1,000 bytes and sends 10 before going away, like daphne killed mid-download."""

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "1000")
        self.end_headers()
        self.wfile.write(b"x" * 10)
        self.close_connection = True

    def log_message(self, *args: Any) -> None:
        pass


def test_a_download_cut_off_by_a_restarting_server_is_a_dropped_connection() -> None:
    """Seen in the chaos test: daphne restarted while a volunteer downloaded a shard, IncompleteRead escaped
    the reconnect logic and the simulated volunteer gave up. It is an OSError now, which reconnects."""
    server = http.server.HTTPServer(("127.0.0.1", 0), _CutOff)
    thread = threading.Thread(target=server.handle_request)
    thread.start()
    try:
        with pytest.raises(ConnectionResetError, match="IncompleteRead"):
            run_async(Http(f"http://127.0.0.1:{server.server_port}").request("/blob"))
    finally:
        thread.join(10)
        server.server_close()


class _RestartingThenBroken(http.server.BaseHTTPRequestHandler):
    """The first request finds the server going down (closed without a response); later ones get a page
    with no CSRF token, which the simulator cannot sign up with."""

    requests = 0

    def do_GET(self) -> None:
        type(self).requests += 1
        if type(self).requests == 1:
            self.close_connection = True
            return
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args: Any) -> None:
        pass


def test_a_sign_in_dropped_by_a_restarting_server_is_tried_again() -> None:
    """Seen in the chaos test: daphne restarted during a volunteer's sign-up, and it gave up at once."""
    server = http.server.HTTPServer(("127.0.0.1", 0), _RestartingThenBroken)

    def serve_two() -> None:
        server.handle_request()
        server.handle_request()

    thread = threading.Thread(target=serve_two)
    thread.start()
    simulator = Simulator(SimulatorConfig(url=f"http://127.0.0.1:{server.server_port}", signup=True))
    try:
        with pytest.raises(SimulatorError, match="no CSRF token"):  # the second attempt got an answer
            run_async(simulator.run())
    finally:
        thread.join(10)
        server.server_close()
    assert simulator.stats.reconnects == 1 and _RestartingThenBroken.requests == 2
