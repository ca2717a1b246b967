"""Sockets on one daphne (issue 15, item 3), on the real stack (devstack.stack.Stack: daphne, the Celery
workers and beat, PostgreSQL, Redis), measured from WebSocket clients in processes of their own:

    .venv/bin/python -m benchmarks.server.sockets [--volunteers 3000] [--storm 2000] [--database NAME]

1. ramp: N idle volunteers (an account and a session each) connect and say hello, `--concurrency` at a time;
2. storms: K of them lose their socket at the same instant and reconnect, first all at once (retrying with
   the back-off only after a failure), then each after the Contribute page's full-jitter back-off
   (frontend/static/frontend/backoff.js, mirrored here with the constants read from that file);
3. close: all N vanish at once (TCP connections aborted, no close handshake, as browsers that are killed),
   then the devices still "connected" and the channel-layer group members left, right after and after the
   beat sweep (heartbeat shortened to --heartbeat seconds so that the sweep comes within the run).
After the storms it compares the live sockets with the devices shown connected, and counts the attempts the
server closed at once with 4503 (config/admission.py). With `--baseline FILE` (a run of other code, e.g. main
in a temporary `git worktree` with this file copied in: `cd /tmp/main && <this venv>/bin/python -m
benchmarks.server.sockets --label main --output /tmp/main.json`) the key figures go side by side.
Two daphnes run: the volunteers connect to the first, and a probe GETs the home page from each every 100 ms
throughout (p50/p99 per phase); the second, holding no socket, is nginx's page pool (platform/nginx.conf). The
page pool runs at `--page-pool-nice` (-6: a CPU weight 3.8 times the others', as docker-compose.yml's
cpu_shares 4096 against 1024 gives it; negative values need root, and the table says what each daphne got).
Redis clients on the stack's database and daphne's file descriptors and memory are sampled at each step.
Prints a table and writes benchmarks/results/server-sockets.json. The database is dropped and created anew
(Stack).

At scale (tens of thousands of sockets) the clients are not this process: one client process per
`--per-client` volunteers (a Python event loop handles ~10-15k sockets). Each volunteer connects from a
loopback address of its own (source_address), as browsers come from their own: one address holds at most 4
admissions at once (config/admission.py), and one reaches one server port through at most the ~28,000
ephemeral ports of net.ipv4.ip_local_port_range. Every socket is a file descriptor in daphne and in a
client: run as root, the benchmark raises its own hard RLIMIT_NOFILE (children inherit it) to what N needs;
otherwise the operator raises it first (`ulimit -Hn 131072` as root in the shell that runs it, or
`prlimit --nofile=131072:131072 -- .venv/bin/python -m benchmarks.server.sockets ...`). Raising a hard
limit needs CAP_SYS_RESOURCE: a container without it keeps its hard limit, and the table says which held.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
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
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from devstack.stack import REDIS_SERVER, ROOT, Stack

RESULTS = Path(__file__).resolve().parent.parent / "results"
GC_STARTED = re.compile(r"heap: started; .* pauses from ([0-9.]+) ms logged")
GC_PAUSE = re.compile(r"heap: full collection paused ([0-9.]+) ms")
BACKOFF_JS = ROOT / "frontend/static/frontend/backoff.js"
# The page pool's CPU priority: nice -6 weighs 3,906 against nice 0's 1,024 in Linux's scheduler, as
# docker-compose.yml's cpu_shares 4096 against the default 1024 (pages are light; no storm may queue them).
PAGE_POOL_NICE = -6
RETRY_LATER = 4503  # config/admission.py's close code (not imported: the baseline run's tree may lack it)
# Measured on the landed main before this change (issue 15), for the table's side-by-side column.
BEFORE = {
    "storm_2000_failed_share": 0.72,
    "close_5000_consumers_killed": 4937,
    "close_5000_idle_redis_connections": 4899,
    "dead_group_members_after_restart": 19371,
}


def backoff_constants() -> tuple[int, int, int]:
    text = BACKOFF_JS.read_text()
    found = [re.search(rf"{name} = (\d+)", text) for name in ("BASE_MS", "CAP_MS", "RETRY_LATER_MS")]
    assert all(found[:2]), "backoff.js changed shape: update benchmarks/server/sockets.py"
    return tuple(int(match.group(1)) if match else 0 for match in found)  # type: ignore[return-value]


BASE_MS, CAP_MS, RETRY_LATER_MS = backoff_constants()


def reconnect_delay(attempt: int, *, retry_later: bool = False) -> float:
    """backoff.js's reconnectDelay (retryLaterDelay after a 4503), in seconds."""
    floor = RETRY_LATER_MS if retry_later else 0
    return (floor + random.random() * min(CAP_MS, BASE_MS * 2 ** min(max(attempt, 0), 30))) / 1000


# The last run before this one (3,000 volunteers, one client process, one source address; 2,000 storm).
PREVIOUS = {
    "volunteers": 3000,
    "storm": 2000,
    "ramp_seconds": 52.88,
    "storm_at_once_first_try_rate": 0.8855,
    "storm_backoff_success_rate": 0.9751,
    "devices_connected_after_sweep": 229,
    "group_members_after_sweep": 458,
    "redis_clients_connected": 71,
    "page_p99_ms": {"ramp": 3368.3, "idle": 1172.6, "storm at once": 13520.7, "after close": 1003.8},
}
PER_CLIENT = 12_500  # sockets per client process


def source_address(index: int) -> str:
    """Volunteer `index`'s own loopback address (127.0.0.0/8 is all loopback): volunteers come from as many
    addresses as there are of them, as browsers do, not from one (one address held at most 4 admissions at
    once, config/admission.py, and the last runs measured that bound instead of the server)."""
    return f"127.{1 + index // 62_500}.{index // 250 % 250}.{2 + index % 250}"


@dataclass
class Volunteer:
    cookie: str
    device: str
    source: str  # its own address (source_address)
    socket: ClientConnection | None = None


@dataclass
class Client:
    """One client process's volunteers, each on a loopback address of its own."""

    url: str
    origin: str
    volunteers: list[Volunteer]
    turned_away: int = 0  # attempts the server closed at once with 4503 (config/admission.py)

    async def open_socket(self, volunteer: Volunteer) -> bool:
        """Connect, hello, welcome: True when all three happened. A failed attempt's socket is closed (the
        last run leaked the 229 whose welcome came late: daphne rightly kept their devices connected)."""
        socket: ClientConnection | None = None
        try:
            socket = await self._connect(volunteer)
            await socket.send(json.dumps(hello(volunteer)))
            reply = json.loads(await asyncio.wait_for(socket.recv(), 30))
        except ConnectionClosed as closed:
            self.turned_away += closed.rcvd is not None and closed.rcvd.code == RETRY_LATER
            reply = {}
        except Exception:  # noqa: BLE001 - any failure counts
            reply = {}
        if reply.get("type") != "welcome":
            if socket is not None:
                socket.transport.abort()
            return False
        volunteer.socket = socket
        return True

    async def _connect(self, volunteer: Volunteer) -> ClientConnection:
        headers = {"Cookie": volunteer.cookie, "Origin": self.origin}
        return await connect(
            self.url,
            additional_headers=headers,
            open_timeout=30,
            ping_interval=None,  # daphne pings; the library answers
            max_queue=None,  # broadcasts nobody reads must not stop the pongs
            local_addr=(volunteer.source, 0),
        )

    async def ramp(self, concurrency: int) -> dict[str, Any]:
        gate = asyncio.Semaphore(concurrency)

        async def one(volunteer: Volunteer) -> bool:
            async with gate:  # a browser told to come back later (4503) does, after its back-off
                for attempt in range(8):
                    turned_away = self.turned_away
                    if await self.open_socket(volunteer):
                        return True
                    if self.turned_away == turned_away:
                        return False
                    await asyncio.sleep(reconnect_delay(attempt, retry_later=True))
                return False

        done = await asyncio.gather(*(one(v) for v in self.volunteers))
        return {"connected": sum(done), "failed": len(done) - sum(done)}

    async def reconnect(self, volunteer: Volunteer, *, jitter: bool, deadline: float) -> tuple[int, int]:
        """(attempts, failures) until this volunteer is back, with the page's back-off between attempts."""
        attempts = failures = 0
        retry_later = False  # the last attempt was closed with 4503: the page waits its floor
        while time.monotonic() < deadline:
            if jitter or attempts:
                await asyncio.sleep(reconnect_delay(failures, retry_later=retry_later))
            attempts += 1
            turned_away = self.turned_away
            if await self.open_socket(volunteer):
                return attempts, failures
            failures += 1
            retry_later = self.turned_away > turned_away
        return attempts, failures

    async def storm(self, k: int, jitter: bool) -> dict[str, Any]:
        """K of this client's volunteers lose their sockets at the same instant (aborted) and come back."""
        chosen = [v for v in self.volunteers if v.socket is not None][:k]
        for volunteer in chosen:
            abort(volunteer)
        started = time.monotonic()
        deadline = started + 300
        outcomes = await asyncio.gather(
            *(self.reconnect(v, jitter=jitter, deadline=deadline) for v in chosen)
        )
        return {
            "volunteers": len(chosen),
            "back": sum(v.socket is not None for v in chosen),
            "attempts": sum(a for a, _ in outcomes),
            "failed_attempts": sum(f for _, f in outcomes),
            "first_try": sum(f == 0 for _, f in outcomes),
            "seconds_until_all_back": round(time.monotonic() - started, 2),
        }

    async def counts(self) -> dict[str, int]:
        """Sockets open now (welcomed, not closed by the server) and 4503 turn-aways so far."""
        live = sum(v.socket is not None and v.socket.close_code is None for v in self.volunteers)
        return {"live": live, "turned_away": self.turned_away}

    async def close(self) -> int:
        live = [v for v in self.volunteers if v.socket is not None]
        for volunteer in live:
            abort(volunteer)
        return len(live)


def hello(volunteer: Volunteer) -> dict[str, Any]:
    return {"type": "hello", "protocol": 1, "device": {"id": volunteer.device, "backend": "cpu", "gflops": 1}}


def abort(volunteer: Volunteer) -> None:
    """As a killed browser: the TCP connection reset, no close handshake."""
    assert volunteer.socket is not None
    volunteer.socket.transport.abort()
    volunteer.socket = None


def client_main(conn: Connection, client: Client) -> None:
    """A client process: runs the commands the benchmark sends (ramp, storm, close) until `stop`."""
    asyncio.run(client_serve(conn, client))


async def client_serve(conn: Connection, client: Client) -> None:
    loop = asyncio.get_running_loop()
    while True:
        command, *args = await loop.run_in_executor(None, conn.recv)
        if command == "stop":
            return
        conn.send(await getattr(client, command)(*args))


@dataclass
class Bench:
    stack: Stack
    clients: list[tuple[multiprocessing.process.BaseProcess, Connection]]
    phase: str = "idle"
    latencies: dict[str, list[float]] = field(default_factory=dict)  # pages of the daphne holding the sockets
    # Pages of a second daphne that holds none (nginx's `/ws/` to one upstream, the rest to another).
    page_latencies: dict[str, list[float]] = field(default_factory=dict)
    samples: dict[str, dict[str, Any]] = field(default_factory=dict)

    async def command(self, *command: Any) -> list[Any]:
        """The same command to every client process at once; their answers."""
        for _, conn in self.clients:
            conn.send(command)
        return await asyncio.gather(*(asyncio.to_thread(conn.recv) for _, conn in self.clients))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--volunteers", type=int, default=3000, help="idle volunteers to ramp up (N)")
    p.add_argument("--storm", type=int, default=2000, help="simultaneous reconnects (K <= N)")
    p.add_argument("--concurrency", type=int, default=200, help="connects in flight during the ramp")
    p.add_argument("--per-client", type=int, default=PER_CLIENT, help="sockets per client process")
    p.add_argument("--heartbeat", type=int, default=5, help="CROWDTRAIN_SOCKET_HEARTBEAT_SECONDS for the run")
    p.add_argument("--database", default="crowdtrain_sockets_bench", help="scratch database (dropped first)")
    p.add_argument("--redis-db", type=int, default=14, help="Redis database (flushed first)")
    p.add_argument("--output", type=Path, default=RESULTS / "server-sockets.json")
    p.add_argument("--label", default="this checkout", help="what code this run measures")
    p.add_argument(
        "--page-pool-nice",
        type=int,
        default=PAGE_POOL_NICE,
        help="the page pool daphne's niceness (0: the same CPU priority as every other process)",
    )
    p.add_argument(
        "--baseline",
        type=Path,
        help="a run of other code (e.g. main's) from this session, shown side by side",
    )
    return p


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """The figures compared side by side: connects, attempts, pages, devices shown connected vs live."""
    keys = ("back", "attempts", "success_rate", "seconds_until_all_back")
    return {
        "label": result["config"]["label"],
        "ramp": result["ramp"],
        "storm_at_once": {k: result["storm_at_once"][k] for k in keys},
        "storm_backoff": {k: result["storm_backoff"][k] for k in keys},
        "after_storms": result.get("after_storms"),
        "niceness": result.get("niceness"),
        "gc_pauses": result.get("gc_pauses"),
        "pages_p50_p99_ms": _p50_p99(result["pages"]),
        "page_pool_p50_p99_ms": _p50_p99(result.get("pages_other_process", {})),
    }


def _p50_p99(pages: dict[str, Any]) -> dict[str, list[float]]:
    return {phase: [p["p50_ms"], p["p99_ms"]] for phase, p in pages.items() if "p99_ms" in p}


def open_files_raised(volunteers: int) -> dict[str, int]:
    """Soft and hard RLIMIT_NOFILE for this process and the ones it starts (daphne, the clients): raised to
    what N sockets need when this runs as root (the kernel's fs.nr_open caps it), else the hard limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = min(int(Path("/proc/sys/fs/nr_open").read_text()), max(hard, 2 * volunteers + 16_384))
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, wanted))
    except (ValueError, OSError):  # not root: the operator raises the hard limit (see the docstring)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return {"soft": soft, "hard": hard, "before": hard if hard != wanted else soft}


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
        [User(username=f"sock-{tag}-{i}", password="!unusable") for i in range(n)], batch_size=5000
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
        batch_size=5000,
    )
    name = settings.SESSION_COOKIE_NAME
    return [
        Volunteer(cookie=f"{name}={key}", device=secrets.token_hex(8), source=source_address(i))
        for i, key in enumerate(keys)
    ]


def start_clients(stack: Stack, volunteers: list[Volunteer], per_client: int) -> list[Any]:
    """Client processes (spawned: no Django, no event loop of ours), each with its share of volunteers."""
    context = multiprocessing.get_context("spawn")
    url = stack.url.replace("http://", "ws://") + "/ws/volunteer/"
    clients = []
    for start in range(0, len(volunteers), per_client):
        client = Client(url, stack.url, volunteers[start : start + per_client])
        ours, theirs = context.Pipe()
        process = context.Process(target=client_main, args=(theirs, client), daemon=True)
        process.start()
        clients.append((process, ours))
    return clients


def stop_clients(bench: Bench) -> None:
    for process, conn in bench.clients:
        conn.send(("stop",))
        process.join(timeout=30)
        if process.is_alive():
            process.kill()


async def ramp(bench: Bench, concurrency: int) -> dict[str, Any]:
    started = time.monotonic()
    share = max(1, concurrency // len(bench.clients))
    parts = await bench.command("ramp", share)
    seconds = time.monotonic() - started
    connected, failed = sum(p["connected"] for p in parts), sum(p["failed"] for p in parts)
    return {"connected": connected, "failed": failed, "seconds": round(seconds, 2)}


async def storm(bench: Bench, k: int, *, jitter: bool) -> dict[str, Any]:
    """K volunteers, spread over the client processes, lose their sockets at one instant and come back."""
    share = -(-k // len(bench.clients))
    parts = await bench.command("storm", share, jitter)
    total = {key: sum(p[key] for p in parts) for key in ("volunteers", "back", "attempts", "failed_attempts")}
    attempts, failures, chosen = total["attempts"], total["failed_attempts"], total["volunteers"]
    first_try = sum(p["first_try"] for p in parts)
    return {
        **total,
        "success_rate": round((attempts - failures) / attempts, 4) if attempts else None,
        "first_try_rate": round(first_try / chosen, 4) if chosen else None,
        "seconds_until_all_back": max(p["seconds_until_all_back"] for p in parts),
    }


async def counted(bench: Bench) -> dict[str, int]:
    """Live sockets (the clients') against devices shown connected (the database) after the storms."""
    parts = await bench.command("counts")
    return {
        "live_sockets": sum(p["live"] for p in parts),
        "devices_connected": bench.samples["after the storms"]["devices_connected"],
        "turned_away_4503": sum(p["turned_away"] for p in parts),
    }


async def probe(bench: Bench, url: str, latencies: dict[str, list[float]]) -> None:
    """GET the home page at `url` every 100 ms: its latency, by the phase the run is in."""
    while True:
        started = time.perf_counter()
        try:
            await asyncio.to_thread(lambda: urllib.request.urlopen(url + "/", timeout=30).read())
            latencies.setdefault(bench.phase, []).append((time.perf_counter() - started) * 1000)
        except OSError:
            latencies.setdefault(f"{bench.phase} (failed)", []).append(0.0)
        await asyncio.sleep(0.1)


def sample(bench: Bench, label: str) -> dict[str, Any]:
    """Devices connected, group members, Redis clients on the stack's database, daphne's fds and memory."""
    import psycopg
    import redis

    with psycopg.connect(bench.stack.database_url) as conn:  # not Django's: this runs in the event loop
        row = conn.execute("SELECT count(*) FROM workers_device WHERE disconnected_at IS NULL").fetchone()
    connected = row[0] if row else 0
    store = redis.Redis.from_url(bench.stack.env()["REDIS_URL"])
    with store.pipeline(transaction=False) as pipe:  # one round trip for the 50,000 users' groups
        for key in store.scan_iter(match="asgi:group:*", count=1000):
            pipe.zcard(key)
        members = sum(int(n) for n in pipe.execute())
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
    """Open TCP connections to the stack's Redis, by stack process (ss -p)."""
    port = REDIS_SERVER.rsplit(":", 1)[1].split("/")[0]
    out = subprocess.run(["ss", "-tnpH", f"dport = :{port}"], capture_output=True, text=True).stdout
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
    sockets_url, pages_url = bench.stack.urls
    probers = [
        asyncio.create_task(probe(bench, sockets_url, bench.latencies)),
        asyncio.create_task(probe(bench, pages_url, bench.page_latencies)),
    ]
    await asyncio.to_thread(sample, bench, "before")
    result: dict[str, Any] = {}
    bench.phase = "ramp"
    result["ramp"] = await ramp(bench, args.concurrency)
    bench.phase = "idle"
    await asyncio.sleep(args.heartbeat * 2)  # a heartbeat or two with everyone connected
    await asyncio.to_thread(sample, bench, "connected")
    bench.phase = "storm at once"
    result["storm_at_once"] = await storm(bench, args.storm, jitter=False)
    bench.phase = "storm with back-off"
    result["storm_backoff"] = await storm(bench, args.storm, jitter=True)
    bench.phase = "after the storms"
    await asyncio.sleep(args.heartbeat * 2)  # departures flushed, a heartbeat or two
    await asyncio.to_thread(sample, bench, "after the storms")
    result["after_storms"] = await counted(bench)
    bench.phase = "close"
    result["closed"] = sum(await bench.command("close"))
    await asyncio.sleep(3)
    await asyncio.to_thread(sample, bench, "3 s after close")
    bench.phase = "after close"
    await asyncio.sleep(args.heartbeat * 6)  # stale (4 heartbeats) + a sweep
    await asyncio.to_thread(sample, bench, "after the sweep")
    for prober in probers:
        prober.cancel()
    result["pages"] = {phase: percentiles(values) for phase, values in bench.latencies.items()}
    result["pages_other_process"] = {phase: percentiles(v) for phase, v in bench.page_latencies.items()}
    result["samples"] = bench.samples
    return result


def setup(args: argparse.Namespace, var_dir: Path) -> Stack:
    extra = {
        "CROWDTRAIN_SOCKET_HEARTBEAT_SECONDS": str(args.heartbeat),
        "DJANGO_DEBUG": "0",  # as in production (and benchmarks/server/throughput.py)
        # The connect throttle counts reconnects per address in a minute: a storm's retries would hit it.
        "CROWDTRAIN_WS_CONNECTS_PER_MINUTE_IP": str(10 * (args.volunteers + 2 * args.storm)),
    }
    # Two daphnes: the volunteers connect to the first; the second serves the probe's pages only. The priority
    # is set after construction: a tree older than Stack.web_nice (a baseline run, see above) ignores it.
    stack = Stack(var_dir=var_dir, database=args.database, redis_db=args.redis_db, extra_env=extra, webs=2)
    stack.web_nice = (0, args.page_pool_nice)
    return stack


def niceness(stack: Stack) -> dict[str, int]:
    """What each daphne runs at (a negative niceness asked for without root is not granted)."""
    return {name: os.getpriority(os.PRIO_PROCESS, stack.processes[name].pid) for name in stack.web_ports}


def django_for(stack: Stack) -> None:
    os.environ.update({k: v for k, v in stack.env().items() if k != "PYTHONUNBUFFERED"})
    import django

    django.setup()


def table(result: dict[str, Any]) -> str:
    cfg, ramp_, samples = result["config"], result["ramp"], result["samples"]
    lines = [
        f"Sockets on one daphne: N={cfg['volunteers']} idle volunteers, K={cfg['storm']} reconnects, "
        f"{cfg['client_processes']} client processes, RLIMIT_NOFILE {cfg['open_files']['hard']}, "
        f"niceness {json.dumps(result.get('niceness'))}"
    ]
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
    other = result.get("pages_other_process", {})
    lines.append(
        f"  {'page /':<22}{'the sockets daphne: n':>22}{'p50 ms':>9}{'p99 ms':>9}{'max ms':>9}"
        f"{'another daphne: n':>19}{'p50 ms':>9}{'p99 ms':>9}{'max ms':>9}"
    )
    for phase, p in result["pages"].items():
        q = other.get(phase, {"n": 0})
        lines.append(
            f"  {phase:<22}{p['n']:>22}{p.get('p50_ms', '-'):>9}{p.get('p99_ms', '-'):>9}"
            f"{p.get('max_ms', '-'):>9}{q['n']:>19}{q.get('p50_ms', '-'):>9}{q.get('p99_ms', '-'):>9}"
            f"{q.get('max_ms', '-'):>9}"
        )
    gc_ = result.get("gc_pauses")
    if gc_:
        lines.append(
            f"  daphne's full collections pausing >= {gc_['at_least_ms']} ms: {gc_['n']}, "
            f"{gc_['total_ms']} ms in all, longest {gc_['max_ms']} ms"
        )
    for side in result.get("side_by_side", []):
        lines.append(f"  {side['label']}: {json.dumps({k: v for k, v in side.items() if k != 'label'})}")
    lines.append(f"  before (issue 15): {json.dumps(BEFORE)}")
    lines.append(f"  previous run: {json.dumps(PREVIOUS)}")
    return "\n".join(lines)


def gc_pauses(log: str) -> dict[str, Any] | None:
    """daphne's full collections that paused its loop LOG_PAUSE_MS or more, as config/heap.py logs them
    (None from code that does not log them)."""
    started = GC_STARTED.search(log)
    if started is None:
        return None
    pauses = [float(ms) for ms in GC_PAUSE.findall(log)]
    return {
        "at_least_ms": float(started.group(1)),
        "n": len(pauses),
        "total_ms": round(sum(pauses), 1),
        "max_ms": round(max(pauses, default=0.0), 1),
    }


def run(args: argparse.Namespace, var_dir: Path) -> dict[str, Any]:
    with setup(args, var_dir) as stack:
        django_for(stack)
        nice = niceness(stack)
        started = time.monotonic()
        volunteers = make_volunteers(args.volunteers)
        seeded = round(time.monotonic() - started, 2)
        bench = Bench(stack=stack, clients=start_clients(stack, volunteers, args.per_client))
        try:
            result = asyncio.run(scenario(bench, args))
        finally:
            stop_clients(bench)
        result["gc_pauses"] = gc_pauses(stack.log("web"))
    result["seed_seconds"] = seeded
    result["niceness"] = nice
    result["client_processes"] = len(bench.clients)
    return result


def main() -> None:
    args = parser().parse_args()
    args.storm = min(args.storm, args.volunteers)
    open_files = open_files_raised(args.volunteers)
    var_dir = Path(tempfile.mkdtemp(prefix="crowdtrain-sockets-bench-"))
    result = run(args, var_dir)
    result["config"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    result["config"].update(open_files=open_files, client_processes=result.pop("client_processes"))
    result["before"] = {**BEFORE, "previous_run": PREVIOUS}
    if args.baseline:
        result["side_by_side"] = [summary(json.loads(args.baseline.read_text())), summary(result)]
    print(table(result))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.output} (stack logs in {var_dir})")


if __name__ == "__main__":
    main()
