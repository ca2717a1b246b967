"""Database calls from async code (daphne), off its single thread for synchronous code."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from channels.db import DatabaseSyncToAsync


def database_sync_to_async(func: Callable[..., Any]) -> Any:
    """Channels' helper, but run in the thread pool. Its default runs every caller's queries in ONE thread,
    so when a round closed, sixteen volunteers' assignments, uploads and downloads queued behind each
    other's database round trips (1.3 s to hand out a round, measured); the services lock the rows they
    change, so they are safe to run side by side. Connections are closed around each call, as in Channels."""
    return DatabaseSyncToAsync(func, thread_sensitive=False)
