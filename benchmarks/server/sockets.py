"""Sockets on one daphne (issue 15, item 3), on the real stack (devstack.stack.Stack: daphne, the Celery
workers and beat, PostgreSQL, Redis), measured from WebSocket clients in this process:

    .venv/bin/python -m benchmarks.server.sockets [--volunteers 3000] [--storm 2000] [--database NAME]

1. ramp: N idle volunteers (an account and a session each) connect and say hello, `--concurrency` at a time;
2. storms: K of them lose their socket at the same instant and reconnect, first all at once (retrying with
   the back-off only after a failure), then each after the Contribute page's full-jitter back-off
   (frontend/static/frontend/backoff.js, mirrored here with the constants read from that file);
3. close: all N vanish at once (TCP connections aborted, no close handshake, as browsers that are killed),
   then the devices still "connected" and the channel-layer group members left, right after and after the
   beat sweep (heartbeat shortened to --heartbeat seconds so that the sweep comes within the run).
A probe GETs the home page every 100 ms throughout: p50/p99 per phase. Redis clients on the stack's database
and daphne's file descriptors and memory are sampled at each step. Prints a table and writes
benchmarks/results/server-sockets.json. The database is dropped and created anew (Stack).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import resource
import secrets
import statistics
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from websockets.asyncio.client import ClientConnection, connect

from devstack.stack import ROOT, Stack

RESULTS = Path(__file__).resolve().parent.parent / "results"
BACKOFF_JS = ROOT / "frontend/static/frontend/backoff.js"
# Measured on the landed main before this change (issue 15), for the table's side-by-side column.
BEFORE = {
    "storm_2000_failed_share": 0.72,
    "close_5000_consumers_killed": 4937,
    "close_5000_idle_redis_connections": 4899,
    "dead_group_members_after_restart": 19371,
}


def backoff_constants() -> tuple[int, int]:
    text = BACKOFF_JS.read_text()
    base = re.search(r"BASE_MS = (\d+)", text)
    cap = re.search(r"CAP_MS = (\d+)", text)
    assert base and cap, "backoff.js changed shape: update benchmarks/server/sockets.py"
    return int(base.group(1)), int(cap.group(1))


BASE_MS, CAP_MS = backoff_constants()


def reconnect_delay(attempt: int) -> float:
    """backoff.js's reconnectDelay, in seconds."""
    return random.random() * min(CAP_MS, BASE_MS * 2 ** min(max(attempt, 0), 30)) / 1000


@dataclass
class Volunteer:
    cookie: str
    device: str
    socket: ClientConnection | None = None


@dataclass
class Bench:
    stack: Stack
    volunteers: list[Volunteer]
    phase: str = "idle"
    latencies: dict[str, list[float]] = field(default_factory=dict)
    samples: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def ws_url(self) -> str:
        return self.stack.url.replace("http://", "ws://") + "/ws/volunteer/"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--volunteers", type=int, default=3000, help="idle volunteers to ramp up (N)")
    p.add_argument("--storm", type=int, default=2000, help="simultaneous reconnects (K <= N)")
    p.add_argument("--concurrency", type=int, default=200, help="connects in flight during the ramp")
    p.add_argument("--heartbeat", type=int, default=5, help="CROWDTRAIN_SOCKET_HEARTBEAT_SECONDS for the run")
    p.add_argument("--database", default="crowdtrain_sockets_bench", help="scratch database (dropped first)")
    p.add_argument("--redis-db", type=int, default=14, help="Redis database (flushed first)")
    p.add_argument("--output", type=Path, default=RESULTS / "server-sockets.json")
    return p


def open_files_raised() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def make_volunteers(n: int) -> list[Volunteer]:
    """Accounts and signed-in sessions in bulk (daphne reads them as a browser's cookie)."""
    from django.conf import settings
    from django.contrib.auth import BACKEND_SESSION_KEY, HASH_SESSION_KEY, SESSION_KEY
    from django.contrib.auth.models import User
    from django.contrib.sessions.backends.db import SessionStore
    from django.contrib.sessions.models import Session
    from django.utils import timezone

    tag = secrets.token_hex(3)
    users = User.objects.bulk_create(
        [User(username=f"sock-{tag}-{i}", password="!unusable") for i in range(n)], batch_size=1000
    )
    store, expiry = SessionStore(), timezone.now() + timedelta(days=1)
    backend = settings.AUTHENTICATION_BACKENDS[0]
    keys = [secrets.token_hex(16) for _ in users]
    Session.objects.bulk_create(
        [
            Session(
                session_key=key,
                session_data=store.encode(
                    {
                        SESSION_KEY: str(u.pk),
                        BACKEND_SESSION_KEY: backend,
                        HASH_SESSION_KEY: u.get_session_auth_hash(),
                    }
                ),
                expire_date=expiry,
            )
            for key, u in zip(keys, users, strict=True)
        ],
        batch_size=1000,
    )
    name = settings.SESSION_COOKIE_NAME
    return [Volunteer(cookie=f"{name}={key}", device=secrets.token_hex(8)) for key in keys]


async def open_socket(bench: Bench, volunteer: Volunteer) -> bool:
    """Connect, hello, welcome: True when all three happened (daphne's own handshake limit is 5 s)."""
    headers = {"Cookie": volunteer.cookie, "Origin": bench.stack.url}
    hello = {
        "type": "hello",
        "protocol": 1,
        "device": {"id": volunteer.device, "backend": "cpu", "gflops": 1},
    }
    try:
        socket = await connect(bench.ws_url, additional_headers=headers, open_timeout=30, ping_interval=None)
        await socket.send(json.dumps(hello))
        reply = json.loads(await asyncio.wait_for(socket.recv(), 30))
    except (OSError, TimeoutError, Exception):  # noqa: BLE001 - any failure counts
        return False
    if reply.get("type") != "welcome":
        await socket.close()
        return False
    volunteer.socket = socket
    return True


async def ramp(bench: Bench, concurrency: int) -> dict[str, Any]:
    gate = asyncio.Semaphore(concurrency)

    async def one(volunteer: Volunteer) -> bool:
        async with gate:
            return await open_socket(bench, volunteer)

    started = time.monotonic()
    done = await asyncio.gather(*(one(v) for v in bench.volunteers))
    seconds = time.monotonic() - started
    return {"connected": sum(done), "failed": len(done) - sum(done), "seconds": round(seconds, 2)}


async def reconnect(bench: Bench, volunteer: Volunteer, *, jitter: bool, deadline: float) -> tuple[int, int]:
    """(attempts, failures) until this volunteer is back, with the page's back-off between attempts."""
    attempts = failures = 0
    while time.monotonic() < deadline:
        if jitter or attempts:
            await asyncio.sleep(reconnect_delay(failures))
        attempts += 1
        if await open_socket(bench, volunteer):
            return attempts, failures
        failures += 1
    return attempts, failures


async def storm(bench: Bench, k: int, *, jitter: bool) -> dict[str, Any]:
    """K volunteers lose their sockets at the same instant (aborted) and come back."""
    chosen = [v for v in bench.volunteers if v.socket is not None][:k]
    for volunteer in chosen:
        assert volunteer.socket is not None
        volunteer.socket.transport.abort()
        volunteer.socket = None
    started = time.monotonic()
    deadline = started + 180
    outcomes = await asyncio.gather(*(reconnect(bench, v, jitter=jitter, deadline=deadline) for v in chosen))
    attempts, failures = sum(a for a, _ in outcomes), sum(f for _, f in outcomes)
    back = sum(v.socket is not None for v in chosen)
    return {
        "volunteers": len(chosen),
        "back": back,
        "attempts": attempts,
        "failed_attempts": failures,
        "success_rate": round((attempts - failures) / attempts, 4) if attempts else None,
        "first_try_rate": round(sum(f == 0 for _, f in outcomes) / len(chosen), 4) if chosen else None,
        "seconds_until_all_back": round(time.monotonic() - started, 2),
    }


def close_all(bench: Bench) -> int:
    closed = 0
    for volunteer in bench.volunteers:
        if volunteer.socket is not None:
            volunteer.socket.transport.abort()
            volunteer.socket = None
            closed += 1
    return closed


async def probe(bench: Bench) -> None:
    url = bench.stack.url + "/"
    while True:
        started = time.perf_counter()
        try:
            await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=30).read())
            bench.latencies.setdefault(bench.phase, []).append((time.perf_counter() - started) * 1000)
        except OSError:
            bench.latencies.setdefault(f"{bench.phase} (failed)", []).append(0.0)
        await asyncio.sleep(0.1)


def sample(bench: Bench, label: str) -> dict[str, Any]:
    """Devices connected, group members, Redis clients on the stack's database, daphne's fds and memory."""
    import psycopg
    import redis

    with psycopg.connect(bench.stack.database_url) as conn:  # not Django's: this runs in the event loop
        row = conn.execute("SELECT count(*) FROM workers_device WHERE disconnected_at IS NULL").fetchone()
    connected = row[0] if row else 0
    store = redis.Redis.from_url(bench.stack.env()["REDIS_URL"])
    members = sum(int(store.zcard(key)) for key in store.scan_iter(match="asgi:group:*", count=1000))
    clients = [c for c in store.client_list() if int(c.get("db", -1)) == bench.stack.redis_db]
    pid = bench.stack.processes["web"].pid
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    rss = next(
        line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("VmRSS")
    )
    numbers = {
        "redis_connections_by_process": redis_connections(bench),
        "devices_connected": connected,
        "group_members": members,
        "redis_clients": len(clients),
        "daphne_fds": fds,
        "daphne_rss_mb": round(int(rss.split()[1]) / 1024, 1),
    }
    bench.samples[label] = numbers
    return numbers


def redis_connections(bench: Bench) -> dict[str, int]:
    """Open TCP connections to Redis, by stack process (ss -p)."""
    out = subprocess.run(["ss", "-tnpH", "dport = :6379"], capture_output=True, text=True).stdout
    pids = {process.pid: name for name, process in bench.stack.processes.items()}
    counts: dict[str, int] = {}
    for pid in re.findall(r"pid=(\d+)", out):
        name = pids.get(int(pid))
        if name is not None:
            counts[name] = counts.get(name, 0) + 1
    return counts


def percentiles(values: list[float]) -> dict[str, float | int]:
    if len(values) < 2:
        return {"n": len(values)}
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return {
        "n": len(values),
        "p50_ms": round(cuts[49], 1),
        "p99_ms": round(cuts[98], 1),
        "max_ms": round(max(values), 1),
    }


async def scenario(bench: Bench, args: argparse.Namespace) -> dict[str, Any]:
    prober = asyncio.create_task(probe(bench))
    sample(bench, "before")
    result: dict[str, Any] = {}
    bench.phase = "ramp"
    result["ramp"] = await ramp(bench, args.concurrency)
    bench.phase = "idle"
    await asyncio.sleep(args.heartbeat * 2)  # a heartbeat or two with everyone connected
    sample(bench, "connected")
    bench.phase = "storm at once"
    result["storm_at_once"] = await storm(bench, args.storm, jitter=False)
    bench.phase = "storm with back-off"
    result["storm_backoff"] = await storm(bench, args.storm, jitter=True)
    bench.phase = "close"
    result["closed"] = close_all(bench)
    await asyncio.sleep(3)
    sample(bench, "3 s after close")
    bench.phase = "after close"
    await asyncio.sleep(args.heartbeat * 6)  # stale (4 heartbeats) + a sweep
    sample(bench, "after the sweep")
    prober.cancel()
    result["pages"] = {phase: percentiles(values) for phase, values in bench.latencies.items()}
    result["samples"] = bench.samples
    return result


def setup(args: argparse.Namespace, var_dir: Path) -> Stack:
    extra = {
        "CROWDTRAIN_SOCKET_HEARTBEAT_SECONDS": str(args.heartbeat),
        # One address (this machine) for every volunteer: the per-address throttle would refuse them.
        "CROWDTRAIN_WS_CONNECTS_PER_MINUTE_IP": str(10 * (args.volunteers + 2 * args.storm)),
    }
    stack = Stack(var_dir=var_dir, database=args.database, redis_db=args.redis_db, extra_env=extra)
    return stack


def django_for(stack: Stack) -> None:
    os.environ.update({k: v for k, v in stack.env().items() if k != "PYTHONUNBUFFERED"})
    import django

    django.setup()


def table(result: dict[str, Any]) -> str:
    cfg, ramp_, samples = result["config"], result["ramp"], result["samples"]
    lines = [f"Sockets on one daphne: N={cfg['volunteers']} idle volunteers, K={cfg['storm']} reconnects"]
    lines.append(f"  ramp: {ramp_['connected']} connected, {ramp_['failed']} failed, in {ramp_['seconds']} s")
    for key, label in (
        ("storm_at_once", "storm, all at once"),
        ("storm_backoff", "storm, full-jitter back-off"),
    ):
        s = result[key]
        lines.append(
            f"  {label:<28} back {s['back']}/{s['volunteers']} in {s['seconds_until_all_back']} s; attempts "
            f"{s['attempts']}, success {s['success_rate']:.1%}, first try {s['first_try_rate']:.1%}"
        )
    lines.append(
        f"  {'':<22}{'devices conn.':>14}{'group members':>15}{'redis clients':>15}"
        f"{'daphne fds':>12}{'RSS MB':>9}"
    )
    for label, row in samples.items():
        lines.append(
            f"  {label:<22}{row['devices_connected']:>14}{row['group_members']:>15}{row['redis_clients']:>15}"
            f"{row['daphne_fds']:>12}{row['daphne_rss_mb']:>9}"
        )
    lines.append(f"  {'page /':<22}{'n':>6}{'p50 ms':>9}{'p99 ms':>9}{'max ms':>9}")
    for phase, p in result["pages"].items():
        lines.append(
            f"  {phase:<22}{p['n']:>6}{p.get('p50_ms', '-'):>9}{p.get('p99_ms', '-'):>9}"
            f"{p.get('max_ms', '-'):>9}"
        )
    lines.append(f"  before (issue 15): {json.dumps(BEFORE)}")
    return "\n".join(lines)


def main() -> None:
    args = parser().parse_args()
    args.storm = min(args.storm, args.volunteers)
    open_files_raised()
    var_dir = Path(tempfile.mkdtemp(prefix="crowdtrain-sockets-bench-"))
    with setup(args, var_dir) as stack:
        django_for(stack)
        bench = Bench(stack=stack, volunteers=make_volunteers(args.volunteers))
        result = asyncio.run(scenario(bench, args))
    result["config"] = {k: v for k, v in vars(args).items() if k != "output"}
    result["before"] = BEFORE
    print(table(result))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.output} (stack logs in {var_dir})")


if __name__ == "__main__":
    main()
