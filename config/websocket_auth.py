"""Who a WebSocket's user is, read on threads of its own.

Channels' AuthMiddleware reads the session and the user through its database_sync_to_async, which runs
every caller's queries on ONE thread: in a storm of 2,000 simultaneous (re)connects they queued behind each
other past daphne's 5 s handshake limit and 72% failed (issue 15). Here the lookup runs on AUTH_THREADS
threads kept for it, so a handshake never waits behind the database work of volunteers already connected
(their hellos, results) in the shared pool either."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

from channels.auth import AuthMiddleware, get_user
from channels.db import DatabaseSyncToAsync
from channels.sessions import CookieMiddleware, SessionMiddleware
from django.contrib.auth.base_user import AbstractBaseUser
from django.contrib.auth.models import AnonymousUser
from django.db import close_old_connections

AUTH_THREADS = 4
_threads = ThreadPoolExecutor(max_workers=AUTH_THREADS, thread_name_prefix="websocket-auth")


def _user(scope: dict[str, Any]) -> AbstractBaseUser | AnonymousUser:
    close_old_connections()  # as config.db: each call's connection goes back to the pool
    try:
        user: AbstractBaseUser | AnonymousUser = get_user.func(scope)
        return user
    finally:
        close_old_connections()


_get_user = DatabaseSyncToAsync(_user, thread_sensitive=False, executor=_threads)


class PooledAuthMiddleware(AuthMiddleware):
    async def resolve_scope(self, scope: dict[str, Any]) -> None:
        scope["user"]._wrapped = await _get_user(scope)


def PooledAuthMiddlewareStack(inner: Any) -> Any:  # noqa: N802 (as channels' AuthMiddlewareStack)
    return CookieMiddleware(SessionMiddleware(PooledAuthMiddleware(inner)))
