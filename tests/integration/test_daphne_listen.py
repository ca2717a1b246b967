"""daphne as the platform starts it (runplatform, devstack, the container's entrypoint) listens with a backlog
that takes a storm of reconnects: Twisted's default of 50 dropped the SYNs of a 10,000-volunteer storm."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from config.management.commands.runplatform import LISTEN_BACKLOG, daphne_listen

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
    args = [sys.executable, "-m", "daphne", *daphne_listen("127.0.0.1", port), "config.asgi:application"]
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
