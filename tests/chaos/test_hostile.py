"""A hostile fifth of the crowd: 1 volunteer in 5 sends poisoned results for its own work units.

The attacker (workers/simulator.py, byzantine="poison") sends in turn a safetensors header nested 100,000
deep, NaN tensors, wrong shapes, an honest update claiming model version + 999 and one claiming
compute_ms 2**63 - 1. On one stack, two phases of fresh accounts: 4 honest volunteers alone, then 4 honest
volunteers and the attacker. Each honest volunteer does the same number of work units in both phases, so
progress is compared per honest work unit (wall time on a shared 2-core machine is noise): the attacked
phase must publish >= 80% of the clean phase's versions per honest result, every honest volunteer must
finish (training never stalls), and the attacker must earn nothing.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from devstack.stack import Stack
from tests.conftest import run_async
from tests.security.fuzz import Phase, earned, hostile_phase

pytestmark = pytest.mark.slow

# Overridable so that several engineers can run the suite side by side on one PostgreSQL / Redis.
DATABASE = os.environ.get("HOSTILE_STACK_DATABASE", "crowdtrain_hostile")
REDIS_DB = int(os.environ.get("HOSTILE_STACK_REDIS_DB", "9"))
HONEST, ATTACKERS = 4, 1  # 20% of the volunteers attack
WORK_UNITS = 12  # per honest volunteer and phase: ~12 rounds of 4 work units
CAP_SECONDS = 240.0  # a phase whose honest volunteers have not finished by then has stalled
MIN_RATIO = 0.8


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    # The demo's rounds are 4 work units (256 samples in 64s), so every round needs several volunteers
    # and an attacker holds some of each round's work; a round short of results closes after 10 s.
    with Stack(
        var_dir=tmp_path_factory.mktemp("hostile-stack"),
        database=DATABASE,
        redis_db=REDIS_DB,
        round_timeout=10,
    ) as running:
        yield running


def phase(stack: Stack, label: str, attackers: int) -> Phase:
    return run_async(
        hostile_phase(
            stack.url,
            stack.database_url,
            label=label,
            honest=HONEST,
            attackers=attackers,
            work_units=WORK_UNITS,
            cap_seconds=CAP_SECONDS,
        )
    )


def test_poisoning_fifth_neither_stalls_training_nor_earns(stack: Stack) -> None:
    clean = phase(stack, "clean", attackers=0)
    attacked = phase(stack, "attacked", attackers=ATTACKERS)

    books = f"clean: {clean.summary()}\nattacked: {attacked.summary()}"
    assert clean.completed and clean.versions > 0, books
    assert attacked.completed, f"training stalled under attack\n{books}"
    assert attacked.versions_per_honest_result >= MIN_RATIO * clean.versions_per_honest_result, books
    assert earned(stack.database_url, "attacked-attacker") == (0, 0), books
    assert all(a.credit_flops == 0 for a in attacked.attackers if not isinstance(a, BaseException)), books
    assert sum(s.invalid for s in attacked.honest_stats()) == 0, books
