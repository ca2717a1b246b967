"""The web process's garbage collector (config/heap.py) and the cycles a finished connection leaves
(config/web_server.unlink): what is alive at a tick is frozen out of the collector, a frozen cycle that dies
is still freed once the frozen heap has doubled, and a closed connection's objects are freed by their
reference counts, with no collection at all."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from unittest import mock

import pytest
from daphne.http_protocol import HTTPFactory, WebRequest
from daphne.ws_protocol import WebSocketProtocol
from twisted.internet.defer import Deferred
from twisted.internet.testing import StringTransport
from twisted.web.http import HTTPChannel

from config import heap
from config.heap import Heap
from config.web_server import WatchingServer, unlink


class Node:
    def __init__(self) -> None:
        self.other: object = self


@pytest.fixture
def started() -> Iterator[Heap]:
    gc.collect()
    threshold = gc.get_threshold()
    state = Heap()
    state.start()
    try:
        yield state
    finally:
        gc.callbacks.remove(state._collected)
        gc.unfreeze()
        gc.set_threshold(*threshold)


def test_what_is_alive_at_a_tick_is_frozen_out_of_the_collector(started: Heap) -> None:
    kept = [Node() for _ in range(1000)]
    before = gc.get_freeze_count()
    started.tick()
    assert gc.get_freeze_count() >= before + len(kept)
    walked = {id(o) for o in gc.get_objects()}  # what a full collection walks: not the frozen
    assert not any(id(k) in walked for k in kept)
    made_after = Node()
    assert id(made_after) in {id(o) for o in gc.get_objects()}


def full_collections_while_made(count: int) -> int:
    """Full collections the collector starts by itself while `count` containers are made and kept."""
    full: list[int] = []

    def seen(phase: str, info: dict[str, int]) -> None:
        if phase == "start" and info["generation"] == 2:
            full.append(1)

    gc.callbacks.append(seen)
    try:
        kept: list[list[int]] = [[] for _ in range(count)]
    finally:
        gc.callbacks.remove(seen)
    del kept
    return len(full)


def test_the_collector_starts_no_full_collection_by_itself(started: Heap) -> None:
    """What lives through the younger collections reaches the oldest generation, which the collector walked
    whole once it held a quarter of what its last full walk kept (about the frozen count here): the presence
    heartbeat's burst did that 3-4 times a heartbeat at 19,000 volunteers, finding no garbage."""
    enough = gc.get_freeze_count() // 4 + 200_000
    assert full_collections_while_made(enough) == 0
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, 10)  # the collector's default
    assert full_collections_while_made(enough) >= 1


class Leaf:
    pass


def test_a_frozen_object_that_dies_without_a_cycle_is_freed_at_once(started: Heap) -> None:
    holder = [Leaf()]
    alive = weakref.ref(holder[0])
    started.tick()
    holder.clear()
    assert alive() is None


def test_a_dead_frozen_cycle_is_freed_once_the_process_has_doubled(started: Heap) -> None:
    peak = [started.clean]
    started.size = lambda: peak[0]  # the peak RSS, as the valve reads it
    cycle = Node()
    dead = weakref.ref(cycle)
    started.tick()
    del cycle
    gc.collect()
    assert dead() is not None  # a frozen cycle waits
    peak[0] = 2 * started.clean + 1
    started.tick()
    assert started.valve_opened == 1 and dead() is None
    assert started.clean == peak[0]  # the valve's walk sets the next doubling's base


def test_the_valve_stays_shut_while_the_process_has_not_doubled(started: Heap) -> None:
    started.size = lambda: 2 * started.clean
    cycle = Node()
    dead = weakref.ref(cycle)
    started.tick()
    del cycle
    started.tick()
    assert started.valve_opened == 0 and dead() is not None


def test_a_tick_reads_the_peak_rss_without_walking_the_frozen_list(monkeypatch: pytest.MonkeyPatch) -> None:
    """gc.get_freeze_count() walks the frozen list: twice a second at 3,000 volunteers it was 26% of daphne's
    CPU. A tick must not call it."""
    state = Heap()
    state.start()
    try:
        monkeypatch.setattr(gc, "get_freeze_count", mock.Mock(side_effect=AssertionError("walked")))
        state.pauses = [25.0]
        state.tick()
        assert heap.peak_rss_kb() > 0
    finally:
        gc.callbacks.remove(state._collected)
        gc.unfreeze()


def without_collector(make: object) -> None:
    assert callable(make)
    gc.disable()
    try:
        make()
    finally:
        gc.enable()


def test_a_closed_websocket_is_freed_by_reference_counts() -> None:
    def make() -> None:
        protocol = WebSocketProtocol()
        protocol.is_closed = Deferred()  # txaio's future under Twisted
        protocol.is_closed.callback(protocol)  # as autobahn resolves it when the socket closes
        gone = weakref.ref(protocol)
        unlink(protocol)
        del protocol
        assert gone() is None

    without_collector(make)


def test_a_request_that_became_a_websocket_is_freed_by_reference_counts() -> None:
    def make() -> None:
        server = WatchingServer(application=None, endpoints=["tcp:port=0"])
        server.connections = {}
        channel = HTTPChannel()
        channel.factory = HTTPFactory(server)
        channel.transport = StringTransport()  # type: ignore[assignment]  # zope's ITransport, unseen by mypy
        request = WebRequest(channel, queued=False)
        channel.requests.append(request)  # as Twisted does while the request is served
        gone = weakref.ref(request), weakref.ref(channel)
        del server.connections[request]  # reaped by daphne's check
        unlink(request)
        del request, channel
        assert [ref() for ref in gone] == [None, None]

    without_collector(make)


def test_without_unlinking_the_same_objects_wait_for_a_collection() -> None:
    def make() -> None:
        protocol = WebSocketProtocol()
        protocol.is_closed = Deferred()
        protocol.is_closed.callback(protocol)
        gone = weakref.ref(protocol)
        del protocol
        assert gone() is not None
        gc.collect()
        assert gone() is None

    without_collector(make)
