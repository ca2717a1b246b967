"""The simulated volunteer's transfers (workers/simulator.py Http): in threads of their own, so that a load
test that gives the event loop's default executor to the volunteers' computing (benchmarks/scaling, at the
lowest CPU priority) does not make downloads wait behind other volunteers' training."""

from __future__ import annotations

import asyncio
import concurrent.futures
import http.server
import threading
from collections.abc import Iterator

import pytest

from workers.simulator import Http


class _Blob(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b"weights"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[str]:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Blob)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def test_a_download_does_not_wait_for_the_default_executors_threads(server: str) -> None:
    computing = threading.Event()  # every thread of the default executor busy "training" until set

    async def fetch() -> bytes:
        loop = asyncio.get_running_loop()
        busy = concurrent.futures.ThreadPoolExecutor(max_workers=1)
        loop.set_default_executor(busy)
        training = loop.run_in_executor(None, computing.wait)
        try:
            return await asyncio.wait_for(Http(server).request("/blobs/x"), timeout=5)
        finally:
            computing.set()
            await training

    assert asyncio.run(fetch()) == b"weights"
