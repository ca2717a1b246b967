"""One web process's arriving results served in batches (workers/batching.py; issue 15): a round's results
come in together, and each was a thread hop, two transactions and a validation task of its own. A batch is
one call of lifecycle.results_receive; what it leaves, or a batch that fails, is served one result at a time
(result_receive, whose errors reach their own connection)."""

from __future__ import annotations

from config.db import database_sync_to_async
from projects.lifecycle import Arrival, ResultOutcome, result_receive, results_receive
from workers.batching import Batcher, loop_batcher

MAX_BATCH = 32  # results per batch: its transaction holds their rows


async def _serve_batch(arrivals: list[Arrival]) -> list[ResultOutcome | None]:
    outcomes: list[ResultOutcome | None] = await database_sync_to_async(results_receive)(arrivals=arrivals)
    return outcomes


async def _serve_one(arrival: Arrival) -> ResultOutcome:
    outcome: ResultOutcome = await database_sync_to_async(result_receive)(
        user=arrival.user,
        work_unit_id=arrival.work_unit_id,
        samples=arrival.samples,
        loss=arrival.loss,
        compute_ms=arrival.compute_ms,
        download_ms=arrival.download_ms,
        payload=arrival.payload,
        model_version=arrival.model_version,
        sent_digest=arrival.sent_digest,
    )
    return outcome


def batcher() -> Batcher[Arrival, ResultOutcome]:
    """The running event loop's."""
    return loop_batcher(
        "arrivals", lambda: Batcher(batch=_serve_batch, single=_serve_one, max_batch=MAX_BATCH)
    )
