"""`manage.py runplatform` really runs redis, daphne, the celery workers and beat, starts again one that
dies, and stops them all."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

# The suite's own settings (tests/environment.py) must not leak in: runplatform runs as a new user would.
SCRUBBED = ("REDIS_URL", "CELERY_BROKER_URL", "DATABASE_URL", "CELERY_TASK_ALWAYS_EAGER", "DJANGO_ENV")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def parent_pid(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])


def descendants(root: int) -> set[int]:
    """Every live process below `root`, found through /proc (children, grandchildren, ...)."""
    parents = {int(p.name): parent_pid(int(p.name)) for p in Path("/proc").iterdir() if p.name.isdigit()}
    found: set[int] = set()
    frontier = {root}
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier} - found
        found |= frontier
    return found


def running(pid: int) -> bool:
    """True unless the process is gone or a zombie (exited, waiting to be reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in {"Z", "X"}


def wait_until(condition: Callable[[], bool], timeout: float, what: str, output: list[str]) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.5)
    tail = "".join(output[-60:])
    pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}; runplatform said:\n{tail}")


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def celery_worker(pids: set[int]) -> int:
    """The pid of the worker on both queues (not the validator's, nor the baseline's)."""
    for pid in pids:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if b"celery,validation" in argv:
            return pid
    raise AssertionError(f"no celery worker among {pids}")


def test_runplatform_starts_everything_and_stops_cleanly_on_ctrl_c(tmp_path: Path) -> None:
    port = free_port()
    env = {key: value for key, value in os.environ.items() if key not in SCRUBBED}
    env |= {"CROWDTRAIN_VAR_DIR": str(tmp_path / "var"), "PORT": str(port), "NO_COLOR": "1"}
    manage = [sys.executable, str(ROOT / "manage.py")]
    subprocess.run([*manage, "migrate", "--noinput"], cwd=ROOT, env=env, check=True, capture_output=True)

    proc = subprocess.Popen(
        [*manage, "runplatform"],
        cwd=ROOT,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(iter(proc.stdout.readline, "")), daemon=True)  # type: ignore[union-attr]
    reader.start()
    children: set[int] = set()
    try:
        said = lambda *words: any(all(word in line for word in words) for line in output)  # noqa: E731
        wait_until(lambda: http_ok(f"http://127.0.0.1:{port}/"), 120, "the home page", output)
        wait_until(lambda: said("[worker]", "ready."), 120, "the worker", output)
        wait_until(lambda: said("[validator]", "validator@", "ready."), 120, "the validator", output)
        wait_until(lambda: said("[platform]", f"open http://127.0.0.1:{port}/"), 10, "the URL", output)
        children = descendants(proc.pid)
        assert len(children) >= 5, f"expected redis, web, worker, validator and beat; found pids {children}"
        for name in ("[redis]", "[web]", "[worker]", "[validator]", "[beat]"):
            assert any(line.startswith(name) for line in output), f"no {name} lines"

        # A worker that dies (kombu can kill one on a Redis restart) is started again; the rest stay up.
        os.kill(celery_worker(children), signal.SIGKILL)
        died = lambda: said("[platform]", "worker exited (exit code -9)")  # noqa: E731
        wait_until(died, 30, "the death noticed", output)
        times_ready = lambda: sum("[worker]" in line and "ready." in line for line in output)  # noqa: E731
        wait_until(lambda: times_ready() == 2, 120, "the worker started again", output)
        assert http_ok(f"http://127.0.0.1:{port}/")
        children = descendants(proc.pid)

        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=90) == 0, "".join(output[-60:])
        reader.join(timeout=10)
        leftovers = {pid for pid in children if running(pid)}
        assert not leftovers, f"still running after runplatform exited: {leftovers}"
        assert any("stopped." in line for line in output)
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in children | descendants(proc.pid):
            if running(pid):
                os.kill(pid, signal.SIGKILL)
