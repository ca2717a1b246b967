"""`manage.py runplatform`: run the whole platform locally (redis, daphne, celery workers and beat)."""

from __future__ import annotations

import os
import sys
import threading
from argparse import ArgumentParser
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from config import supervisor
from config.supervisor import Child, emit

ASGI_APP = "config.asgi:application"
ANY_ADDRESS = {"0.0.0.0", "::", ""}


def daphne_limits() -> list[str]:
    # Results arrive as one binary WebSocket frame; daphne's 1 MiB default would drop larger models' updates.
    size = str(settings.CROWDTRAIN["MAX_RESULT_BYTES"] + 2**20)
    return ["--websocket-max-message-size", size, "--websocket-max-frame-size", size]


# A storm of reconnects arrives at once: with Twisted's default listen backlog (50), the kernel dropped the
# SYNs past it and each of those clients waited 1, 3, 7 s to try again. The kernel caps it at somaxconn.
LISTEN_BACKLOG = 4096
# daphne closes a WebSocket the application has not accepted within this many seconds (its default: 5).
CONNECT_TIMEOUT_SECONDS = 30


def daphne_listen(host: str, port: int) -> list[str]:
    """daphne's listening socket (an endpoint string, as `-b`/`-p` allow no backlog) and handshake limit."""
    interface = host.replace(":", "\\:")  # endpoint strings escape an IPv6 address's colons
    endpoint = f"tcp:port={port}:interface={interface}:backlog={LISTEN_BACKLOG}"
    return ["-e", endpoint, "--websocket_connect_timeout", str(CONNECT_TIMEOUT_SECONDS)]


def worker_args() -> list[str]:
    """A Celery worker on both queues, one task at a time. Validations run side by side with a thread or
    prefork pool, but with either, a Redis restart with tasks in flight crashed the worker (kombu's
    restore of unacknowledged messages after the connection loss) in the chaos test; the solo pool
    survives it most of the time, and the supervisor starts it again when it does not. Scale out with
    more worker processes instead (validator_args)."""
    return ["worker", "-Q", "celery,validation", "--pool", "solo"]


def validator_args() -> list[str]:
    """A second worker, for the validation queue only: a round's results arrive together, and with the
    server's recomputations they are most of the server's work. Two processes use both cores."""
    return ["worker", "-Q", "validation", "--pool", "solo", "-n", "validator@%h"]


# The baseline worker's niceness: the kernel gives it CPU only when the others leave some.
BASELINE_NICE = 19


def baseline_args() -> list[str]:
    """A third worker, for the `baseline` queue only: the one-CPU time-to-accuracy baselines train for
    minutes each, so they get a process of their own (concurrency 1) that nothing else waits behind, run at
    the lowest CPU priority (`nice`) so that it never slows validation or a round."""
    return ["worker", "-Q", "baseline", "--pool", "solo", "-n", "baseline@%h"]


def platform_children(host: str, port: int, beat_schedule: Path) -> list[Child]:
    """daphne, three celery workers and celery beat, all run by this very interpreter."""
    python = [sys.executable, "-m"]
    celery = [*python, "celery", "-A", "config"]
    return [
        # daphne with a connection check that scales (config/web_server.py).
        Child("web", [*python, "config.web_server", *daphne_listen(host, port), *daphne_limits(), ASGI_APP]),
        Child("worker", [*celery, *worker_args(), "-l", "info"]),
        Child("validator", [*celery, *validator_args(), "-l", "info"]),
        Child("baseline", ["nice", "-n", str(BASELINE_NICE), *celery, *baseline_args(), "-l", "info"]),
        Child("beat", [*celery, "beat", "-l", "info", "-s", str(beat_schedule)]),
    ]


class Command(BaseCommand):
    help = "Run redis (bundled, unless REDIS_URL is set), daphne, celery workers and celery beat."

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("--host", default=os.environ.get("HOST", "127.0.0.1"))
        parser.add_argument("--port", type=int, default=int(os.environ.get("PORT", "8000")))

    def handle(self, *args: Any, host: str, port: int, **options: Any) -> None:
        if supervisor.port_open("127.0.0.1" if host in ANY_ADDRESS else host, port):
            raise CommandError(f"Port {port} is in use: stop what uses it, or set PORT=<another port>.")
        settings.VAR_DIR.mkdir(parents=True, exist_ok=True)  # beat's schedule, the bundled redis's data
        stopping = supervisor.install_stop_handlers()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        services: list[Child] = []  # stopped last: the apps need them to shut down cleanly
        apps: list[Child] = []
        dead: Child | None = None
        restarts = supervisor.Restarts()
        try:
            if "REDIS_URL" not in os.environ:
                env["REDIS_URL"] = self.start_redis(services, env)
            for child in platform_children(host, port, settings.VAR_DIR / "celerybeat-schedule"):
                supervisor.start(child, env, settings.BASE_DIR)
                apps.append(child)
            self.announce_when_listening(apps[0], host, port)
            dead = supervisor.supervise(services + apps, stopping, restarts)
        finally:
            emit("platform", "stopping...")
            supervisor.stop(apps)
            supervisor.stop(services)
        if dead is not None:
            code = dead.proc.returncode if dead.proc else None
            raise CommandError(
                f"{dead.name} kept exiting ({restarts.limit + 1} times within {restarts.window:.0f}s, "
                f"last exit code {code}); stopped the others."
            )
        emit("platform", "stopped.")

    def start_redis(self, children: list[Child], env: dict[str, str]) -> str:
        port = supervisor.free_port()
        redis = Child("redis", supervisor.redis_argv(settings.VAR_DIR / "redis", port))
        supervisor.start(redis, env, settings.BASE_DIR)
        children.append(redis)
        if not supervisor.wait_for_port("127.0.0.1", port, 20, lambda: supervisor.alive(redis)):
            raise CommandError("the bundled redis-server did not start; see the [redis] lines above")
        return f"redis://127.0.0.1:{port}/0"

    def announce_when_listening(self, web: Child, host: str, port: int) -> None:
        probe = "127.0.0.1" if host in ANY_ADDRESS else host

        def watch() -> None:
            if supervisor.wait_for_port(probe, port, 120, lambda: supervisor.alive(web)):
                emit("platform", f"Crowdtrain is running: open http://{probe}:{port}/  (Ctrl-C stops it all)")

        threading.Thread(target=watch, daemon=True, name="announce").start()
