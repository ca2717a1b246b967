"""20% Byzantine volunteers on the real platform: caught by validation, unpaid, and harmless to training.

The MNIST demo trains to the same model version twice, each time on a fresh stack (daphne + Celery on
their own PostgreSQL database; the preset's fixed seed gives the same initial weights and the data order
is the same): with ten honest simulated volunteers, then with eight honest ones, a sign flipper and a
gradient scaler. Until a volunteer is trusted every update is recomputed on the server, and attackers
never become trusted, so every attack is caught and the model trains as if they were absent.

(One stack with a twin project would save a start-up, but the twin's first honest updates are
byte-identical to the demo's, which the server's replay check rightly rejects.)
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest

from devstack.stack import Stack
from tests.conftest import run_async
from workers.simulator import Simulator, SimulatorConfig, SimulatorStats

# Two stacks, each given up to train()'s liveness bound.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

# Overridable so that several engineers can run the suite side by side on one PostgreSQL / Redis.
DATABASE = os.environ.get("BYZANTINE_STACK_DATABASE", "crowdtrain_byzantine")
REDIS_DB = int(os.environ.get("BYZANTINE_STACK_REDIS_DB", "12"))
PROJECT = "MNIST MLP (demo)"
VERSIONS = 15  # the stack evaluates every 5th version (CROWDTRAIN_EVAL_EVERY), so the last one is evaluated
VOLUNTEERS = 10
ATTACKERS = {"sim-byz-flip": "sign_flip", "sim-byz-scaled": "scaled"}
# 10+ work units of 32 samples per version: with fewer work units than volunteers, whoever the server
# wakes first gets all the work and some honest volunteers would never earn anything. No round timeout:
# the twin's version 0 is minutes old when it starts, and a timed-out round would close with one result.
# Trust after one valid result keeps server recomputation (the bottleneck on 2 cores) mostly for the
# attackers, who never return a valid result and so are never trusted: all their updates are recomputed.
SETTINGS = {
    "batch_size": 32,
    "round_samples": 320,
    "round_timeout": 3600,
    "trust_threshold": 1,
    "max_versions": VERSIONS,
}


@dataclass(frozen=True)
class Run:
    accuracy: float  # test accuracy of version VERSIONS, as the platform's evaluator measured it
    stats: dict[str, SimulatorStats]
    ledger: dict[str, int]  # username -> this project's sum of workers_creditentry.flops
    valid_flops: int  # flops_per_sample x samples over the project's valid results


@contextmanager
def platform(var_dir: Path) -> Iterator[Stack]:
    with Stack(var_dir=var_dir, database=DATABASE, redis_db=REDIS_DB) as running:
        configure(running)
        yield running


def query(stack: Stack, sql: str, *params: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(stack.database_url) as conn:
        return conn.execute(sql, params).fetchall()


def scalar(stack: Stack, sql: str, *params: Any) -> Any:
    rows = query(stack, sql, *params)
    return rows[0][0] if rows else None


def configure(stack: Stack) -> None:
    # The project finishes itself at VERSIONS, so both runs train exactly as far.
    assignments = ", ".join(f"{key} = %s" for key in SETTINGS)
    with psycopg.connect(stack.database_url) as conn:
        conn.execute(
            f"UPDATE projects_project SET {assignments} WHERE name = %s", (*SETTINGS.values(), PROJECT)
        )


def volunteers(stack: Stack, prefix: str, attackers: dict[str, str]) -> list[SimulatorConfig]:
    names = list(attackers) + [f"{prefix}-{i:02d}" for i in range(VOLUNTEERS - len(attackers))]
    return [
        SimulatorConfig(
            url=stack.url,
            username=name,
            password="sim-pass-4321",
            signup=True,
            gflops=0,
            byzantine=attackers.get(name, "none"),
            verdict_timeout_s=5,
            seed=i,
        )
        for i, name in enumerate(names)
    ]


async def until_finished(stack: Stack, project: str, simulators: list[Simulator], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    status = ""
    while status != "finished" and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
        status = await asyncio.to_thread(
            scalar, stack, "SELECT status FROM projects_project WHERE name = %s", project
        )
    for simulator in simulators:
        simulator.stop()


async def simulate(
    stack: Stack, project: str, configs: list[SimulatorConfig], timeout: float
) -> list[SimulatorStats]:
    simulators = [Simulator(config) for config in configs]
    watcher = asyncio.create_task(until_finished(stack, project, simulators, timeout))
    stats = await asyncio.gather(*(s.run() for s in simulators))
    await watcher
    return list(stats)


def final_accuracy(stack: Stack, project: str, timeout: float = 60) -> float:
    """The evaluator's test accuracy of the last version (queued by Celery when it was published)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = scalar(
            stack,
            "SELECT m.value FROM projects_metric m "
            "JOIN projects_modelversion v ON v.id = m.version_id "
            "JOIN projects_project p ON p.id = v.project_id "
            "WHERE p.name = %s AND v.number = %s AND m.name = 'test_accuracy'",
            project,
            VERSIONS,
        )
        if value is not None:
            return float(value)
        time.sleep(0.5)
    raise AssertionError(f"version {VERSIONS} of {project} was never evaluated; see {stack.var_dir}")


def ledger(stack: Stack, project: str, usernames: list[str]) -> dict[str, int]:
    rows = query(
        stack,
        "SELECT u.username, sum(c.flops) FROM workers_creditentry c "
        "JOIN workers_volunteer v ON v.id = c.volunteer_id "
        "JOIN auth_user u ON u.id = v.user_id JOIN projects_project p ON p.id = c.project_id "
        "WHERE p.name = %s GROUP BY u.username",
        project,
    )
    return {name: 0 for name in usernames} | {name: int(flops) for name, flops in rows}


def valid_flops(stack: Stack, project: str) -> int:
    return int(
        scalar(
            stack,
            "SELECT coalesce(sum(p.flops_per_sample * r.samples), 0) FROM projects_result r "
            "JOIN projects_workunit w ON w.id = r.work_unit_id "
            "JOIN projects_project p ON p.id = w.project_id "
            "WHERE p.name = %s AND r.validation = 'valid'",
            project,
        )
    )


# A liveness bound (the project must finish), not a speed target: generous for a loaded machine.
def train(stack: Stack, project: str, configs: list[SimulatorConfig], timeout: float = 400) -> Run:
    stats = run_async(simulate(stack, project, configs, timeout))
    versions = scalar(
        stack,
        "SELECT max(v.number) FROM projects_modelversion v "
        "JOIN projects_project p ON p.id = v.project_id WHERE p.name = %s",
        project,
    )
    assert versions == VERSIONS, f"{project} reached version {versions} only"
    names = [s.username for s in stats]
    return Run(
        final_accuracy(stack, project),
        {s.username: s for s in stats},
        ledger(stack, project, names),
        valid_flops(stack, project),
    )


def test_byzantine_volunteers_are_caught_unpaid_and_do_not_hurt_accuracy(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    started = time.monotonic()
    with platform(tmp_path_factory.mktemp("clean")) as stack:
        clean = train(stack, PROJECT, volunteers(stack, "sim-clean", {}))
    with platform(tmp_path_factory.mktemp("attacked")) as stack:
        attacked = train(stack, PROJECT, volunteers(stack, "sim-honest", ATTACKERS))
    print(
        f"accuracy clean {clean.accuracy:.3f}, attacked {attacked.accuracy:.3f}; "
        f"{time.monotonic() - started:.0f} s; ledger {attacked.ledger}"
    )

    # It learned (chance is 0.1), so comparing the two runs means something.
    assert clean.accuracy > 0.3, clean.accuracy
    assert abs(attacked.accuracy - clean.accuracy) <= 0.02, (clean.accuracy, attacked.accuracy)
    for run in (clean, attacked):
        # The ledger is exactly server-side FLOPs x samples of the valid results, nothing else.
        assert sum(run.ledger.values()) == run.valid_flops > 0
        honest = [name for name in run.stats if name not in ATTACKERS]
        assert all(run.ledger[name] > 0 for name in honest), run.ledger
        assert all(run.stats[name].invalid == 0 for name in honest), [run.stats[n].reasons for n in honest]
    for name in ATTACKERS:
        stats = attacked.stats[name]
        assert attacked.ledger[name] == 0 and stats.credit_flops == 0 and stats.valid == 0, stats
        assert stats.invalid > 0 and all("recomputation" in r or "norm" in r for r in stats.reasons), stats
