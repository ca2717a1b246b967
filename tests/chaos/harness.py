"""Simulated volunteers run in a background event loop, so a test can hurt the stack while they train;
then the books are checked with SQL on one consistent snapshot."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Coroutine, Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any, TypeVar

import psycopg
from websockets.exceptions import InvalidStatus

from projects.lifecycle import VALIDATION_RETRY_SECONDS
from tests.chaos.stack import DEADLINE_SECONDS, DEMO_PROJECT, ChaosStack
from workers.simulator import Simulator, SimulatorConfig, SimulatorStats

T = TypeVar("T")
logger = logging.getLogger(__name__)
PASSWORD = "chaos-volunteer-pass-8642"
TRANSITION_PERIOD = 5.0  # celery beat runs the transitioner this often (settings.CELERY_BEAT_SCHEDULE)


class Crowd:
    """Honest simulated volunteers at full speed (gflops=0: no emulated delays) on their own loop."""

    def __init__(self, stack: ChaosStack, url: str | None = None) -> None:
        self.stack = stack
        self.url = url or stack.url  # a load balancer's, to spread the crowd over several daphnes
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="crowd")
        self.thread.start()
        self.sims: dict[str, Simulator] = {}
        self.tasks: dict[str, asyncio.Task[SimulatorStats]] = {}
        self.rejected_handshakes = 0

    def join(self, name: str, **overrides: Any) -> None:
        defaults: dict[str, Any] = {"gflops": 0, "seed": sum(map(ord, name))}
        config = SimulatorConfig(
            url=self.url, username=name, password=PASSWORD, signup=True, **{**defaults, **overrides}
        )
        self.sims[name] = Simulator(config)
        self.tasks[name] = self._call(self._spawn(self.sims[name]))

    async def _spawn(self, sim: Simulator) -> asyncio.Task[SimulatorStats]:
        return asyncio.create_task(self._volunteer(sim))

    async def _volunteer(self, sim: Simulator) -> SimulatorStats:
        while True:
            try:
                return await sim.run()
            except InvalidStatus as exc:
                # workers/simulator.py gives up when daphne refuses the handshake (HTTP 500 while Redis
                # is down: group_add fails in connect()); a browser tab retries. Until the simulator
                # does, join again here, and count it so the test can say it happened.
                self.rejected_handshakes += 1
                logger.warning("%s: handshake refused (%s); joining again", sim.config.username, exc)
                await asyncio.sleep(1)

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def kill(self, name: str) -> None:
        """Cancel the volunteer's task wherever it is (usually mid-work-unit), like a closed tab."""
        self._call(self._cancel([self.tasks[name]]))

    def stop(self, timeout: float = 30) -> None:
        self._call(self._cancel(list(self.tasks.values()), timeout))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)

    @staticmethod
    async def _cancel(tasks: list[asyncio.Task[SimulatorStats]], timeout: float = 30) -> None:
        for task in tasks:
            task.cancel()
        # Wait for the tasks, not just the request: `async with connect()` has then closed the socket
        # and the server has seen the disconnect (and released the volunteer's work).
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)

    def crashed(self) -> dict[str, str]:
        """Volunteers that gave up on their own (a simulator must ride out every fault by reconnecting)."""
        return {
            name: repr(task.exception())
            for name, task in self.tasks.items()
            if task.done() and not task.cancelled() and task.exception() is not None
        }

    def total(self, stat: str) -> int:
        return sum(int(getattr(sim.stats, stat)) for sim in self.sims.values())


@contextmanager
def crowd_of(stack: ChaosStack, url: str | None = None) -> Iterator[Crowd]:
    crowd = Crowd(stack, url)
    try:
        yield crowd
    finally:
        crowd.stop()


# --- reading the database ---------------------------------------------------------------------------


def scalar(stack: ChaosStack, query: str, *params: object) -> Any:
    with psycopg.connect(stack.database_url) as conn:
        row = conn.execute(query, params).fetchone()
    return row[0] if row else None


def project_id(stack: ChaosStack) -> int:
    return int(scalar(stack, "SELECT id FROM projects_project WHERE name = %s", DEMO_PROJECT))


def latest_version(stack: ChaosStack) -> int:
    return int(scalar(stack, "SELECT coalesce(max(number), 0) FROM projects_modelversion"))


def wait_for_version(stack: ChaosStack, number: int, timeout: float) -> int:
    """Block until version `number` is published; the latest number either way."""
    started = time.monotonic()
    while (latest := latest_version(stack)) < number and time.monotonic() < started + timeout:
        time.sleep(0.5)
    logger.info("v%d reached (wanted v%d) in %.1fs", latest, number, time.monotonic() - started)
    return latest


def holds_work(stack: ChaosStack, username: str) -> bool:
    return bool(
        scalar(
            stack,
            "SELECT count(*) FROM projects_result r JOIN auth_user u ON u.id = r.volunteer_id "
            "WHERE u.username = %s AND r.status = 'in_progress'",
            username,
        )
    )


def wait_until_holding(stack: ChaosStack, username: str, timeout: float = 30) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if holds_work(stack, username):
            return True
        time.sleep(0.05)
    return False


def wait_for_validation_backlog(stack: ChaosStack, timeout: float = 30) -> bool:
    """Block until a result that just arrived waits for the worker: killing it then lands mid-task.
    (Only fresh ones: a result whose validation was lost earlier would wait forever.)"""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if scalar(
            stack,
            "SELECT count(*) FROM projects_result WHERE status = 'received' AND validation = 'pending' "
            "AND received_at > now() - interval '1 second'",
        ):
            return True
        time.sleep(0.05)
    return False


def settle(stack: ChaosStack) -> None:
    """After the volunteers stopped: let the worker drain its queue and the transitioner time out
    orphaned instances (held by connections that died with daphne). Returns when quiet or out of time;
    the invariants then say what, if anything, never settled."""
    # Orphans expire at their deadline, lost validations are retried after VALIDATION_RETRY_SECONDS; both
    # by the transitioner, which beat runs every TRANSITION_PERIOD.
    patience = max(DEADLINE_SECONDS, VALIDATION_RETRY_SECONDS) + 3 * TRANSITION_PERIOD
    started = time.monotonic()
    while time.monotonic() < started + patience:
        unvalidated, in_progress = _queue_depths(stack)
        if not unvalidated and not in_progress:
            break
        time.sleep(0.5)
    logger.info("settled in %.1fs", time.monotonic() - started)


def _queue_depths(stack: ChaosStack) -> tuple[int, int]:
    with psycopg.connect(stack.database_url) as conn:
        row = conn.execute(
            "SELECT count(*) FILTER (WHERE status = 'received' AND validation = 'pending'), "
            "count(*) FILTER (WHERE status = 'in_progress') FROM projects_result"
        ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


# --- the invariants -----------------------------------------------------------------------------------

# Each query returns rows that break an invariant (empty = holds), and says why in its name.
VIOLATIONS = {
    "work unit in an unknown state": """
        SELECT id, status FROM projects_workunit
        WHERE status NOT IN ('open', 'validated', 'errored', 'cancelled')""",
    "instance still in progress past its deadline (lost)": """
        SELECT r.id, r.work_unit_id, w.status, r.deadline FROM projects_result r
        JOIN projects_workunit w ON w.id = r.work_unit_id
        WHERE r.status = 'in_progress' AND r.deadline < now()""",
    "instance in progress on a closed work unit": """
        SELECT r.id, r.work_unit_id, w.status FROM projects_result r
        JOIN projects_workunit w ON w.id = r.work_unit_id
        WHERE r.status = 'in_progress' AND w.status <> 'open'""",
    "received result never validated (its validation task was lost)": """
        SELECT id, work_unit_id, received_at FROM projects_result
        WHERE status = 'received' AND validation = 'pending'""",
    "validated work unit without a valid result": """
        SELECT w.id FROM projects_workunit w WHERE w.status = 'validated' AND NOT EXISTS (
            SELECT 1 FROM projects_result r WHERE r.work_unit_id = w.id AND r.validation = 'valid')""",
    "aggregated result that is not valid": """
        SELECT id, status, validation FROM projects_result
        WHERE aggregated AND (validation <> 'valid' OR status <> 'received')""",
    "credit entry for a result that is not valid": """
        SELECT c.id, c.result_id, r.validation FROM workers_creditentry c
        JOIN projects_result r ON r.id = c.result_id WHERE r.validation <> 'valid'""",
    "valid result without a credit entry": """
        SELECT r.id FROM projects_result r LEFT JOIN workers_creditentry c ON c.result_id = r.id
        WHERE r.validation = 'valid' AND c.id IS NULL""",
    "credit entry not worth flops_per_sample x count": """
        SELECT c.id, c.flops, p.flops_per_sample * w.count FROM workers_creditentry c
        JOIN projects_result r ON r.id = c.result_id JOIN projects_workunit w ON w.id = r.work_unit_id
        JOIN projects_project p ON p.id = w.project_id WHERE c.flops <> p.flops_per_sample * w.count""",
    "volunteer total_flops differs from its ledger": """
        SELECT v.id, v.total_flops, coalesce(sum(c.flops), 0) FROM workers_volunteer v
        LEFT JOIN workers_creditentry c ON c.volunteer_id = v.id
        GROUP BY v.id HAVING v.total_flops <> coalesce(sum(c.flops), 0)""",
    "ledger total differs from the FLOPs of valid results": """
        SELECT ledger, owed FROM
            (SELECT coalesce(sum(flops), 0) AS ledger FROM workers_creditentry) l,
            (SELECT coalesce(sum(p.flops_per_sample * w.count), 0) AS owed FROM projects_result r
             JOIN projects_workunit w ON w.id = r.work_unit_id JOIN projects_project p ON p.id = w.project_id
             WHERE r.validation = 'valid') o
        WHERE ledger <> owed""",
    # A result aggregated into two versions would count its samples twice.
    "versions' samples differ from the samples of aggregated results": """
        SELECT versions, aggregated FROM
            (SELECT coalesce(sum(samples), 0) AS versions FROM projects_modelversion WHERE number > 0) v,
            (SELECT coalesce(sum(samples), 0) AS aggregated FROM projects_result WHERE aggregated) a
        WHERE versions <> aggregated""",
    # Storage reclaimed during the faults (beat's collect_storage every STORAGE_SWEEP seconds, no grace).
    "version without weights that was not pruned": """
        SELECT id, number FROM projects_modelversion WHERE weights_id IS NULL AND pruned_at IS NULL""",
    "received result awaiting a verdict without its update": """
        SELECT id, work_unit_id FROM projects_result
        WHERE status = 'received' AND validation = 'pending' AND blob_id IS NULL""",
    "update released from a work unit still open": """
        SELECT r.id, r.work_unit_id FROM projects_result r JOIN projects_workunit w ON w.id = r.work_unit_id
        WHERE w.status = 'open' AND r.status = 'received' AND r.validation <> 'invalid'
        AND r.blob_id IS NULL""",
}
# The data-parallel modes' books: a pipeline stage unit is credited its stage's FLOPs, and a version
# aggregates the backward results of every stage (tests/chaos/test_pipeline.py checks those books instead).
DATA_PARALLEL_BOOKS = (
    "credit entry not worth flops_per_sample x count",
    "ledger total differs from the FLOPs of valid results",
    "versions' samples differ from the samples of aggregated results",
)
# Every column that refers to a blob (projects.blobs.blob_references, as
# tests/integration/test_storage.py's KNOWN_REFERENCES lists them).
BLOB_COLUMNS = (
    ("projects_datasetshard", "blob_id"),
    ("projects_project", "graph_id"),
    ("projects_modelversion", "weights_id"),
    ("projects_modelversion", "wire_weights_id"),
    ("projects_modelversion", "optimizer_state_id"),
    ("projects_workunit", "reference_id"),
    ("projects_workunit", "input_blob_id"),
    ("projects_workunit", "grad_blob_id"),
    ("projects_workunit", "stage_graph_id"),
    ("projects_workunit", "stage_weights_id"),
    ("projects_result", "blob_id"),
)


def violations(stack: ChaosStack, *, skip: tuple[str, ...] = ()) -> dict[str, list[tuple[Any, ...]]]:
    """Every broken invariant with (up to 5 of) its offending rows, read in one snapshot: beat keeps
    running, and a round closing mid-check must not look like a broken ledger. `skip`: invariants (by
    name) that do not apply, e.g. DATA_PARALLEL_BOOKS in pipeline mode."""
    found: dict[str, list[tuple[Any, ...]]] = {}
    with psycopg.connect(stack.database_url) as conn:
        conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        with conn.transaction():
            for name, query in VIOLATIONS.items():
                if name in skip:
                    continue
                rows = conn.execute(query).fetchall()
                if rows:
                    found[name] = rows[:5]
            versions = conn.execute(
                "SELECT number, weights_id FROM projects_modelversion WHERE project_id = %s ORDER BY number",
                (project_id(stack),),
            ).fetchall()
            referenced = _referenced_blobs(conn)
    missing = _missing_blobs(stack, referenced)
    found.update(_version_problems([(int(n), sha) for n, sha in versions], missing))
    found.update(_blob_problems(referenced, missing))
    return found


def _version_problems(
    versions: list[tuple[int, str | None]], missing: set[str]
) -> dict[str, list[tuple[Any, ...]]]:
    found: dict[str, list[tuple[Any, ...]]] = {}
    numbers = [n for n, _ in versions]
    if numbers != list(range(len(numbers))):
        found["version numbers not contiguous from 0"] = [tuple(numbers)]
    lost = [(n, sha) for n, sha in versions if sha in missing]
    if lost:
        found["version without its weights file on disk"] = lost[:5]
    return found


Referenced = list[tuple[str, str, datetime | None]]


def _referenced_blobs(conn: psycopg.Connection[Any]) -> Referenced:
    """(table, sha, when the blob's row was created or None if the row is gone) for every blob some row
    refers to."""
    rows: Referenced = []
    for table, column in BLOB_COLUMNS:
        query = (
            f"SELECT DISTINCT t.{column}, b.created_at FROM {table} t "
            f"LEFT JOIN projects_blob b ON b.sha256 = t.{column} WHERE t.{column} IS NOT NULL"
        )
        rows += [(table, str(ref), created) for ref, created in conn.execute(query).fetchall()]
    return rows


def _missing_blobs(stack: ChaosStack, referenced: Referenced) -> set[str]:
    """Blobs referenced in the snapshot whose bytes are not stored, and still referenced by the very same row
    afterwards. Beat's sweep keeps running while the bytes are looked for (each one a request when they are
    in a bucket): a blob released and collected after the snapshot was rightly deleted, and one stored again
    has a new row."""
    absent = {sha: created for _, sha, created in referenced if created and not stack.blob_stored(sha)}
    if not absent:
        return set()
    with psycopg.connect(stack.database_url) as conn:
        rows = conn.execute(
            "SELECT sha256, created_at FROM projects_blob WHERE sha256 = ANY(%s)", (list(absent),)
        ).fetchall()
        same_row = {sha for sha, created in rows if absent[sha] == created}
        referenced_now: set[str] = set()
        for table, column in BLOB_COLUMNS:
            query = f"SELECT DISTINCT {column} FROM {table} WHERE {column} = ANY(%s)"
            referenced_now |= {sha for (sha,) in conn.execute(query, (list(absent),)).fetchall()}
    missing = {sha for sha in same_row & referenced_now if not stack.blob_stored(sha)}
    logger.info(
        "%d blobs absent after the snapshot, %d of them collected since",
        len(absent),
        len(absent) - len(missing),
    )
    return missing


def _blob_problems(referenced: Referenced, missing: set[str]) -> dict[str, list[Any]]:
    """A blob some row refers to must have its row (the foreign keys see to that) and its file on disk (or
    its object in the bucket)."""
    found: dict[str, list[Any]] = {}
    no_row = [(table, sha) for table, sha, created in referenced if created is None]
    no_file = [(table, sha) for table, sha, _ in referenced if sha in missing]
    if no_row:
        found["referenced blob without its row"] = no_row[:5]
    if no_file:
        found["referenced blob without its file on disk"] = no_file[:5]
    return found


def storage_reclaimed(stack: ChaosStack) -> tuple[int, int]:
    """(versions pruned, results whose update was released): the sweep ran during the test."""
    pruned = scalar(stack, "SELECT count(*) FROM projects_modelversion WHERE pruned_at IS NOT NULL")
    released = scalar(stack, "SELECT count(*) FROM projects_result WHERE blob_id IS NULL AND digest <> ''")
    return int(pruned), int(released)


def wait_for_storage_sweep(stack: ChaosStack, timeout: float = 60) -> tuple[int, int]:
    """storage_reclaimed once some update was released, or at the timeout. Beat queues the sweep every few
    seconds, but on a loaded machine the worker may reach it only after the validations ahead of it."""
    deadline = time.monotonic() + timeout
    while (reclaimed := storage_reclaimed(stack))[1] == 0 and time.monotonic() < deadline:
        time.sleep(0.5)
    return reclaimed
