"""Limits on what volunteers' connections may cost the server: result bytes held at once by this process,
and WebSocket connects per minute per account and per address (counted in Redis, shared by processes)."""

from __future__ import annotations

import logging
import threading
import time

from django.conf import settings
from django.core.cache import cache

logger = logging.getLogger(__name__)
CONNECT_WINDOW_SECONDS = 60


class ByteBudget:
    """Bytes of result frames being handled at once in this process. A frame that would overdraw it is
    refused at once (the client retries later) instead of being held while the earlier ones are stored."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.in_use = 0

    def take(self, size: int, *, limit: int) -> bool:
        with self._lock:
            if self.in_use + size > limit:
                return False
            self.in_use += size
            return True

    def give_back(self, size: int) -> None:
        with self._lock:
            self.in_use = max(0, self.in_use - size)


RESULT_BYTES = ByteBudget()


def result_bytes_take(size: int) -> bool:
    return RESULT_BYTES.take(size, limit=settings.CROWDTRAIN["MAX_INFLIGHT_RESULT_BYTES"])


def connect_allowed(*, user_id: int | None, address: str | None) -> bool:
    """Count this connect against its address and account; False once either is over its limit. Every
    attempt counts, refused ones too, so hammering keeps the door shut until the minute is over."""
    limits = settings.CROWDTRAIN
    checks = [
        (f"ip:{address}", address, limits["WS_CONNECTS_PER_MINUTE_IP"]),
        (f"user:{user_id}", user_id, limits["WS_CONNECTS_PER_MINUTE_USER"]),
    ]
    counts = [_count(key) <= limit for key, who, limit in checks if who is not None]
    return all(counts)


def current_window() -> int:
    """The number of the current one-minute window (a seam: tests hold the clock still)."""
    return int(time.time() // CONNECT_WINDOW_SECONDS)


def _count(key: str) -> int:
    """Fixed one-minute windows: one Redis INCR per connect, the key expiring with its window."""
    full_key = f"ws-connect:{key}:{current_window()}"
    try:
        cache.add(full_key, 0, timeout=CONNECT_WINDOW_SECONDS * 2)
        return int(cache.incr(full_key))
    except ValueError:  # expired between add and incr: this is the window's first connect
        cache.set(full_key, 1, timeout=CONNECT_WINDOW_SECONDS * 2)
        return 1
