"""One web process's `ready`s served in batches (workers/batching.py; issue 15): when a round opens, every
waiting connection asks at once, and each `ready` was a thread hop, a transaction and a search of its own.
A batch is one call of lifecycle.work_units_offer; a batch that fails is served again one `ready` at a time
(work_unit_offer)."""

from __future__ import annotations

from projects.lifecycle import Offer, OfferRequest, work_unit_offer, work_units_offer
from workers.batching import Batcher, pooled_batcher

MAX_BATCH = 32  # ready volunteers per batch: its transaction holds their units' and devices' rows


def _batch(requests: list[OfferRequest]) -> list[Offer | None]:
    return [*work_units_offer(requests=requests)]


def _one(request: OfferRequest) -> Offer:
    r = request
    return work_unit_offer(user=r.user, device=r.device, preferences=r.preferences, memory_mb=r.memory_mb)


def batcher() -> Batcher[OfferRequest, Offer]:
    """The running event loop's."""
    return pooled_batcher("offers", batch=_batch, single=_one, max_batch=MAX_BATCH)
