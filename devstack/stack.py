"""The real platform as separate processes: daphne, Celery workers and beat, on PostgreSQL and Redis."""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

import psycopg

from config.management.commands.runplatform import (
    BASELINE_NICE,
    baseline_args,
    daphne_listen,
    validator_args,
    worker_args,
)

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
ASGI_APP = "config.asgi:application"
WEB_SERVER = "config.web_server"  # daphne, with a connection check that scales (config/web_server.py)
# Results arrive as one WebSocket frame (CROWDTRAIN_MAX_RESULT_BYTES' default, plus headroom).
FRAME_LIMIT = str(129 * 2**20)
DAPHNE_LIMITS = ("--websocket-max-message-size", FRAME_LIMIT, "--websocket-max-frame-size", FRAME_LIMIT)


def replica(role: str, index: int) -> str:
    """The process name of replica `index` of `role`: the first keeps the plain name (web, worker)."""
    return role if index == 0 else f"{role}-{index + 1}"


def _answers(url: str) -> bool:
    try:
        # A first request on a loaded machine can take seconds (2 s aborted one in CI), and the wait ends at
        # the first answer, so a long bound costs nothing when the machine is quick.
        urllib.request.urlopen(url + "/", timeout=15)
    except OSError:
        return False
    return True


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# Several checkouts on one machine (a developer's worktrees) run their stacks side by side: each sets its own
# database-name prefix and Redis server, so one run's DROP DATABASE or FLUSHDB never hits another's.
DATABASE_PREFIX = os.environ.get("CROWDTRAIN_STACK_DB_PREFIX", "")
REDIS_SERVER = os.environ.get("CROWDTRAIN_STACK_REDIS", "redis://127.0.0.1:6379")


ADMIN_URL = os.environ.get("E2E_ADMIN_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
MIGRATED = "crowdtrain_migrated_"  # + a digest of the migrations: a migrated, empty database to copy


def recreate_database(name: str, template: str | None = None) -> str:
    """A new database `name` (prefixed), empty or a copy of the database `template` (prefixed too)."""
    name = DATABASE_PREFIX + name
    copy = f' TEMPLATE "{DATABASE_PREFIX + template}"' if template else ""
    with psycopg.connect(ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"{copy}')
    return ADMIN_URL.rsplit("/", 1)[0] + f"/{name}"


def migrations_digest(root: Path) -> str:
    """What a migrated database depends on: the project's migrations and the pinned packages (theirs)."""
    digest = hashlib.sha256()
    paths = [*root.glob("*/migrations/*.py"), root / "requirements.txt"]
    for path in sorted(p for p in paths if p.is_file()):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def _database_exists(conn: psycopg.Connection[tuple[object, ...]], name: str) -> bool:
    return conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone() is not None


def _publish_template(building: str, template: str) -> None:
    """Rename the database just migrated to the template's name, and drop the templates of other migrations
    (each run after a migration changed would leave one behind). Another session may have won the race."""
    prefixed = DATABASE_PREFIX + template
    with psycopg.connect(ADMIN_URL, autocommit=True) as conn:
        if _database_exists(conn, prefixed):
            conn.execute(f'DROP DATABASE "{DATABASE_PREFIX + building}" WITH (FORCE)')
            return
        conn.execute(f'ALTER DATABASE "{DATABASE_PREFIX + building}" RENAME TO "{prefixed}"')
        stale = conn.execute(
            "SELECT datname FROM pg_database WHERE starts_with(datname, %s) AND datname <> %s",
            (DATABASE_PREFIX + MIGRATED, prefixed),
        ).fetchall()
        for (name,) in stale:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@dataclass
class Stack:
    var_dir: Path
    database: str = "crowdtrain_e2e"
    redis_db: int = 14
    port: int = field(default_factory=free_port)
    database_url: str = ""
    seed_args: tuple[str, ...] = ("--no-fashion",)
    extra_env: dict[str, str] = field(default_factory=dict)
    round_timeout: int | None = None  # seconds, for every seeded project (None: the demo's own)
    # Seconds for daphne to answer. Its imports take minutes on a loaded machine (60 s ran out in CI while the
    # browser tests ran beside it); a process that dies while starting fails the start at once anyway.
    startup_timeout: float = 600
    # Horizontal scale as in production: N daphne processes (the first on `port`, the others on free ports;
    # the channel layer in Redis joins them) and N Celery workers on both queues.
    webs: int = 1
    workers: int = 1
    # Each daphne's niceness, by index (those past the end: 0). Negative values need root; `nice` then warns
    # and starts the process at 0 (the sockets benchmark reads and reports what each got).
    web_nice: tuple[int, ...] = ()
    web_ports: dict[str, int] = field(default_factory=dict)
    setup_code: str = ""  # Python run by `manage.py shell` once the demo is seeded, before any process starts
    root: Path = ROOT  # the checkout whose code the processes run (benchmarks compare two trees)
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def urls(self) -> list[str]:
        """Every daphne's address, in process order (`url` first)."""
        return [f"http://127.0.0.1:{port}" for port in self.web_ports.values()] or [self.url]

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k != "CELERY_TASK_ALWAYS_EAGER"}
        env.update(
            DATABASE_URL=self.database_url,
            REDIS_URL=f"{REDIS_SERVER}/{self.redis_db}",
            CROWDTRAIN_VAR_DIR=str(self.var_dir),
            CROWDTRAIN_ADMIN_USER="admin",
            CROWDTRAIN_ADMIN_PASSWORD="admin-e2e-password",
            CROWDTRAIN_EVAL_EVERY="5",
            DJANGO_SETTINGS_MODULE="config.settings",
            PYTHONUNBUFFERED="1",
        )
        env.update(self.extra_env)
        return env

    def manage(self, *args: str) -> None:
        subprocess.run([PYTHON, "manage.py", *args], cwd=self.root, env=self.env(), check=True)

    def manage_all(self, *commands: tuple[str, ...]) -> None:
        """Several management commands, in order, in one process: each manage.py process spends seconds
        importing Django (and torch) before it does anything, and every test stack starts with three."""
        calls = "; ".join(f"call_command(*{list(command)!r})" for command in commands)
        script = f"import django; django.setup(); from django.core.management import call_command; {calls}"
        subprocess.run([PYTHON, "-c", script], cwd=self.root, env=self.env(), check=True)

    def migrated_template(self) -> str:
        """The name of a database with every migration applied and nothing else, made once per set of
        migrations: replaying them costs each test stack 5-15 s, copying the result a fraction of one."""
        template = MIGRATED + migrations_digest(self.root)
        with psycopg.connect(ADMIN_URL, autocommit=True) as conn:
            if _database_exists(conn, DATABASE_PREFIX + template):
                return template
        building = f"crowdtrain_migrating_{os.getpid()}"
        own_url, self.database_url = self.database_url, recreate_database(building)
        try:
            self.manage_all(("migrate", "--verbosity", "0"))
        finally:
            self.database_url = own_url
        _publish_template(building, template)
        return template

    def fresh_database(self) -> None:
        """This stack's database, new and migrated, and its Redis database empty."""
        self.database_url = recreate_database(self.database, template=self.migrated_template())
        import redis

        redis.Redis.from_url(self.env()["REDIS_URL"]).flushdb()

    def start(self) -> None:
        self.fresh_database()
        code = (("shell", "-c", self.setup_code),) if self.setup_code else ()
        self.manage_all(("ensure_admin",), ("seed_demo", *self.seed_args), *code)
        if self.round_timeout is not None:
            with psycopg.connect(self.database_url) as conn:
                conn.execute("UPDATE projects_project SET round_timeout = %s", (self.round_timeout,))
        self.spawn_processes()

    def __enter__(self) -> Self:
        """Started, and stopped again whatever happens (a start that fails half-way included)."""
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def spawn_processes(self) -> None:
        """daphne, the Celery workers and beat, each its own process, as in production."""
        for index in range(self.webs):
            name = replica("web", index)
            port = self.web_ports.setdefault(name, self.port if index == 0 else free_port())
            listen = daphne_listen("127.0.0.1", port)
            nice = self.web_niceness(index)
            self._spawn(name, "-m", WEB_SERVER, *listen, *DAPHNE_LIMITS, ASGI_APP, nice=nice)
        for index in range(self.workers):
            name = replica("worker", index)
            # Celery's node names must differ, or the workers' control commands (and logs) mix them up.
            node = ("-n", f"{name}@%h") if index else ()
            self._spawn(name, "-m", "celery", "-A", "config", *worker_args(), *node, "-l", "info")
        self._spawn("validator", "-m", "celery", "-A", "config", *validator_args(), "-l", "info")
        self._spawn(
            "baseline", "-m", "celery", "-A", "config", *baseline_args(), "-l", "info", nice=BASELINE_NICE
        )
        self._spawn(
            "beat",
            "-m",
            "celery",
            "-A",
            "config",
            "beat",
            "-l",
            "info",
            "--schedule",
            str(self.var_dir / "beat-schedule"),
        )
        self._wait_for_http(self.startup_timeout)

    def web_niceness(self, index: int) -> int:
        return self.web_nice[index] if index < len(self.web_nice) else 0

    def _spawn(self, name: str, *args: str, nice: int = 0) -> None:
        log = (self.var_dir / f"{name}.log").open("wb")
        self.processes[name] = subprocess.Popen(
            [*(["nice", "-n", str(nice)] if nice else []), PYTHON, *args],
            cwd=self.root,
            env=self.env(),
            stdout=log,
            stderr=subprocess.STDOUT,
        )

    def _wait_for_http(self, timeout: float = 60, urls: list[str] | None = None) -> None:
        deadline = time.monotonic() + timeout
        for url in self.urls if urls is None else urls:
            while not _answers(url):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"daphne did not answer on {url}; see {self.var_dir}/web*.log")
                self._fail_if_dead()
                time.sleep(0.5)

    def _fail_if_dead(self) -> None:
        """A process that died while starting (an import error) fails the start now, not at the timeout."""
        dead = [name for name, process in self.processes.items() if process.poll() is not None]
        if dead:
            raise RuntimeError(f"{', '.join(dead)} exited while starting; see their logs in {self.var_dir}")

    def stop(self) -> None:
        for process in self.processes.values():
            process.terminate()
        for process in self.processes.values():
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()

    def log(self, name: str) -> str:
        return (self.var_dir / f"{name}.log").read_text(errors="replace")

    def results_summary(self) -> str:
        """Every project's results by volunteer, status and verdict (a failing end-to-end test prints it: who
        was sent what, what came back, how long it took and why anything was refused)."""
        with psycopg.connect(self.database_url) as conn:
            rows = conn.execute(RESULTS_SUMMARY).fetchall()
        header = (
            "project | volunteer | status | validation | reason | results | samples | compute s | turnaround"
        )
        return "\n".join([header, *(" | ".join(str(value) for value in row) for row in rows)])

    def failure_report(self, console: list[str]) -> str:
        """What a failing training test prints: the results, the volunteer browser's last console lines (its
        Web Worker's too) and the validator's log."""
        return "\n".join(
            ["results:", self.results_summary(), "browser console:", *console[-40:], "validator log:"]
            + [self.log("validator")[-2000:]]
        )


RESULTS_SUMMARY = """
SELECT p.name, u.username, r.status, r.validation, left(r.reason, 60), count(*), sum(r.samples),
       round(avg(r.compute_ms) / 1000.0, 1),
       round(avg(extract(epoch FROM r.received_at - r.sent_at))::numeric, 1)
FROM projects_result r
JOIN projects_workunit w ON w.id = r.work_unit_id
JOIN projects_project p ON p.id = w.project_id
JOIN auth_user u ON u.id = r.volunteer_id
GROUP BY 1, 2, 3, 4, 5 ORDER BY 1, 2, 3, 4, 5
"""
