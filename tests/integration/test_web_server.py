"""daphne as the platform starts it (config/web_server.py, from runplatform, devstack and the container's
entrypoint): it listens with a backlog that takes a storm of reconnects (Twisted's default of 50 dropped the
SYNs of a 10,000-volunteer storm), and its connection check visits only the connections that changed."""

from __future__ import annotations

import asyncio
import gc
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from config import web_server
from config.management.commands.runplatform import LISTEN_BACKLOG, daphne_listen
from config.web_server import WatchingServer

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def listen_backlog(port: int, timeout: float = 60) -> int:
    """The backlog of the socket listening on `port` (ss shows it as a listener's Send-Q)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = subprocess.run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True).stdout
        if out.split():
            return int(out.split()[2])
        time.sleep(0.2)
    raise AssertionError(f"nothing listened on {port} within {timeout} s")


def somaxconn() -> int:
    return int(Path("/proc/sys/net/core/somaxconn").read_text())


def test_daphne_listens_with_the_platform_backlog() -> None:
    port = free_port()
    listen = daphne_listen("127.0.0.1", port)
    args = [sys.executable, "-m", "config.web_server", *listen, "config.asgi:application"]
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "config.settings"}
    daphne = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert listen_backlog(port) == min(LISTEN_BACKLOG, somaxconn()) >= 1024
    finally:
        daphne.terminate()
        daphne.wait(timeout=15)


def test_an_ipv6_address_is_escaped_in_the_endpoint() -> None:
    endpoint = daphne_listen("::1", 8000)[1]
    assert endpoint == "tcp:port=8000:interface=\\:\\:1:backlog=4096"


def test_the_entrypoint_listens_as_runplatform_does() -> None:
    text = (ROOT / "platform" / "entrypoint.sh").read_text()
    assert f"backlog={LISTEN_BACKLOG}" in text and "--websocket_connect_timeout 30" in text
    assert "exec python -m config.web_server" in text


class Looked(dict[str, Any]):
    """A connection's details that count daphne's looks at them."""

    looks = 0

    def get(self, key: str, default: Any = None) -> Any:
        Looked.looks += 1
        return super().get(key, default)


class Reactor:
    def callLater(self, *args: Any) -> None:  # noqa: N802 (Twisted's name)
        pass


async def checked_connections(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("daphne.server.reactor", Reactor())
    endings: dict[str, asyncio.Future[None]] = {}

    async def application(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await endings.setdefault(scope["path"], asyncio.get_running_loop().create_future())

    server = WatchingServer(application=application, endpoints=["tcp:port=0"], application_close_timeout=0)
    server.connections = {}  # as daphne's run() starts
    protocols = [object() for _ in range(1000)]
    for index, protocol in enumerate(protocols):
        server.protocol_connected(protocol)
        server.connections[protocol] = Looked(server.connections[protocol])
        server.create_application(protocol, {"type": "websocket", "path": str(index)})
    await asyncio.sleep(0)
    Looked.looks = 0
    server.application_checker()
    assert Looked.looks == 0  # 1,000 idle connections: nothing to look at

    endings["0"].set_result(None)  # an application that ended, its socket still open
    server.protocol_disconnected(protocols[1])  # a socket gone, its application still running
    endings["2"].set_result(None)  # both gone
    server.protocol_disconnected(protocols[2])
    await asyncio.sleep(0.01)
    server.application_checker()

    assert 0 < Looked.looks <= 3 * 3
    assert "application_instance" not in server.connections[protocols[0]]
    assert protocols[2] not in server.connections
    assert len(server.connections) == 999
    await asyncio.sleep(0.01)
    assert server.connections[protocols[1]]["application_instance"].cancelled()  # past close timeout
    server.application_checker()  # the cancelled one is reaped next time, as daphne does
    assert protocols[1] not in server.connections and len(server.connections) == 998


def test_the_connection_check_visits_only_what_changed(monkeypatch: pytest.MonkeyPatch) -> None:
    # A loop of its own in a thread of its own: earlier tests (Playwright's sync API) can leave a loop
    # running in this thread, where asyncio.run and async_to_sync both refuse to start.
    with ThreadPoolExecutor(max_workers=1) as pool:
        pool.submit(asyncio.run, checked_connections(monkeypatch)).result()


def test_start_up_objects_are_frozen_out_of_the_collector(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("daphne.server.Server.run", lambda self: None)
    gc.unfreeze()
    server = WatchingServer(application=None, endpoints=["tcp:port=0"])
    try:
        server.run()
        assert gc.get_freeze_count() > 0
        assert server.heap._collected in gc.callbacks
    finally:
        gc.callbacks.remove(server.heap._collected)
        gc.unfreeze()


def test_a_reaped_connection_is_unlinked(monkeypatch: pytest.MonkeyPatch) -> None:
    unlinked: list[Any] = []
    monkeypatch.setattr(web_server, "unlink", unlinked.append)
    monkeypatch.setattr("daphne.server.reactor", Reactor())
    server = WatchingServer(application=None, endpoints=["tcp:port=0"])
    server.connections = {}
    gone, open_ = object(), object()
    for protocol in (gone, open_):
        server.protocol_connected(protocol)
    server.protocol_disconnected(gone)
    server.application_checker()
    assert unlinked == [gone] and open_ in server.connections


def test_the_web_server_is_daphne_with_the_watching_server() -> None:
    assert web_server.WatchingCommandLineInterface.server_class is WatchingServer
