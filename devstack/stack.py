"""The real platform as separate processes: daphne, Celery workers and beat, on PostgreSQL and Redis."""

from __future__ import annotations

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
        urllib.request.urlopen(url + "/", timeout=2)
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


def recreate_database(name: str) -> str:
    admin_url = os.environ.get("E2E_ADMIN_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
    name = DATABASE_PREFIX + name
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')
    return admin_url.rsplit("/", 1)[0] + f"/{name}"


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
    startup_timeout: float = 60  # seconds for daphne to answer (its imports take minutes on a loaded machine)
    # Horizontal scale as in production: N daphne processes (the first on `port`, the others on free ports;
    # the channel layer in Redis joins them) and N Celery workers on both queues.
    webs: int = 1
    workers: int = 1
    web_ports: dict[str, int] = field(default_factory=dict)
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
        subprocess.run([PYTHON, "manage.py", *args], cwd=ROOT, env=self.env(), check=True)

    def start(self) -> None:
        self.database_url = recreate_database(self.database)
        import redis

        redis.Redis.from_url(self.env()["REDIS_URL"]).flushdb()
        self.manage("migrate", "--verbosity", "0")
        self.manage("ensure_admin")
        self.manage("seed_demo", *self.seed_args)
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
            self._spawn(name, "-m", WEB_SERVER, *listen, *DAPHNE_LIMITS, ASGI_APP)
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

    def _spawn(self, name: str, *args: str, nice: int = 0) -> None:
        log = (self.var_dir / f"{name}.log").open("wb")
        self.processes[name] = subprocess.Popen(
            [*(["nice", "-n", str(nice)] if nice else []), PYTHON, *args],
            cwd=ROOT,
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
