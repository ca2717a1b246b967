"""Chaos in pipeline mode (issue 14): the MNIST MLP demo cut in 3 stages on the real stack (daphne, Celery
worker and beat, PostgreSQL, a private Redis), honest simulated volunteers speaking the stage protocol. A
stage's volunteer is killed mid-unit and daphne is restarted; training goes on to the next versions, no stage
unit is lost or counted twice, and the ledger equals the FLOPs of the validated units exactly."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import psycopg
import pytest

from engine.graph import load_graph
from engine.partition import MemoryModel, Partition, partition
from tests.chaos.harness import (
    DATA_PARALLEL_BOOKS,
    crowd_of,
    holds_work,
    latest_version,
    project_id,
    scalar,
    settle,
    violations,
    wait_for_version,
)
from tests.chaos.stack import DEMO_PROJECT, ChaosStack

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

STAGES, MICRO = 3, 2
BEFORE, AFTER = 1, 2
PROGRESS_TIMEOUT = 150.0
HEARTBEAT_SECONDS = 5
# Slow enough that each of its stage-0 units takes about 3 s (killed within a second of getting one, it is
# mid-unit), fast enough for the work-unit deadline (tests/chaos/stack.DEADLINE_SECONDS).
VICTIM_GFLOPS = 0.003
JUST_GIVEN = (
    "SELECT count(*) FROM projects_result r JOIN auth_user u ON u.id = r.volunteer_id WHERE u.username = %s "
    "AND r.status = 'in_progress' AND r.sent_at > now() - interval '1 second'"
)
OPEN_UNITS = "SELECT count(*) FROM projects_workunit WHERE status = 'open' AND stage_kind <> ''"


@dataclass
class PipelineChaosStack(ChaosStack):
    database: str = field(
        default_factory=lambda: os.environ.get("CHAOS_STACK_DATABASE", "crowdtrain_chaos") + "_pipeline"
    )

    def env(self) -> dict[str, str]:
        # The victim's device dies with daphne, uncleanly, and holds stage 0 until the sweep finds it stale
        # (4 heartbeats: 2 minutes at the default 30 s, the stage idle all along); the same sweep at 5 s.
        return {**super().env(), "CROWDTRAIN_SOCKET_HEARTBEAT_SECONDS": str(HEARTBEAT_SECONDS)}

    def spawn_processes(self) -> None:
        # Before the worker starts: the feed project_start queued then cuts the first step's stage units.
        self.sql(
            "UPDATE projects_project SET mode = 'pipeline', pipeline_stages = %s, micro_batches = %s, "
            "activation_codec = 'fp16' WHERE name = %s",
            STAGES,
            MICRO,
            DEMO_PROJECT,
        )
        self.sql("UPDATE projects_workunit SET status = 'cancelled' WHERE status = 'open'")
        super().spawn_processes()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PipelineChaosStack]:
    with PipelineChaosStack(var_dir=tmp_path_factory.mktemp("pipeline-chaos")) as running:
        yield running


def progress(stack: ChaosStack, versions: int) -> int:
    target = latest_version(stack) + versions
    reached = wait_for_version(stack, target, PROGRESS_TIMEOUT)
    tail = "\n".join(f"--- {name}.log\n{stack.log(name)[-1500:]}" for name in ("worker", "web"))
    assert reached >= target, f"training stalled at v{reached} (wanted v{target}):\n{tail}"
    return reached


def wait_until(what: str, done: Callable[[], bool], timeout: float = PROGRESS_TIMEOUT) -> None:
    """A liveness bound (generous: a loaded machine is not a stall)."""
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"{what} did not happen in {timeout:.0f} s"
        time.sleep(0.02)


def test_a_stage_volunteer_killed_mid_unit_and_daphne_restarted(stack: PipelineChaosStack) -> None:
    wait_until("the first step's feed", lambda: bool(scalar(stack, OPEN_UNITS)))
    with crowd_of(stack) as crowd:
        # One volunteer per stage. The victim first: it joins stage 0 (the only one with ready units) and
        # is alone there, so it holds a unit most of the time; the others fill stages 1 and 2.
        crowd.join("victim", gflops=VICTIM_GFLOPS)
        wait_until("the victim holding a unit", lambda: holds_work(stack, "victim"))
        for i in range(1, STAGES):
            crowd.join(f"stage-{i}")
        progress(stack, BEFORE)
        wait_until("the victim given a unit", lambda: bool(scalar(stack, JUST_GIVEN, "victim")))
        crowd.kill("victim")
        stack.restart("web", signal.SIGTERM)  # every other volunteer's socket drops too
        progress(stack, AFTER)
    assert crowd.crashed() == {}
    assert crowd.total("reconnects") > 0
    settle(stack)
    assert violations(stack, skip=DATA_PARALLEL_BOOKS) == {}
    assert pipeline_problems(stack) == {}
    # Its unit went back (released when its socket closed, or timed out) and someone else computed it.
    lost = rows(
        stack,
        "SELECT r.id, w.status FROM projects_result r JOIN projects_workunit w ON w.id = r.work_unit_id "
        "JOIN auth_user u ON u.id = r.volunteer_id WHERE u.username = 'victim' "
        "AND r.status IN ('released', 'timed_out')",
    )
    assert lost and all(status == "validated" for _, status in lost), lost


def rows(stack: ChaosStack, query: str, *params: object) -> list[tuple[Any, ...]]:
    with psycopg.connect(stack.database_url) as conn:
        return conn.execute(query, params).fetchall()


def pipeline_problems(stack: ChaosStack) -> dict[str, list[Any]]:
    """The pipeline's own books: each stage unit validated once with one valid result, each published step
    complete (M x (forward units + backward units) per micro-batch), its backward results aggregated once,
    and every credit entry worth its unit's stage FLOPs (so the ledger is their sum, exactly)."""
    parts = stage_partition(stack)
    per_micro_batch = (
        sum(1 for s in parts.stages if not s.last)
        + 1
        + sum(1 for s in parts.stages[1:] if s.needs_input_grad)
    )
    found: dict[str, list[Any]] = {}
    twice = rows(
        stack,
        "SELECT work_unit_id, count(*) FROM projects_result WHERE validation = 'valid' "
        "GROUP BY work_unit_id HAVING count(*) > 1",
    )
    latest = latest_version(stack)
    steps = rows(
        stack,
        "SELECT v.number, count(w.id) FILTER (WHERE w.status = 'validated'), "
        "count(r.id) FILTER (WHERE r.aggregated) FROM projects_modelversion v "
        "LEFT JOIN projects_workunit w ON w.version_id = v.id "
        "LEFT JOIN projects_result r ON r.work_unit_id = w.id AND r.aggregated "
        "WHERE v.project_id = %s AND v.number < %s GROUP BY v.number ORDER BY v.number",
        project_id(stack),
        latest,
    )
    backward = per_micro_batch - sum(1 for s in parts.stages if not s.last)
    incomplete = [row for row in steps if row[1] != MICRO * per_micro_batch or row[2] != MICRO * backward]
    credit = rows(
        stack,
        "SELECT c.id, c.flops, w.stage_kind, w.stage, w.count, w.status FROM workers_creditentry c "
        "JOIN projects_result r ON r.id = c.result_id JOIN projects_workunit w ON w.id = r.work_unit_id",
    )
    miscredited = [row for row in credit if row[1] != unit_flops(parts, row[2], row[3], row[4])]
    unvalidated = [row for row in credit if row[5] != "validated"]
    for name, broken in (
        ("stage unit with more than one valid result", twice),
        ("published step not complete, or not aggregated once", incomplete),
        ("credit entry not worth its unit's stage FLOPs", miscredited),
        ("credit for a unit not validated", unvalidated),
    ):
        if broken:
            found[name] = broken[:5]
    if not credit or len(steps) < BEFORE + AFTER:
        found["too little happened to check"] = [len(credit), len(steps)]
    return found


def stage_partition(stack: ChaosStack) -> Partition:
    """The demo's stages, cut from its graph exactly as the server cuts them (projects/stages.py)."""
    ((graph_id, batch, stages, budget, micro_batches),) = rows(
        stack,
        "SELECT graph_id, batch_size, pipeline_stages, device_memory_mb, micro_batches "
        "FROM projects_project WHERE name = %s",
        DEMO_PROJECT,
    )
    graph = load_graph((stack.blob_root / graph_id[:2] / graph_id).read_bytes())
    memory = MemoryModel(
        budget_bytes=budget * 2**20 if budget else None, micro_batch=batch, optimizer_slots=0
    )
    return partition(graph, stages, memory, micro_batches=micro_batches)  # the cut depends on M


def unit_flops(parts: Partition, kind: str, stage: int, count: int) -> int:
    part = parts.stages[stage]
    return (part.forward_flops if kind == "forward" else part.backward_unit_flops) * count
