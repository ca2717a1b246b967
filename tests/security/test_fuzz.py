"""The protocol fuzzer (tests/security/fuzz.py) against the real stack while honest volunteers train.

>= 10,000 hostile frames from three ordinary volunteer accounts, two connections each, reconnecting all
the time; meanwhile two simulated volunteers train the demo project. Afterwards: no connection closed with
1011 or left hanging, no traceback in any process log, no HTTP 500, the books balance, the fuzz accounts
earned nothing, and the model kept getting new versions during and after the fuzz. Every distinct failure
is listed with the frame that caused it (see `make fuzz` for the longer run).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from devstack.stack import Stack
from projects.lifecycle import VALIDATION_GIVE_UP_SECONDS
from tests.conftest import run_async
from tests.security.fuzz import UNTHROTTLED, Campaign, campaign

pytestmark = pytest.mark.slow

# Overridable so that several engineers can run the suite side by side on one PostgreSQL / Redis.
DATABASE = os.environ.get("FUZZ_STACK_DATABASE", "crowdtrain_fuzz")
REDIS_DB = int(os.environ.get("FUZZ_STACK_REDIS_DB", "10"))
FRAMES = 10_000
PROCESSES = ("web", "worker", "validator", "beat")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    # Short rounds: a round that lost its work units to fuzz accounts closes soon with what it has.
    with Stack(
        var_dir=tmp_path_factory.mktemp("fuzz-stack"),
        database=DATABASE,
        redis_db=REDIS_DB,
        extra_env=UNTHROTTLED,
        round_timeout=5,
    ) as running:
        yield running


def test_fuzzed_protocol_never_crashes_stalls_or_pays(stack: Stack) -> None:
    outcome: Campaign = run_async(
        campaign(stack.url, stack.database_url, frames=FRAMES, web_log=stack.var_dir / "web.log")
    )

    report = outcome.report
    assert report.frames >= FRAMES, report.render()
    logs = {name: stack.log(name) for name in PROCESSES}
    problems = outcome.problems(logs, stack.database_url, give_up_seconds=VALIDATION_GIVE_UP_SECONDS)
    assert not problems, "\n\n".join([report.render(), f"versions: {outcome.versions}", *problems])
    assert report.crashes == report.stalls == report.server_500s == 0
