"""Database calls from async code (daphne), off its single thread for synchronous code."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from channels.db import DatabaseSyncToAsync
from django.db import close_old_connections


def database_sync_to_async(func: Callable[..., Any]) -> Any:
    """Channels' helper, but run in the thread pool. Its default runs every caller's queries in ONE thread,
    so when a round closed, sixteen volunteers' assignments, uploads and downloads queued behind each
    other's database round trips (1.3 s to hand out a round, measured); the services lock the rows they
    change, so they are safe to run side by side. Connections are closed around each call, as in Channels,
    and also inside the call's own context: asgiref 3.13 gives the call a context-local view of Django's
    connections, which Channels' closing (outside it) no longer sees, so every call kept its pooled
    connection and the pool (8) ran dry after eight blob downloads."""

    @functools.wraps(func)
    def closing(*args: Any, **kwargs: Any) -> Any:
        close_old_connections()
        try:
            return func(*args, **kwargs)
        finally:
            close_old_connections()

    return DatabaseSyncToAsync(closing, thread_sensitive=False)
