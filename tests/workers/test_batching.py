"""A web process's batches of requests (workers/batching.py), with stand-ins for the database calls."""

from __future__ import annotations

import asyncio
from typing import Any

from workers import arrivals, offers
from workers.batching import Batcher


class Server:
    """Serves batches after `delay`, recording each; `fail_batches` / `fail_users` raise instead, and the
    batch leaves `alone` to the single path."""

    def __init__(
        self,
        *,
        delay: float = 0.01,
        fail_batches: bool = False,
        fail_users: frozenset[str] = frozenset(),
        alone: frozenset[str] = frozenset(),
    ):
        self.delay, self.fail_batches, self.fail_users, self.alone = delay, fail_batches, fail_users, alone
        self.batches: list[list[str]] = []
        self.singles: list[str] = []

    async def batch(self, requests: list[str]) -> list[str | None]:
        self.batches.append(list(requests))
        await asyncio.sleep(self.delay)
        if self.fail_batches:
            raise RuntimeError("the batch broke")
        return [None if r in self.alone else f"for {r}" for r in requests]

    async def single(self, request: str) -> str:
        self.singles.append(request)
        if request in self.fail_users:
            raise ValueError(f"{request} broke")
        return f"alone for {request}"

    def batcher(self, max_batch: int = 32) -> Batcher[str, str]:
        return Batcher(batch=self.batch, single=self.single, max_batch=max_batch)


def _ask(batcher: Batcher[str, str], names: list[str]) -> Any:
    async def ask(name: str) -> str | BaseException:
        try:
            return await batcher.ask(name)
        except Exception as exc:
            return exc

    async def everyone() -> list[str | BaseException]:
        return await asyncio.gather(*(ask(name) for name in names))

    return asyncio.run(everyone())


def test_requests_at_once_share_a_batch_and_those_during_it_share_the_next() -> None:
    server = Server(delay=0.05)
    batcher = server.batcher()

    async def scenario() -> list[str]:
        first = [asyncio.ensure_future(batcher.ask(f"v{i}")) for i in range(3)]
        await asyncio.sleep(0.01)  # their batch is in flight
        later = [asyncio.ensure_future(batcher.ask(f"v{i}")) for i in range(3, 10)]
        return list(await asyncio.gather(*first, *later))

    answers = asyncio.run(scenario())
    assert server.batches == [["v0", "v1", "v2"], [f"v{i}" for i in range(3, 10)]]
    assert answers == [f"for v{i}" for i in range(10)]  # each its own, in order
    assert server.singles == []


def test_a_batch_holds_at_most_max_batch_requests() -> None:
    server = Server()
    answers = _ask(server.batcher(max_batch=4), list("abcdefghij"))
    assert [len(b) for b in server.batches] == [4, 4, 2]
    assert answers == [f"for {c}" for c in "abcdefghij"]


def test_a_failed_batch_is_served_one_at_a_time_and_one_failure_stays_its_own() -> None:
    server = Server(fail_batches=True, fail_users=frozenset({"v2"}))
    answers = _ask(server.batcher(), ["v0", "v1", "v2", "v3"])
    assert [answers[i] for i in (0, 1, 3)] == ["alone for v0", "alone for v1", "alone for v3"]
    assert isinstance(answers[2], ValueError) and str(answers[2]) == "v2 broke"
    assert sorted(server.singles) == ["v0", "v1", "v2", "v3"]


def test_what_a_batch_leaves_is_served_alone_and_its_error_is_its_own() -> None:
    server = Server(alone=frozenset({"v1", "v2"}), fail_users=frozenset({"v2"}))
    answers = _ask(server.batcher(), ["v0", "v1", "v2", "v3"])
    assert [answers[i] for i in (0, 1, 3)] == ["for v0", "alone for v1", "for v3"]
    assert isinstance(answers[2], ValueError)
    assert server.singles == ["v1", "v2"] and len(server.batches) == 1


def test_a_request_whose_connection_went_away_does_not_stop_the_others() -> None:
    server = Server(delay=0.05)
    batcher = server.batcher()

    async def scenario() -> list[str]:
        first = asyncio.ensure_future(batcher.ask("first"))
        await asyncio.sleep(0)
        gone = asyncio.ensure_future(batcher.ask("gone"))
        stays = asyncio.ensure_future(batcher.ask("stays"))
        await asyncio.sleep(0.01)
        gone.cancel()
        return [await first, await stays]

    assert asyncio.run(scenario()) == ["for first", "for stays"]
    assert server.batches == [["first"], ["gone", "stays"]]


def test_each_event_loop_has_its_own_batchers() -> None:
    async def mine() -> tuple[object, object]:
        return offers.batcher(), arrivals.batcher()

    async def twice() -> bool:
        return offers.batcher() is offers.batcher() and arrivals.batcher() is arrivals.batcher()

    assert asyncio.run(twice())
    first, second = asyncio.run(mine()), asyncio.run(mine())
    assert first[0] is not second[0] and first[1] is not second[1] and first[0] is not first[1]
