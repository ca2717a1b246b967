"""config/supervisor.py: a child that dies is started again after a back-off; one that keeps dying is
given up on."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from config import supervisor
from config.supervisor import Child, Restarts

# Dies (exit code 3) the first `n` times it runs, counted in a file; then stays up. The count is written to a
# side file and renamed over it: the test polls it, and write_text's truncation let it read "" (CI, once).
DIES_N_TIMES = """
import os, pathlib, sys, time
count = pathlib.Path(sys.argv[1])
runs = int(count.read_text()) if count.exists() else 0
count.with_suffix(".new").write_text(str(runs + 1))
os.replace(count.with_suffix(".new"), count)
if runs < int(sys.argv[2]):
    sys.exit(3)
time.sleep(60)
"""


def child(tmp_path: Path, deaths: int) -> Child:
    return Child("flaky", [sys.executable, "-c", DIES_N_TIMES, str(tmp_path / "runs"), str(deaths)])


def runs(tmp_path: Path) -> int:
    count = tmp_path / "runs"
    return int(count.read_text()) if count.exists() else 0


def supervise_in_background(
    children: list[Child], restarts: Restarts
) -> tuple[threading.Event, list[Child | None]]:
    """supervise() in a thread; `returned` gets what it returns."""
    stopping, returned = threading.Event(), list[Child | None]()

    def run() -> None:
        returned.append(supervisor.supervise(children, stopping, restarts))

    threading.Thread(target=run).start()
    return stopping, returned


def wait_for(condition: Callable[[], bool], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)


def test_the_back_off_doubles_up_to_a_cap_and_gives_up_on_a_crash_loop() -> None:
    restarts = Restarts(limit=5, window=60, first=1, longest=4)
    delays = [restarts.delay("worker", now=float(t)) for t in range(6)]
    assert delays == [1, 2, 4, 4, 4, None]
    assert restarts.delay("beat", now=5.0) == 1  # each child has its own count
    assert restarts.delay("worker", now=100.0) == 1  # deaths older than the window are forgotten


def test_a_child_that_dies_is_started_again(tmp_path: Path) -> None:
    flaky = child(tmp_path, deaths=2)
    supervisor.start(flaky, env={}, cwd=tmp_path)
    stopping, returned = supervise_in_background([flaky], Restarts(first=0.1, longest=0.2))
    try:
        wait_for(lambda: runs(tmp_path) >= 3)  # two deaths, then the run that stays up
        time.sleep(0.5)
        assert runs(tmp_path) == 3 and supervisor.alive(flaky)
    finally:
        stopping.set()
        supervisor.stop([flaky], grace=5)
    wait_for(lambda: bool(returned))
    assert returned == [None]  # asked to stop, not given up


def test_a_child_in_a_crash_loop_is_returned(tmp_path: Path) -> None:
    broken = child(tmp_path, deaths=1000)
    supervisor.start(broken, env={}, cwd=tmp_path)
    stopping, returned = supervise_in_background([broken], Restarts(limit=2, first=0.1, longest=0.1))
    wait_for(lambda: bool(returned))
    stopping.set()
    assert returned == [broken]
    assert runs(tmp_path) == 3  # started, then restarted twice, then given up on
    assert broken.proc is not None and broken.proc.returncode == 3


def test_a_healthy_child_is_left_alone(tmp_path: Path) -> None:
    steady = child(tmp_path, deaths=0)
    supervisor.start(steady, env={}, cwd=tmp_path)
    stopping, returned = supervise_in_background([steady], Restarts())
    stopping.wait(1.0)
    stopping.set()
    supervisor.stop([steady], grace=5)
    assert runs(tmp_path) == 1
