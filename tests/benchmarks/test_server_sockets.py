"""The sockets benchmark reads daphne's collector pauses from the lines config/heap.py logs."""

from __future__ import annotations

import gc
import logging

import pytest

from benchmarks.server import sockets
from config.heap import Heap


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
