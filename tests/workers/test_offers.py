"""The web process's batches of `ready`s (workers/offers.py), with stand-ins for the database calls."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from projects.lifecycle import Offer, OfferRequest
from workers import offers
from workers.preferences import DEFAULTS


def _request(name: str) -> OfferRequest:
    return OfferRequest(user=name, preferences=DEFAULTS)  # type: ignore[arg-type]  # a name stands for a user


class Server:
    """Serves batches after `delay`, recording each; `fail_batches` / `fail_users` raise instead."""

    def __init__(
        self, *, delay: float = 0.01, fail_batches: bool = False, fail_users: frozenset[str] = frozenset()
    ):
        self.delay, self.fail_batches, self.fail_users = delay, fail_batches, fail_users
        self.batches: list[list[str]] = []
        self.singles: list[str] = []

    async def batch(self, requests: list[OfferRequest]) -> list[Offer]:
        self.batches.append([str(r.user) for r in requests])
        await asyncio.sleep(self.delay)
        if self.fail_batches:
            raise RuntimeError("the batch broke")
        return [Offer(None, f"for {r.user}") for r in requests]

    async def single(self, request: OfferRequest) -> Offer:
        self.singles.append(str(request.user))
        if str(request.user) in self.fail_users:
            raise ValueError(f"{request.user} broke")
        return Offer(None, f"alone for {request.user}")


def _offers(batcher: offers.OfferBatcher, names: list[str]) -> Any:
    async def ask(name: str) -> Offer | BaseException:
        try:
            return await batcher.offer(_request(name))
        except Exception as exc:
            return exc

    async def everyone() -> list[Offer | BaseException]:
        return await asyncio.gather(*(ask(name) for name in names))

    return asyncio.run(everyone())


def test_readies_at_once_share_a_batch_and_those_during_it_share_the_next() -> None:
    server = Server(delay=0.05)
    batcher = offers.OfferBatcher(batch=server.batch, single=server.single)

    async def scenario() -> list[Offer]:
        first = [asyncio.ensure_future(batcher.offer(_request(f"v{i}"))) for i in range(3)]
        await asyncio.sleep(0.01)  # their batch is in flight
        later = [asyncio.ensure_future(batcher.offer(_request(f"v{i}"))) for i in range(3, 10)]
        return list(await asyncio.gather(*first, *later))

    answers = asyncio.run(scenario())
    assert server.batches == [["v0", "v1", "v2"], [f"v{i}" for i in range(3, 10)]]
    assert [a.why for a in answers] == [f"for v{i}" for i in range(10)]  # each its own, in order
    assert server.singles == []


def test_a_batch_holds_at_most_max_batch_readies(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(offers, "MAX_BATCH", 4)
    server = Server()
    answers = _offers(offers.OfferBatcher(batch=server.batch, single=server.single), list("abcdefghij"))
    assert [len(b) for b in server.batches] == [4, 4, 2]
    assert [a.why for a in answers] == [f"for {c}" for c in "abcdefghij"]


def test_a_failed_batch_is_served_one_at_a_time_and_one_failure_stays_its_own() -> None:
    server = Server(fail_batches=True, fail_users=frozenset({"v2"}))
    answers = _offers(offers.OfferBatcher(batch=server.batch, single=server.single), ["v0", "v1", "v2", "v3"])
    assert answers[0].why == "alone for v0"
    assert [a.why for a in (answers[1], answers[3])] == ["alone for v1", "alone for v3"]
    assert isinstance(answers[2], ValueError) and str(answers[2]) == "v2 broke"
    assert sorted(server.singles) == ["v0", "v1", "v2", "v3"]


def test_a_ready_whose_connection_went_away_does_not_stop_the_others() -> None:
    server = Server(delay=0.05)
    batcher = offers.OfferBatcher(batch=server.batch, single=server.single)

    async def scenario() -> list[str]:
        first = asyncio.ensure_future(batcher.offer(_request("first")))
        await asyncio.sleep(0)
        gone = asyncio.ensure_future(batcher.offer(_request("gone")))
        stays = asyncio.ensure_future(batcher.offer(_request("stays")))
        await asyncio.sleep(0.01)
        gone.cancel()
        return [(await first).why, (await stays).why]

    assert asyncio.run(scenario()) == ["for first", "for stays"]
    assert server.batches == [["first"], ["gone", "stays"]]


def test_each_event_loop_has_its_own_batcher() -> None:
    async def mine() -> offers.OfferBatcher:
        return offers.batcher()

    async def twice() -> bool:
        return offers.batcher() is offers.batcher()

    assert asyncio.run(twice())
    assert asyncio.run(mine()) is not asyncio.run(mine())
