"""One web process's `ready`s served in batches (workers/batching.py; issue 15): when a round opens, every
waiting connection asks at once, and each `ready` was a thread hop, a transaction and a search of its own.
A batch is one call of lifecycle.work_units_offer; a batch that fails is served again one `ready` at a time
(work_unit_offer)."""

from __future__ import annotations

from config.db import database_sync_to_async
from projects.lifecycle import Offer, OfferRequest, work_unit_offer, work_units_offer
from workers.batching import Batcher, loop_batcher

MAX_BATCH = 32  # ready volunteers per batch: its transaction holds their units' and devices' rows


async def _serve_batch(requests: list[OfferRequest]) -> list[Offer | None]:
    offers: list[Offer | None] = await database_sync_to_async(work_units_offer)(requests=requests)
    return offers


async def _serve_one(request: OfferRequest) -> Offer:
    offer: Offer = await database_sync_to_async(work_unit_offer)(
        user=request.user,
        device=request.device,
        preferences=request.preferences,
        memory_mb=request.memory_mb,
    )
    return offer


def batcher() -> Batcher[OfferRequest, Offer]:
    """The running event loop's."""
    return loop_batcher("offers", lambda: Batcher(batch=_serve_batch, single=_serve_one, max_batch=MAX_BATCH))
