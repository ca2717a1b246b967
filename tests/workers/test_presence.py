"""workers/presence.py against the real Redis (the test's db) and PostgreSQL: group membership never
outlives a connection, even one whose consumer daphne killed before its disconnect() ran."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
import redis
from asgiref.sync import async_to_sync, sync_to_async
from channels.layers import get_channel_layer
from django.conf import settings
from django.contrib.auth.models import User

from config.channel_layer import CHANNEL_LAYER_CONNECTIONS
from tests.workers.conftest import device_of
from workers import presence
from workers.models import Device
from workers.presence import Presence, groups_purge_stale

pytestmark = pytest.mark.django_db(transaction=True)  # the flush writes devices from the thread pool
GROUPS = ("volunteers", "volunteer.1")


@pytest.fixture
def store() -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(settings.REDIS_URL)
    assert client.connection_pool.connection_kwargs.get("db", 0) != 0  # never the default database
    client.flushdb()
    yield client
    client.flushdb()


@pytest.fixture
def layer() -> Any:
    return get_channel_layer()


def members(store: redis.Redis, group: str) -> dict[str, float]:
    return {k.decode(): v for k, v in store.zrange(f"asgi:group:{group}", 0, -1, withscores=True)}


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    async_to_sync(scenario)()


async def until(condition: Callable[[], bool], *, within: float = 10.0) -> None:
    """The condition runs in a thread, so it may query the database."""
    deadline = time.monotonic() + within
    while not await sync_to_async(condition)() and time.monotonic() < deadline:
        await asyncio.sleep(0.02)


def departed(device: Device) -> bool:
    return Device.objects.get(pk=device.pk).disconnected_at is not None


def test_a_killed_consumer_leaves_its_groups_and_device(
    store: redis.Redis, layer: Any, volunteer_user: User, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(presence, "FLUSH_SECONDS", 0.05)
    device = device_of(volunteer_user, connection="specific.a!1")
    mine = Presence()

    async def scenario() -> None:
        await mine.join(layer, "specific.a!1", GROUPS)
        mine.device("specific.a!1", device.pk)
        assert "specific.a!1" in members(store, "volunteers")
        mine.leave("specific.a!1")  # all the consumer's __call__ does when daphne cancels it
        await until(lambda: departed(device))  # the flush leaves the groups first, then the device

    run(scenario)
    assert members(store, "volunteers") == {} and members(store, "volunteer.1") == {}
    assert Device.objects.get(pk=device.pk).disconnected_at is not None


def test_a_device_another_live_connection_holds_stays_connected(
    store: redis.Redis, layer: Any, volunteer_user: User
) -> None:
    device = device_of(volunteer_user)
    mine = Presence()

    async def scenario() -> None:
        for channel in ("specific.a!1", "specific.a!2"):  # two tabs of one browser
            await mine.join(layer, channel, GROUPS)
            mine.device(channel, device.pk)
        mine.leave("specific.a!1")
        await mine.flush(layer)

    run(scenario)
    assert list(members(store, "volunteers")) == ["specific.a!2"]
    assert Device.objects.get(pk=device.pk).disconnected_at is None


def test_the_heartbeat_re_adds_live_members_and_stamps_their_devices(
    store: redis.Redis, layer: Any, volunteer_user: User
) -> None:
    device = device_of(volunteer_user, connection="specific.a!1")
    Device.objects.filter(pk=device.pk).update(last_seen=device.last_seen.replace(year=2000))
    mine = Presence()

    async def scenario() -> None:
        await mine.join(layer, "specific.a!1", GROUPS)
        mine.device("specific.a!1", device.pk)
        store.zadd("asgi:group:volunteers", {"specific.a!1": 1.0})
        store.persist("asgi:group:volunteers")
        await mine.refresh(layer)

    before = time.time()
    run(scenario)
    assert members(store, "volunteers")["specific.a!1"] >= before - 1
    assert 0 < store.ttl("asgi:group:volunteers") <= settings.SOCKET_STALE_SECONDS
    assert Device.objects.get(pk=device.pk).last_seen.year > 2000


def test_a_group_joined_later_is_stamped_and_left_with_the_connection(
    store: redis.Redis, layer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The `waiting` group: joined when a connection is told idle, left when it gets work or ends."""
    monkeypatch.setattr(presence, "FLUSH_SECONDS", 0.05)
    mine = Presence()

    async def scenario() -> None:
        for channel in ("specific.a!1", "specific.a!2"):
            await mine.join(layer, channel, GROUPS)
            await mine.group_join(layer, channel, "waiting")
        await mine.group_join(layer, "specific.gone!1", "waiting")  # not live: joins nothing
        await mine.group_leave(layer, "specific.a!2", "waiting")
        store.zadd("asgi:group:waiting", {"specific.a!1": 1.0})
        await mine.refresh(layer)
        assert members(store, "waiting")["specific.a!1"] > 1.0
        mine.leave("specific.a!1")
        await mine.flush(layer)

    run(scenario)
    assert members(store, "waiting") == {}
    assert list(members(store, "volunteers")) == ["specific.a!2"]


def test_a_group_left_while_its_add_waited_is_not_kept(
    store: redis.Redis, layer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The leave's removal reaches Redis before the join's add: the join takes its own add back."""
    mine = Presence()
    gate = asyncio.Event()
    add = layer.group_add

    async def held(group: str, channel: str) -> None:
        await gate.wait()
        await add(group, channel)

    async def scenario() -> None:
        await mine.join(layer, "specific.a!1", GROUPS)
        monkeypatch.setattr(layer, "group_add", held)
        joining = asyncio.ensure_future(mine.group_join(layer, "specific.a!1", "waiting"))
        await asyncio.sleep(0)  # the join waits at its add
        await mine.group_leave(layer, "specific.a!1", "waiting")
        gate.set()
        await joining

    run(scenario)
    assert members(store, "waiting") == {}


def test_the_heartbeat_stamps_a_big_group_in_slices(
    store: redis.Redis, layer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Thousands of members of one group: several small ZADDs, never one that holds daphne's loop."""
    sizes: list[int] = []
    zadd = redis.asyncio.client.Pipeline.zadd

    def counted(pipe: Any, name: str, mapping: Any, *args: Any, **kwargs: Any) -> Any:
        sizes.append(len(mapping))
        return zadd(pipe, name, mapping, *args, **kwargs)

    monkeypatch.setattr(redis.asyncio.client.Pipeline, "zadd", counted)
    channels = [f"specific.a!{i}" for i in range(2 * presence.MEMBERS + 1)]

    async def stamp() -> None:
        big = {"volunteers": channels, "volunteer.1": channels[:1]}
        await presence.groups_stamp(layer, big, now=time.time())

    run(stamp)
    assert len(members(store, "volunteers")) == len(channels) and len(members(store, "volunteer.1")) == 1
    assert sorted(sizes) == [1, 1, presence.MEMBERS, presence.MEMBERS]


def test_a_member_nobody_refreshes_is_dropped_by_the_next_broadcast(store: redis.Redis, layer: Any) -> None:
    assert layer.group_expiry == settings.SOCKET_STALE_SECONDS
    old = time.time() - settings.SOCKET_STALE_SECONDS - 5
    store.zadd("asgi:group:volunteers", {"specific.dead!1": old, "specific.live!1": time.time()})

    async def broadcast() -> None:
        await layer.group_send("volunteers", {"type": "work.available"})

    run(broadcast)
    assert list(members(store, "volunteers")) == ["specific.live!1"]


def test_start_up_purges_members_from_before_a_restart(store: redis.Redis, layer: Any) -> None:
    stale = time.time() - 2 * settings.SOCKET_HEARTBEAT_SECONDS - 1
    store.zadd("asgi:group:volunteers", {"specific.old!1": stale, "specific.new!1": time.time()})
    store.zadd("asgi:group:volunteer.7", {"specific.old!2": stale})
    assert groups_purge_stale(layer, older_than=2 * settings.SOCKET_HEARTBEAT_SECONDS) == 2
    assert list(members(store, "volunteers")) == ["specific.new!1"]
    assert members(store, "volunteer.7") == {}


def test_a_process_that_exits_takes_its_members_out(store: redis.Redis, layer: Any) -> None:
    mine = Presence()

    async def scenario() -> None:
        await mine.join(layer, "specific.a!1", GROUPS)
        await mine.join(layer, "specific.a!2", GROUPS)
        mine.leave("specific.a!2")  # departed, not flushed yet

    run(scenario)
    store.zadd("asgi:group:volunteers", {"specific.other!1": time.time()})  # another process's
    mine.exit()
    assert list(members(store, "volunteers")) == ["specific.other!1"]


def test_the_layer_holds_a_bounded_number_of_redis_connections(store: redis.Redis, layer: Any) -> None:
    async def scenario() -> None:
        await asyncio.gather(*(layer.group_add("volunteers", f"specific.a!{i}") for i in range(300)))
        pool = layer.connection(0).connection_pool
        opened = len(pool._available_connections) + len(pool._in_use_connections)
        assert 0 < opened <= CHANNEL_LAYER_CONNECTIONS

    run(scenario)
    assert len(members(store, "volunteers")) == 300


def test_the_cache_keeps_one_redis_pool_for_all_consumers() -> None:
    """Django makes a cache object per async context: without the shared pool, one connection each."""
    from django.core.cache import caches

    async def pool() -> Any:
        cache: Any = caches["default"]
        return cache._cache._get_connection_pool(True)

    async def scenario() -> None:
        first, second = await asyncio.gather(asyncio.create_task(pool()), asyncio.create_task(pool()))
        assert first is second

    run(scenario)
