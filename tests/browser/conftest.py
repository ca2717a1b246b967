"""Shared browser fixtures: one headless Chromium per test module and a static file server.

The server maps the URL layout Django uses (/static/<app files>, /static/vendor/<npm files>) plus
/harness/ (test pages) and /blobs/ (a temp dir standing in for content-addressed blobs), so the
engine scripts and worker.js run unmodified without Django.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
STATIC = ROOT / "frontend" / "static"
VENDOR = ROOT / "frontend" / "vendor"
HARNESS = Path(__file__).resolve().parent / "harness"


class _Handler(SimpleHTTPRequestHandler):
    blob_dir: Path
    requested: list[str]

    def translate_path(self, path: str) -> str:
        path = path.split("?", 1)[0].split("#", 1)[0]
        self.requested.append(path)
        for prefix, base in (
            ("/static/vendor/", VENDOR),
            ("/static/", STATIC),
            ("/harness/", HARNESS),
            ("/blobs/", self.blob_dir),
        ):
            if path.startswith(prefix):
                rel = Path(path[len(prefix) :])
                if ".." in rel.parts:
                    return str(base / "__forbidden__")
                return str(base / rel)
        return str(HARNESS / "__missing__")

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - keep test output quiet
        pass


class StaticServer:
    def __init__(self, blob_dir: Path) -> None:
        self.blob_dir = blob_dir
        self.requested: list[str] = []  # every path asked for, in order (what a client downloaded)
        handler = type("Handler", (_Handler,), {"blob_dir": blob_dir, "requested": self.requested})
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def put_blob(self, name: str, data: bytes) -> str:
        (self.blob_dir / name).write_bytes(data)
        return f"/blobs/{name}"


@pytest.fixture(scope="session")
def static_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StaticServer]:
    if not (VENDOR / "tf.min.js").exists():
        pytest.skip("frontend/vendor missing: run scripts/vendor_static.py")
    server = StaticServer(tmp_path_factory.mktemp("blobs"))
    server.thread.start()
    yield server
    server.httpd.shutdown()
    server.httpd.server_close()


@pytest.fixture(scope="module")  # as `browser` (tests/conftest.py)
def harness(browser: Any, static_server: StaticServer) -> Iterator[Any]:
    """A page with TF.js and the engine scripts loaded; `harness` in the page is harness.js."""
    context = browser.new_context()
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(f"{static_server.url}/harness/index.html")
    page.wait_for_function("() => self.harness && self.crowdtrain && self.crowdtrain.train")
    yield page
    context.close()
    assert not errors, errors
