"""The sockets benchmark reads daphne's collector pauses from the lines config/heap.py logs, and runs the page
pool at its own CPU priority."""

from __future__ import annotations

import gc
import logging
import os
import time
from pathlib import Path

import pytest

from benchmarks.server import sockets
from config.heap import Heap
from devstack.stack import Stack


def test_the_benchmark_reads_the_pauses_the_heap_logs(caplog: pytest.LogCaptureFixture) -> None:
    heap = Heap()
    heap.pauses = [25.0, 130.5, 3.0]  # the last, under LOG_PAUSE_MS, is logged at DEBUG
    with caplog.at_level(logging.INFO, logger="config.heap"):
        heap.start()
        gc.callbacks.remove(heap._collected)
        gc.unfreeze()
        heap._log()
    assert sockets.gc_pauses(caplog.text) == {"at_least_ms": 20.0, "n": 2, "total_ms": 155.5, "max_ms": 130.5}
    assert heap.pauses == []


def test_a_real_full_collection_is_timed() -> None:
    heap = Heap()
    gc.callbacks.append(heap._collected)
    try:
        gc.collect()
    finally:
        gc.callbacks.remove(heap._collected)
    assert len(heap.pauses) == 1 and heap.pauses[0] > 0


def test_code_that_does_not_log_pauses_reads_as_none_not_as_no_pause() -> None:
    assert sockets.gc_pauses("") is None
    started = "INFO config.heap: heap: started; 5 objects frozen; pauses from 20 ms logged"
    assert sockets.gc_pauses(started) == {"at_least_ms": 20.0, "n": 0, "total_ms": 0.0, "max_ms": 0.0}


def test_the_page_pool_runs_at_its_own_cpu_priority(tmp_path: Path) -> None:
    """The second daphne (the page pool) at --page-pool-nice, as compose's cpu_shares weighs it."""
    args = sockets.parser().parse_args([])
    assert args.page_pool_nice == sockets.PAGE_POOL_NICE < 0
    assert sockets.setup(args, tmp_path).web_nice == (0, sockets.PAGE_POOL_NICE)
    args = sockets.parser().parse_args(["--page-pool-nice", "0"])
    assert sockets.setup(args, tmp_path).web_nice == (0, 0)


def test_each_daphne_is_started_at_its_niceness_and_the_benchmark_reads_it(tmp_path: Path) -> None:
    stack = Stack(var_dir=tmp_path, web_nice=(0, 7), web_ports={"web": 1, "web-2": 2})
    assert [stack.web_niceness(index) for index in range(3)] == [0, 7, 0]  # past the tuple: 0
    idle = ("-c", "import time; print('up', flush=True); time.sleep(60)")
    stack._spawn("web", *idle, nice=stack.web_niceness(0))
    stack._spawn("web-2", *idle, nice=stack.web_niceness(1))
    try:
        _wait_for_output(tmp_path / "web.log", tmp_path / "web-2.log")  # `nice` has run and Python with it
        assert sockets.niceness(stack) == {"web": os.nice(0), "web-2": os.nice(0) + 7}
    finally:
        for process in stack.processes.values():
            process.kill()
            process.wait()


def _wait_for_output(*logs: Path, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(log.exists() and log.read_text() for log in logs):
        assert time.monotonic() < deadline, f"no output in {logs} after {timeout} s"
        time.sleep(0.05)
