"""workers/simulator.py's reconnects: a server busy admitting others (close 4503) is waited for, as the
browser waits for it, and never counts towards giving up; other drops do. No server needed."""

from __future__ import annotations

import asyncio

import pytest
from websockets.exceptions import ConnectionClosedError
from websockets.frames import Close

from tests.conftest import run_async
from workers import simulator
from workers.simulator import Simulator, SimulatorConfig, SimulatorError


def closed(code: int) -> ConnectionClosedError:
    return ConnectionClosedError(Close(code, ""), Close(code, ""), True)  # as websockets raises it


def test_4503_is_waited_for_and_never_gives_up(monkeypatch: pytest.MonkeyPatch) -> None:
    waits: list[float] = []

    async def wait(seconds: float) -> None:
        waits.append(seconds)

    monkeypatch.setattr(simulator.asyncio, "sleep", wait)
    sim = Simulator(SimulatorConfig())

    async def many() -> None:
        for _ in range(3 * simulator.MAX_RETRIES):
            await sim._reconnect_later(closed(4503))

    run_async(many())
    assert sim.retries == 0 and sim.stats.reconnects == 0
    assert len(waits) == 3 * simulator.MAX_RETRIES and min(waits) >= simulator.RETRY_LATER_S


def test_other_drops_count_until_the_simulator_gives_up(monkeypatch: pytest.MonkeyPatch) -> None:
    async def no_wait(seconds: float) -> None:
        return None

    monkeypatch.setattr(simulator.asyncio, "sleep", no_wait)
    sim = Simulator(SimulatorConfig())

    async def many() -> None:
        for _ in range(simulator.MAX_RETRIES + 1):
            await sim._reconnect_later(closed(1011))

    with pytest.raises(SimulatorError, match="gave up"):
        run_async(many())
    assert sim.stats.reconnects == simulator.MAX_RETRIES


def test_a_handshake_the_server_drops_is_a_reconnect(monkeypatch: pytest.MonkeyPatch) -> None:
    """A web process killed mid-handshake (behind a balancer: the TCP connection opens, then closes with no
    HTTP response) is a drop like any other, as it is to the browser, not the end of the volunteer."""

    async def no_wait(seconds: float) -> None:
        return None

    async def session() -> Simulator:
        server = await asyncio.start_server(lambda _reader, writer: writer.close(), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        sim = Simulator(SimulatorConfig(url=f"http://127.0.0.1:{port}"))
        async with server:
            monkeypatch.setattr(simulator.asyncio, "sleep", no_wait)
            await sim._session()
        return sim

    sim = run_async(session())
    assert sim.stats.reconnects == 1 and sim.retries == 1
