"""64 fast simulated volunteers on the real stack, as benchmarks/server/throughput.py drives it (daphne, the
Celery worker, the validator and beat on PostgreSQL and Redis): work flows, PostgreSQL detects no deadlock,
and no work unit is accepted or aggregated more often than it wanted. Its profile helper is tested too."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psycopg
import pytest

from benchmarks.server import throughput
from devstack.stack import ROOT, Stack

VOLUNTEERS = 64
# After the run: more accepted results, or more aggregated ones, than a work unit wanted.
OVER_ACCEPTED = """
    SELECT w.id FROM projects_workunit w JOIN projects_result r ON r.work_unit_id = w.id GROUP BY w.id
    HAVING count(*) FILTER (WHERE r.validation = 'valid') > w.target_results
        OR count(*) FILTER (WHERE r.aggregated) > 1"""


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    args = throughput.parser().parse_args(["--database", "crowdtrain_throughput_test", "--redis-db", "12"])
    with throughput.stack_for(args, ROOT, tmp_path, "test") as running:
        yield running


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_64_volunteers_on_the_real_stack_cause_no_deadlock(stack: Stack) -> None:
    throughput.django_ready()
    args = throughput.parser().parse_args(
        ["--volunteers", str(VOLUNTEERS), "--seconds", "20", "--warmup", "10"]
    )
    project_id = throughput.demo_project(stack)
    with ThreadPoolExecutor(max_workers=1) as pool:  # a loop of its own (see test_web_server.py)
        (row,) = pool.submit(asyncio.run, throughput.curve(stack, project_id, args, "test")).result()
    with psycopg.connect(stack.database_url, autocommit=True) as conn:
        over = conn.execute(OVER_ACCEPTED).fetchall()
        deadlocks = conn.execute(
            "SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()"
        ).fetchone()
    assert row["validated"] > 0 and row["assigned"] > 0, row
    assert not row["crashed"], row["crashed"]
    assert deadlocks == (0,), "PostgreSQL broke deadlocks between the platform's transactions"
    assert over == []


def test_top_frames_counts_a_function_once_per_stack_whichever_line() -> None:
    collapsed = "\n".join(
        [
            "main (a.py:1);work_unit_offer (projects/lifecycle.py:10);wait (psycopg/connection.py:5) 3",
            "main (a.py:1);work_unit_offer (projects/lifecycle.py:12) 1",
            "main (a.py:2);select (selectors.py:9) 4",
        ]
    )
    text = throughput.top_frames(collapsed, title="t", top=5)
    assert "8 samples" in text
    ours = text.split("platform code")[1].split("-- top")[0]
    assert "50.0%  work_unit_offer (projects/lifecycle.py)" in ours
    assert "main" not in ours  # not the platform's own code
    assert " 37.5%  wait (psycopg/connection.py)" in text.split("self")[-1]
