"""The peer ring (frontend/static/frontend/ring.js) between two Chromium pages on this machine: a PeerLink
each, their signals carried by the test (standing in for the server's `signal` messages), 5 MB each way
over the data channel with the SHA-256 digests checked on both ends against Python's; and a link whose ICE
candidates are dropped, which falls back to the relay callback with the same bytes. No Django database.

The bytes through the signalling path (what the server would carry with the ring) are printed beside the
payload (what it carries without)."""

from __future__ import annotations

import base64
import hashlib
import json
import random
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.browser.conftest import StaticServer
from tests.browser.parity import record

pytestmark = pytest.mark.browser

PAYLOAD_BYTES = 5_000_000
RELAYED_BYTES = 1_000_000
FALLBACK_TIMEOUT_MS = 1500


@dataclass
class Wire:
    """What the test carried between the pages: signals (as the server would) and relayed payloads."""

    drop_candidates: bool = False
    signal_bytes: int = 0
    signals: dict[str, int] = field(default_factory=dict)
    relayed_bytes: int = 0


def payload(seed: int, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def connect(pages: tuple[Any, Any], wire: Wire) -> None:
    """Each page's toPeer / relayToPeer reach the other page."""
    for here, there in (pages, pages[::-1]):
        here.expose_binding("toPeer", lambda _, msg, there=there: carry_signal(there, msg, wire))
        here.expose_binding("relayToPeer", lambda _, data, there=there: carry_relayed(there, data, wire))


def carry_signal(page: Any, msg: dict[str, Any], wire: Wire) -> None:
    wire.signals[msg["kind"]] = wire.signals.get(msg["kind"], 0) + 1
    if wire.drop_candidates and msg["kind"] == "candidate":
        return
    wire.signal_bytes += len(json.dumps(msg).encode())
    page.evaluate("(m) => ringHarness.fromPeer(m)", msg)


def carry_relayed(page: Any, data: str, wire: Wire) -> None:
    wire.relayed_bytes += len(base64.b64decode(data))
    page.evaluate("(d) => ringHarness.relayed(d)", data)


@pytest.fixture
def pages(browser: Any, static_server: StaticServer) -> Iterator[tuple[Any, Any]]:
    """Two pages in two contexts (separate storage, as two volunteers' browsers would have)."""
    contexts = [browser.new_context() for _ in range(2)]
    opened, errors = [], []
    for context in contexts:
        page = context.new_page()
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        opened.append(page)
    yield opened[0], opened[1]
    for context in contexts:
        context.close()
    assert not errors, errors


def open_link(pages: tuple[Any, Any], url: str, timeout_ms: int) -> list[str]:
    for page in pages:
        page.goto(f"{url}/harness/ring.html")
        page.wait_for_function("() => self.ringHarness")
    for page, initiator in zip(pages, (False, True), strict=True):
        page.evaluate("([i, t]) => ringHarness.start(i, t)", [initiator, timeout_ms])
    return [page.evaluate("() => ringHarness.opened()") for page in pages]


def send(page: Any, data: bytes) -> str:
    digest: str = page.evaluate("(d) => ringHarness.send(d)", b64(data))
    return digest


def report(name: str, wire: Wire, payload_bytes: int) -> None:
    """Printed, and kept in test-artifacts/ (parity.record) for the benchmark's table."""
    through_server = wire.signal_bytes + wire.relayed_bytes
    print(f"\n{name}: {through_server} bytes through the server for {payload_bytes} payload bytes")
    record(f"ring/{name}", {"server_bytes": through_server, "payload_bytes": payload_bytes, **wire.signals})


def test_two_pages_swap_5_mb_each_way_over_the_data_channel(pages: Any, static_server: StaticServer) -> None:
    wire = Wire()
    connect(pages, wire)
    assert open_link(pages, static_server.url, 10_000) == ["peer", "peer"]
    data = [payload(1, PAYLOAD_BYTES), payload(2, PAYLOAD_BYTES)]
    for page, sent in zip(pages, data, strict=True):
        assert send(page, sent) == hashlib.sha256(sent).hexdigest()  # what the sender reports
    for page, got in zip(pages, data[::-1], strict=True):
        [received] = page.evaluate("() => ringHarness.waitReceived(1)")
        assert received == {"length": len(got), "digest": hashlib.sha256(got).hexdigest()}
        stats = page.evaluate("() => ringHarness.stats()")
        assert (stats["sent"], stats["received"], stats["relayed"]) == (PAYLOAD_BYTES, PAYLOAD_BYTES, 0)
    assert wire.relayed_bytes == 0 and wire.signals["offer"] == wire.signals["answer"] == 1
    report("peer", wire, 2 * PAYLOAD_BYTES)


def test_a_link_that_cannot_connect_falls_back_to_the_relay(pages: Any, static_server: StaticServer) -> None:
    wire = Wire(drop_candidates=True)  # no candidate reaches either side: ICE has nothing to try
    connect(pages, wire)
    assert open_link(pages, static_server.url, FALLBACK_TIMEOUT_MS) == ["relay", "relay"]
    data = payload(3, RELAYED_BYTES)
    assert send(pages[1], data) == hashlib.sha256(data).hexdigest()
    [received] = pages[0].evaluate("() => ringHarness.waitReceived(1)")
    assert received == {"length": RELAYED_BYTES, "digest": hashlib.sha256(data).hexdigest()}
    assert wire.relayed_bytes == RELAYED_BYTES
    assert pages[1].evaluate("() => ringHarness.stats()")["relayed"] == RELAYED_BYTES
    assert wire.signals["offer"] == wire.signals["answer"] == 1  # signalled, but ICE had no candidate
    report("relay", wire, RELAYED_BYTES)


def test_a_hostile_length_header_closes_the_link_and_later_payloads_take_the_relay(
    pages: Any, static_server: StaticServer
) -> None:
    wire = Wire()
    connect(pages, wire)
    assert open_link(pages, static_server.url, 10_000) == ["peer", "peer"]
    pages[1].evaluate("(d) => ringHarness.raw(d)", b64(struct.pack("<d", 2.0**40)))  # a terabyte, it says
    pages[0].wait_for_function("() => ringHarness.stats().error")
    stats = pages[0].evaluate("() => ringHarness.stats()")
    assert (stats["error"], stats["via"], stats["received"]) == (
        "ring: a payload length out of bounds",
        "relay",
        0,
    )
    data = payload(4, 1000)
    assert send(pages[0], data) == hashlib.sha256(data).hexdigest()
    [received] = pages[1].evaluate("() => ringHarness.waitReceived(1)")
    assert received["digest"] == hashlib.sha256(data).hexdigest() and wire.relayed_bytes == len(data)
