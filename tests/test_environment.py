"""tests/environment.py: `make test` runs pytest-xdist workers, and none may touch another's
databases, Redis or blob files (a stack's DROP DATABASE or FLUSHDB in one would break the other's tests)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from devstack.stack import ROOT

pytestmark = pytest.mark.slow

PROBE = """
import json, os
from pathlib import Path

import pytest
import redis

from devstack import stack


@pytest.mark.parametrize("n", range(6))
def test_probe(n):
    worker = os.environ["PYTEST_XDIST_WORKER"]
    redis.Redis.from_url(os.environ["REDIS_URL"]).set("probe", worker)
    Path(os.environ["PROBE_OUT"], worker + ".json").write_text(json.dumps({
        "prefix": stack.DATABASE_PREFIX,
        "stack_redis": stack.REDIS_SERVER,
        "redis_url": os.environ["REDIS_URL"],
        "database_url": os.environ["DATABASE_URL"],
        "var_dir": os.environ["CROWDTRAIN_VAR_DIR"],
    }))
"""


def test_two_workers_get_their_own_stack_databases_and_redis(tmp_path: Path) -> None:
    (tmp_path / "test_probe.py").write_text(PROBE)
    env = {**os.environ, "PROBE_OUT": str(tmp_path), "CROWDTRAIN_STACK_DB_PREFIX": "probe_"}
    for name in ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "CROWDTRAIN_STACK_REDIS"):
        env.pop(name, None)
    command = [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "load", "-p", "no:cacheprovider"]
    ran = subprocess.run(
        [*command, "-p", "tests.environment", "--rootdir", str(tmp_path), str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    seen = {path.stem: json.loads(path.read_text()) for path in tmp_path.glob("gw*.json")}
    assert set(seen) == {"gw0", "gw1"}
    assert [seen[w]["prefix"] for w in ("gw0", "gw1")] == ["probe_gw0_", "probe_gw1_"]
    first, second = seen["gw0"], seen["gw1"]
    assert first["stack_redis"] != second["stack_redis"]
    assert first["redis_url"] != second["redis_url"]
    assert first["database_url"] == second["database_url"]  # pytest-django adds each worker's suffix
    # Blob files too: a test counting the files a request left must not see the other worker's.
    assert Path(first["var_dir"]).name == "gw0" and Path(second["var_dir"]).name == "gw1"
    # The second worker's own server is stopped with it: nothing it started is left running.
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(second["redis_url"], socket_connect_timeout=2).ping()
