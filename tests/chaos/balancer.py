"""The load balancer of the multi-process chaos test: what platform/nginx.conf's upstream block does in
production (least_conn over the daphnes; a refused connection is retried on the next one), as a TCP relay on
its own event loop, so that the test needs no nginx binary. Each HTTP request and each WebSocket is one TCP
connection here, as each is one upstream request for nginx."""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections import Counter
from collections.abc import Coroutine
from typing import Any, TypeVar

from devstack.stack import free_port

T = TypeVar("T")
CHUNK = 2**16
Backend = tuple[str, int]


class Balancer:
    def __init__(self, backends: list[Backend]) -> None:
        self.backends = backends
        self.port = free_port()
        self.open: Counter[Backend] = Counter()  # connections relayed right now
        self.served: Counter[Backend] = Counter()  # connections relayed so far
        self.refused: Counter[Backend] = Counter()  # connects that failed (a dead daphne), then retried
        self._turn = itertools.count()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="balancer")
        self._server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Balancer:
        self._thread.start()
        self._server = self._call(asyncio.start_server(self._relay, "127.0.0.1", self.port))
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._server is not None:
            self._server.close()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _ranked(self) -> list[Backend]:
        """Fewest open connections first; ties in turn, so an idle pair alternates."""
        turn = next(self._turn)
        rotated = self.backends[turn % len(self.backends) :] + self.backends[: turn % len(self.backends)]
        return sorted(rotated, key=lambda backend: self.open[backend])

    async def _relay(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        for backend in self._ranked():
            try:
                upstream_reader, upstream_writer = await asyncio.open_connection(*backend)
            except OSError:
                self.refused[backend] += 1
                continue
            self.open[backend] += 1
            self.served[backend] += 1
            try:
                await asyncio.gather(
                    _pipe(client_reader, upstream_writer), _pipe(upstream_reader, client_writer)
                )
            finally:
                self.open[backend] -= 1
            return
        client_writer.close()  # every daphne down: the client sees the connection fail, and retries


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy until either side ends, then close the other: a daphne killed mid-WebSocket drops its
    volunteers' connections, as behind nginx."""
    try:
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
    except OSError:
        pass
    finally:
        writer.close()
