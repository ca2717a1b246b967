"""Requests of one web process's connections served in batches (issue 15): when a round opens or closes, every
connection asks at once, and each request was a thread hop and a transaction of its own, one after the other.

A request waits only for the batch in flight (none: it starts one at once), and the next batch takes every
request that arrived meanwhile, up to `max_batch`, in one call of `batch`. `batch` may leave a request to
`single` (None in its place: a case the batch does not handle), and a batch that raises is served again one
request at a time, so one connection's bad luck never costs the others their answer: each gets its own
answer or its own error."""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

from config.db import database_sync_to_async

logger = logging.getLogger(__name__)

Request = TypeVar("Request")
Answer = TypeVar("Answer")


class Batcher(Generic[Request, Answer]):
    def __init__(
        self,
        *,
        batch: Callable[[list[Request]], Awaitable[list[Answer | None]]],
        single: Callable[[Request], Awaitable[Answer]],
        max_batch: int,
    ) -> None:
        self._batch, self._single, self.max_batch = batch, single, max_batch
        self._waiting: list[tuple[Request, asyncio.Future[Answer]]] = []
        self._serving = False

    async def ask(self, request: Request) -> Answer:
        future: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        self._waiting.append((request, future))
        if not self._serving:
            self._serving = True
            asyncio.get_running_loop().create_task(self._serve())
        return await future

    async def _serve(self) -> None:
        try:
            while self._waiting:
                taken = self._waiting[: self.max_batch]
                self._waiting = self._waiting[self.max_batch :]
                await self._answer(taken)
        finally:
            self._serving = False

    async def _answer(self, taken: list[tuple[Request, asyncio.Future[Answer]]]) -> None:
        try:
            answers = await self._batch([request for request, _ in taken])
        except Exception:
            logger.exception("a batch of %d requests failed; serving them one at a time", len(taken))
            answers = [None] * len(taken)
        alone = []
        for (request, future), answer in zip(taken, answers, strict=True):
            if answer is None:
                alone.append(self._answer_one(request, future))
            elif not future.done():  # its connection went away meanwhile
                future.set_result(answer)
        await asyncio.gather(*alone)

    async def _answer_one(self, request: Request, future: asyncio.Future[Answer]) -> None:
        try:
            answer = await self._single(request)
        except Exception as exc:
            if not future.done():
                future.set_exception(exc)
            return
        if not future.done():
            future.set_result(answer)


_BATCHERS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, Batcher[Any, Any]]] = (
    weakref.WeakKeyDictionary()
)


def pooled_batcher(
    name: str,
    *,
    batch: Callable[[list[Request]], list[Answer | None]],
    single: Callable[[Request], Answer],
    max_batch: int,
) -> Batcher[Request, Answer]:
    """The running event loop's batcher called `name` (a web process has one loop; tests start several), whose
    `batch` and `single` are synchronous database work, run in the thread pool."""
    mine = _BATCHERS.setdefault(asyncio.get_running_loop(), {})
    if name not in mine:

        async def serve_batch(requests: list[Request]) -> list[Answer | None]:
            answers: list[Answer | None] = await database_sync_to_async(batch)(requests)
            return answers

        async def serve_one(request: Request) -> Answer:
            answer: Answer = await database_sync_to_async(single)(request)
            return answer

        mine[name] = Batcher(batch=serve_batch, single=serve_one, max_batch=max_batch)
    return mine[name]
