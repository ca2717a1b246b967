"""The channel layer and the cache: Redis with a bounded pool of connections per process.

channels-redis opens a connection for every concurrent call and keeps it afterwards: 5,000 volunteers leaving
at once left 4,899 idle connections in Redis (issue 15). A blocking pool caps them; calls wait their turn for
one of CHANNEL_LAYER_CONNECTIONS instead (a Redis command takes well under a millisecond)."""

from __future__ import annotations

import threading
from typing import Any

import redis
from channels_redis.core import RedisChannelLayer
from redis import asyncio as aioredis

CHANNEL_LAYER_CONNECTIONS = 32
WAIT_FOR_CONNECTION_SECONDS = 20


class BoundedRedisChannelLayer(RedisChannelLayer):
    def create_pool(self, index: int) -> aioredis.BlockingConnectionPool:
        host: dict[str, Any] = dict(self.hosts[index])
        return aioredis.BlockingConnectionPool.from_url(
            host.pop("address"),
            max_connections=CHANNEL_LAYER_CONNECTIONS,
            timeout=WAIT_FOR_CONNECTION_SECONDS,
            **host,
        )


class SharedCachePool(redis.BlockingConnectionPool):
    """The cache's Redis connections (the WebSocket connect throttle, workers/limits.py), one bounded pool per
    process. Django makes a cache object, and with it a connection pool, per thread and per async context:
    every WebSocket consumer had its own and kept its connection (3,032 for 3,000 idle volunteers, 9,500
    after they reconnected, until Redis's 10,000 clients were used up and reconnects failed)."""

    _shared: dict[str, redis.BlockingConnectionPool] = {}
    _lock = threading.Lock()

    @classmethod
    def from_url(cls, url: str, **options: Any) -> redis.BlockingConnectionPool:  # type: ignore[override]
        with cls._lock:
            if url not in cls._shared:
                pool = redis.BlockingConnectionPool.from_url(
                    url,
                    max_connections=CHANNEL_LAYER_CONNECTIONS,
                    timeout=WAIT_FOR_CONNECTION_SECONDS,
                    **options,
                )
                cls._shared[url] = pool
            return cls._shared[url]
