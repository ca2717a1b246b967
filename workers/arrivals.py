"""One web process's arriving results served in batches (workers/batching.py; issue 15): a round's results
come in together, and each was a thread hop, two transactions and a validation task of its own. A batch is
one call of lifecycle.results_receive; what it leaves, or a batch that fails, is served one result at a time
(result_receive, whose errors reach their own connection)."""

from __future__ import annotations

import dataclasses

from projects.lifecycle import Arrival, ResultOutcome, result_receive, results_receive
from workers.batching import Batcher, pooled_batcher

MAX_BATCH = 32  # results per batch: its transaction holds their rows


def _batch(arrivals: list[Arrival]) -> list[ResultOutcome | None]:
    return results_receive(arrivals=arrivals)


def _one(arrival: Arrival) -> ResultOutcome:
    # Field by field: dataclasses.asdict would deep-copy the user and the payload.
    return result_receive(**{f.name: getattr(arrival, f.name) for f in dataclasses.fields(arrival)})


def batcher() -> Batcher[Arrival, ResultOutcome]:
    """The running event loop's."""
    return pooled_batcher("arrivals", batch=_batch, single=_one, max_batch=MAX_BATCH)
