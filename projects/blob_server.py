"""Blobs straight from ASGI: /blobs/<sha256> without Django's request cycle.

Every volunteer fetches each new model version the moment it is published. Through a Django view, each
request (and each chunk of its body) waited its turn on daphne's single thread for synchronous code: 16
volunteers fetching 100 KB of weights took 280 ms, in every round. Here the lookup runs in a pool thread and
the file is read off the event loop, so downloads proceed side by side. Blobs are immutable and
content-addressed: browsers and proxies may keep them forever.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable
from typing import Any

from crowdtrain.db import database_sync_to_async
from projects.models import Blob

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[Any]]
Send = Callable[[Any], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

PREFIX = "/blobs/"
SHA256 = re.compile(r"[0-9a-f]{64}")
IMMUTABLE = b"public, max-age=31536000, immutable"
CHUNK = 2**20


def with_blobs(app: App) -> App:
    """Serve /blobs/ here and hand every other HTTP request to `app` (Django)."""

    async def route(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(PREFIX):
            await serve_blob(scope, send)
        else:
            await app(scope, receive, send)

    return route


async def serve_blob(scope: Scope, send: Send) -> None:
    if scope["method"] not in ("GET", "HEAD"):
        await _reply(send, 405, [(b"allow", b"GET, HEAD")], b"Method not allowed.")
        return
    sha256 = scope["path"][len(PREFIX) :]
    blob = await _blob(sha256) if SHA256.fullmatch(sha256) else None
    if blob is None:
        await _reply(send, 404, [], b"No such blob.")
        return
    etag = f'"{sha256}"'.encode()
    cache = [(b"etag", etag), (b"cache-control", IMMUTABLE)]
    if etag in dict(scope["headers"]).get(b"if-none-match", b""):
        await _reply(send, 304, cache, b"")
        return
    await _stream(send, blob, cache, body=scope["method"] == "GET")


@database_sync_to_async
def _blob(sha256: str) -> Blob | None:
    return Blob.objects.filter(sha256=sha256).first()


async def _stream(send: Send, blob: Blob, headers: list[tuple[bytes, bytes]], *, body: bool) -> None:
    try:
        handle = await asyncio.to_thread(blob.path.open, "rb")
    except FileNotFoundError:
        await _reply(send, 404, [], b"Blob content is missing.")
        return
    with handle:
        headers = [
            *headers,
            (b"content-type", blob.content_type.encode()),
            (b"content-length", str(blob.size).encode()),
        ]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        while body and (chunk := await asyncio.to_thread(handle.read, CHUNK)):
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
    await send({"type": "http.response.body", "body": b""})


async def _reply(send: Send, status: int, headers: list[tuple[bytes, bytes]], text: bytes) -> None:
    headers = [*headers, (b"content-type", b"text/plain; charset=utf-8")]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": text})
