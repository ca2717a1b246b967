"""Blobs straight from ASGI: /blobs/<sha256> without Django's request cycle.

Every volunteer fetches each new model version the moment it is published. Through a Django view, each
request (and each chunk of its body) waited its turn on daphne's single thread for synchronous code: 16
volunteers fetching 100 KB of weights took 280 ms, in every round. Here the lookup runs in a pool thread and
the file is read off the event loop, so downloads proceed side by side.

Who may have which blob is decided in projects/blobs.py. The graph and weights of a live project are public
and, being content-addressed, immutable: browsers and proxies may keep them. A dataset shard needs the
signed grant its assign message put in the query; anything else is for its owner or a superuser, known by
the session cookie. Neither is ever cached. Every answer says nosniff and sandboxes itself, in case a blob
is ever opened as a page.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import parse_qs

from channels.auth import AuthMiddlewareStack

from config.db import database_sync_to_async
from projects.blobs import GRANT, Access, blob_access, blob_readable
from projects.models import Blob

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[Any]]
Send = Callable[[Any], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]
Headers = list[tuple[bytes, bytes]]

PREFIX = "/blobs/"
SHA256 = re.compile(r"[0-9a-f]{64}")
IMMUTABLE = b"public, max-age=31536000, immutable"
PRIVATE = b"private, no-store"
SAFE: Headers = [
    (b"x-content-type-options", b"nosniff"),
    (b"content-security-policy", b"default-src 'none'; sandbox"),
]
REFUSED = {
    Access.EXPIRED: b"This link has expired; the next work unit brings a fresh one.",
    Access.REFUSED: b"This link is not valid, or its project is not running.",
}
CHUNK = 2**20


def with_blobs(app: App) -> App:
    """Serve /blobs/ here and hand every other HTTP request to `app` (Django)."""
    by_session = AuthMiddlewareStack(serve_by_session)  # resolves the session's user: private blobs only

    async def route(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(PREFIX):
            await serve_blob(scope, receive, send, by_session=by_session)
        else:
            await app(scope, receive, send)

    return route


async def serve_blob(scope: Scope, receive: Receive, send: Send, *, by_session: App) -> None:
    if scope["method"] not in ("GET", "HEAD"):
        await _reply(send, 405, b"Method not allowed.", [(b"allow", b"GET, HEAD")])
        return
    sha256 = scope["path"][len(PREFIX) :]
    if not SHA256.fullmatch(sha256):
        await _reply(send, 404, b"No such blob.")
        return
    blob, access = await _looked_up(sha256, _grant(scope))
    if blob is not None and access is Access.PUBLIC:
        await _serve_public(scope, send, blob)
    elif blob is not None and access is Access.GRANTED:
        await _stream(send, blob, [(b"cache-control", PRIVATE)], body=scope["method"] == "GET")
    elif access in REFUSED:
        await _reply(send, 403, REFUSED[access])
    else:
        await by_session(scope, receive, send)


async def serve_by_session(scope: Scope, receive: Receive, send: Send) -> None:
    """A private blob for its owner or a superuser (the admin's links); inside AuthMiddlewareStack."""
    blob = await _readable(scope["path"][len(PREFIX) :], scope["user"])
    if blob is None:  # the same answer as for a blob that does not exist
        await _reply(send, 404, b"No such blob.")
        return
    await _stream(send, blob, [(b"cache-control", PRIVATE)], body=scope["method"] == "GET")


def _grant(scope: Scope) -> str | None:
    values = parse_qs(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True).get(GRANT)
    return values[0] if values else None


class _Public:
    """Blobs this process found public lately: a round's volunteers all fetch the new version at once, and
    each fetch was a thread hop and a query (14% of daphne's CPU at 64 volunteers, issue 15). Browsers and
    proxies keep a public blob a year (IMMUTABLE), so remembering it for seconds changes nothing they see."""

    SECONDS = 10.0
    MAX_KEPT = 256  # then forgotten all at once: the bound matters, not which ones stay

    def __init__(self) -> None:
        self._kept: dict[str, tuple[float, Blob]] = {}

    def get(self, sha256: str) -> Blob | None:
        kept = self._kept.get(sha256)
        return kept[1] if kept is not None and kept[0] > time.monotonic() else None

    def keep(self, blob: Blob) -> None:
        if len(self._kept) >= self.MAX_KEPT:
            self.clear()
        self._kept[blob.sha256] = (time.monotonic() + self.SECONDS, blob)

    def clear(self) -> None:
        self._kept.clear()


PUBLIC = _Public()  # used from the event loop's thread only


async def _looked_up(sha256: str, grant: str | None) -> tuple[Blob | None, Access]:
    blob = PUBLIC.get(sha256)
    if blob is not None:
        return blob, Access.PUBLIC
    blob, access = await _access(sha256, grant)
    if blob is not None and access is Access.PUBLIC:
        PUBLIC.keep(blob)
    return blob, access


@database_sync_to_async
def _access(sha256: str, grant: str | None) -> tuple[Blob | None, Access]:
    return blob_access(sha256=sha256, grant=grant)


@database_sync_to_async
def _readable(sha256: str, user: Any) -> Blob | None:
    return blob_readable(sha256=sha256, user=user)


async def _serve_public(scope: Scope, send: Send, blob: Blob) -> None:
    etag = f'"{blob.sha256}"'.encode()
    cache = [(b"etag", etag), (b"cache-control", IMMUTABLE)]
    if etag in dict(scope["headers"]).get(b"if-none-match", b""):
        await _reply(send, 304, b"", cache)
        return
    await _stream(send, blob, cache, body=scope["method"] == "GET")


async def _stream(send: Send, blob: Blob, headers: Headers, *, body: bool) -> None:
    try:
        handle = await asyncio.to_thread(blob.open)  # a local file, or an object in a bucket
    except FileNotFoundError:
        await _reply(send, 404, b"Blob content is missing.")
        return
    with handle:
        headers = [
            *headers,
            *SAFE,
            (b"content-type", blob.content_type.encode()),
            (b"content-length", str(blob.size).encode()),
        ]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        while body and (chunk := await asyncio.to_thread(handle.read, CHUNK)):
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
    await send({"type": "http.response.body", "body": b""})


async def _reply(send: Send, status: int, text: bytes, headers: Headers | None = None) -> None:
    headers = [*(headers or []), *SAFE, (b"content-type", b"text/plain; charset=utf-8")]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": text})
