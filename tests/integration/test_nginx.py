"""platform/nginx.conf, run by a real nginx: the volunteers' WebSockets reach the `sockets` pool and every
other request the `web` pool, so that a storm of reconnects never queues a page (README, "Pages beside the
sockets"). The two pools are stand-in servers that say which one answered; the routing is nginx's own.

Debian's nginx (1.22) lacks the upstream `resolve` of 1.27.3 that compose's nginx uses to follow Docker's DNS,
so each pool's `server <service>:8000 resolve;` becomes a loopback address here; nothing else changes.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from websockets.sync.client import connect
from websockets.sync.server import Server, ServerConnection, serve

ROOT = Path(__file__).resolve().parents[2]
NGINX_CONF = ROOT / "platform" / "nginx.conf"
NGINX = shutil.which("nginx") or "/usr/sbin/nginx"
pytestmark = pytest.mark.skipif(not Path(NGINX).exists(), reason="nginx not installed (.ci/run installs it)")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class WebPool(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        body = f"web {self.path}".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def sockets_pool(connection: ServerConnection) -> None:
    assert connection.request is not None
    connection.send(f"sockets {connection.request.path}")


@dataclass
class Proxy:
    url: str
    process: subprocess.Popen[bytes]


def rendered(conf: str, *, web: int, sockets: int, listen: int, var: Path) -> str:
    """platform/nginx.conf with loopback upstreams, a loopback port and scratch directories."""
    replacements = {
        "server web:8000 resolve;": f"server 127.0.0.1:{web};",
        "server sockets:8000 resolve;": f"server 127.0.0.1:{sockets};",
        "listen 80;": f"listen 127.0.0.1:{listen};",
        "/var/cache/nginx/blobs": str(var / "cache"),
        "root /srv;": f"root {var};",
        "alias /srv/stats/;": f"alias {var}/stats/;",
    }
    for old, new in replacements.items():
        assert old in conf, f"platform/nginx.conf changed shape: {old!r} is gone"
        conf = conf.replace(old, new)
    return conf


def main_conf(var: Path) -> str:
    """The http block compose's nginx image wraps conf.d/default.conf in, with scratch paths."""
    temp = " ".join(
        f"{kind}_temp_path {var / kind};" for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    user = "user root;" if os.geteuid() == 0 else ""  # workers must read the scratch directory
    return (
        f"{user} daemon off; pid {var / 'nginx.pid'}; error_log {var / 'error.log'} warn;\n"
        f"events {{}}\nhttp {{ access_log off; include /etc/nginx/mime.types; {temp}\n"
        f"include {var / 'default.conf'}; }}\n"
    )


@pytest.fixture(scope="module")
def proxy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proxy]:
    var = tmp_path_factory.mktemp("nginx")
    web = ThreadingHTTPServer(("127.0.0.1", 0), WebPool)
    sockets: Server = serve(sockets_pool, "127.0.0.1", 0)
    for server in (web, sockets):
        threading.Thread(target=server.serve_forever, daemon=True).start()
    listen = free_port()
    conf = rendered(
        NGINX_CONF.read_text(),
        web=web.server_address[1],
        sockets=sockets.socket.getsockname()[1],
        listen=listen,
        var=var,
    )
    (var / "default.conf").write_text(conf)
    (var / "nginx.conf").write_text(main_conf(var))
    process = subprocess.Popen([NGINX, "-c", str(var / "nginx.conf"), "-p", str(var)], stderr=subprocess.PIPE)
    try:
        wait_for_port(listen, process)
        yield Proxy(f"127.0.0.1:{listen}", process)
    finally:
        process.terminate()
        process.wait(timeout=10)
        web.shutdown()
        sockets.shutdown()


def wait_for_port(port: int, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"nginx exited: {process.stderr.read().decode() if process.stderr else ''}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("nginx did not listen")


def get(proxy: Proxy, path: str) -> str:
    with urllib.request.urlopen(f"http://{proxy.url}{path}", timeout=5) as response:
        return str(response.read().decode())


def test_a_volunteers_websocket_reaches_the_sockets_pool(proxy: Proxy) -> None:
    with connect(f"ws://{proxy.url}/ws/volunteer/", open_timeout=5) as websocket:
        assert websocket.recv(timeout=5) == "sockets /ws/volunteer/"


@pytest.mark.parametrize("path", ["/", "/contribute/", "/api/projects/", "/blobs/ab/abcdef", "/stats/"])
def test_pages_the_api_and_blobs_reach_the_web_pool(proxy: Proxy, path: str) -> None:
    assert get(proxy, path) == f"web {path}"
