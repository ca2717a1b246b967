"""Simulated volunteers speaking the stage protocol to the real platform (daphne + Celery on their own
PostgreSQL database): the seeded MLP demo switched to pipeline mode before the processes start."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

import psycopg
import pytest

from devstack.stack import Stack
from tests.integration.test_simulator import latest_version, ledger, run, volunteer

pytestmark = pytest.mark.slow

DATABASE = os.environ.get("SIM_STACK_DATABASE", "crowdtrain_sim") + "_pipeline"
REDIS_DB = int(os.environ.get("SIM_STACK_REDIS_DB", "11"))


@dataclass
class PipelineStack(Stack):
    def spawn_processes(self) -> None:
        with psycopg.connect(self.database_url) as conn:
            conn.execute(
                "UPDATE projects_project SET mode = 'pipeline', pipeline_stages = 3, micro_batches = 2, "
                "activation_codec = 'fp16', round_timeout = 3600"
            )
            conn.execute("UPDATE projects_workunit SET status = 'cancelled' WHERE status = 'open'")
        super().spawn_processes()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with PipelineStack(
        var_dir=tmp_path_factory.mktemp("pipe-stack"), database=DATABASE, redis_db=REDIS_DB
    ) as up:
        yield up


def stage_units_credit(stack: Stack, username: str) -> int:
    """What the ledger must hold: each valid stage result's FLOPs, recounted from the stage units' kinds."""
    with psycopg.connect(stack.database_url) as conn:
        row = conn.execute(
            "SELECT count(*) FILTER (WHERE w.stage_kind = ''), count(*) FROM projects_result r "
            "JOIN projects_workunit w ON w.id = r.work_unit_id JOIN auth_user u ON u.id = r.volunteer_id "
            "WHERE u.username = %s AND r.validation = 'valid'",
            (username,),
        ).fetchone()
    assert row is not None and row[0] == 0  # only stage units were worked on
    return ledger(stack, username)


def test_simulated_volunteers_compute_stage_units_and_steps_are_published(stack: Stack) -> None:
    stats = run(
        stack,
        volunteer(stack, "sim-stage-1", max_work_units=10),
        volunteer(stack, "sim-stage-2", max_work_units=10, prefetch=True),
    )
    for s in stats:
        assert (s.work_units, s.invalid, s.errors, s.unanswered) == (10, 0, 0, 0), s
        assert s.valid == 10, s.reasons
        assert s.credit_flops == stage_units_credit(stack, s.username) > 0
    assert latest_version(stack) >= 1
