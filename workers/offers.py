"""One web process's `ready`s served in batches (issue 15): when a round opens, every waiting connection asks
at once, and each `ready` was a thread hop, a transaction and a search of its own, one after the other.

A `ready` waits only for the batch in flight (none: it starts one at once), and the next batch takes every
`ready` that arrived meanwhile, up to MAX_BATCH, in one call of lifecycle.work_units_offer. A batch that
fails is served again one `ready` at a time (work_unit_offer), so one volunteer's bad luck never costs the
others their work: each gets its own offer or its own error."""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Awaitable, Callable

from config.db import database_sync_to_async
from projects.lifecycle import Offer, OfferRequest, work_unit_offer, work_units_offer

logger = logging.getLogger(__name__)

MAX_BATCH = 32  # ready volunteers per batch: its transaction holds their units' and devices' rows

Batch = Callable[[list[OfferRequest]], Awaitable[list[Offer]]]
Single = Callable[[OfferRequest], Awaitable[Offer]]


async def _serve_batch(requests: list[OfferRequest]) -> list[Offer]:
    offers: list[Offer] = await database_sync_to_async(work_units_offer)(requests=requests)
    return offers


async def _serve_one(request: OfferRequest) -> Offer:
    offer: Offer = await database_sync_to_async(work_unit_offer)(
        user=request.user,
        device=request.device,
        preferences=request.preferences,
        memory_mb=request.memory_mb,
    )
    return offer


class OfferBatcher:
    def __init__(self, batch: Batch = _serve_batch, single: Single = _serve_one) -> None:
        self._batch, self._single = batch, single
        self._waiting: list[tuple[OfferRequest, asyncio.Future[Offer]]] = []
        self._serving = False

    async def offer(self, request: OfferRequest) -> Offer:
        future: asyncio.Future[Offer] = asyncio.get_running_loop().create_future()
        self._waiting.append((request, future))
        if not self._serving:
            self._serving = True
            asyncio.get_running_loop().create_task(self._serve())
        return await future

    async def _serve(self) -> None:
        try:
            while self._waiting:
                taken, self._waiting = self._waiting[:MAX_BATCH], self._waiting[MAX_BATCH:]
                await self._answer(taken)
        finally:
            self._serving = False

    async def _answer(self, taken: list[tuple[OfferRequest, asyncio.Future[Offer]]]) -> None:
        try:
            offers = await self._batch([request for request, _ in taken])
        except Exception:
            logger.exception("a batch of %d offers failed; serving them one at a time", len(taken))
            await asyncio.gather(*(self._answer_one(request, future) for request, future in taken))
            return
        for (_, future), offer in zip(taken, offers, strict=True):
            if not future.done():  # its connection went away meanwhile
                future.set_result(offer)

    async def _answer_one(self, request: OfferRequest, future: asyncio.Future[Offer]) -> None:
        try:
            offer = await self._single(request)
        except Exception as exc:
            if not future.done():
                future.set_exception(exc)
            return
        if not future.done():
            future.set_result(offer)


_BATCHERS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, OfferBatcher] = weakref.WeakKeyDictionary()


def batcher() -> OfferBatcher:
    """The running event loop's (a web process has one; tests start several)."""
    loop = asyncio.get_running_loop()
    if loop not in _BATCHERS:
        _BATCHERS[loop] = OfferBatcher()
    return _BATCHERS[loop]
