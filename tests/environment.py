"""Loaded as a pytest plugin (`-p tests.environment`) before Django settings are imported.

Tests run against the real services: PostgreSQL and Redis on this machine unless the caller points
DATABASE_URL / REDIS_URL elsewhere. Celery tasks run eagerly inside integration tests; the end-to-end
tests start real worker processes with their own environment.
"""

import os
import tempfile
from pathlib import Path

os.environ.setdefault("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/crowdtrain")
os.environ.setdefault("REDIS_URL", "redis://127.0.0.1:6379/15")
os.environ.setdefault("CELERY_TASK_ALWAYS_EAGER", "1")
# The suite's passwords are hashed with MD5, in this process and in the stacks it starts (they inherit the
# environment): PBKDF2's million rounds cost 0.34 s a hash here, 3-5 s on a loaded machine, for every user a
# test creates or logs in. tests/integration/test_deploy_check.py checks production's own.
os.environ.setdefault("DJANGO_PASSWORD_HASHERS", "django.contrib.auth.hashers.MD5PasswordHasher")
# Each project a test creates would train its one-CPU baseline eagerly (minutes): off unless a test asks.
os.environ.setdefault("CROWDTRAIN_BASELINE_SECONDS", "0")
# Under pytest-xdist (`make test` runs three workers) each worker has a var dir (blobs, uploads) of its own
# below the run's: tests that check which blob files a request left behind must not see another worker's.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
_VAR = os.environ.get("CROWDTRAIN_VAR_DIR") or tempfile.mkdtemp(prefix="crowdtrain-test-")
os.environ["CROWDTRAIN_VAR_DIR"] = os.path.join(_VAR, _WORKER) if _WORKER else _VAR
# WhiteNoise warns on every request when STATIC_ROOT is missing; tests serve static files from the finders.
os.makedirs(os.path.join(os.environ["CROWDTRAIN_VAR_DIR"], "static"), exist_ok=True)
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")


def _own_redis(worker: str) -> str:
    """A Redis server of this worker's own, stopped when the worker exits: stacks FLUSHDB their database
    numbers, which two workers sharing one server would do to each other."""
    import atexit
    import shutil
    import subprocess

    from config import supervisor

    port = supervisor.free_port()
    data = tempfile.mkdtemp(prefix=f"crowdtrain-redis-{worker}-")
    argv = supervisor.redis_argv(Path(data), port)
    argv[0] = shutil.which("redis-server") or argv[0]  # the machine's own Redis when it has one, as gw0 uses
    server = subprocess.Popen(argv, stdout=subprocess.DEVNULL)

    def stop() -> None:
        server.terminate()
        server.wait(10)
        shutil.rmtree(data, ignore_errors=True)

    atexit.register(stop)
    if not supervisor.wait_for_port("127.0.0.1", port, 20, lambda: server.poll() is None):
        raise RuntimeError(f"{worker}: redis-server did not start")
    return f"redis://127.0.0.1:{port}"


# Each xdist worker has its own databases and Redis too: pytest-django suffixes the test database with the
# worker's name, stacks prefix theirs, and every worker but the first starts a Redis server, so that one
# worker's DROP DATABASE or FLUSHDB never hits another's.
if _WORKER:
    _PREFIX = os.environ.get("CROWDTRAIN_STACK_DB_PREFIX", "")
    os.environ["CROWDTRAIN_STACK_DB_PREFIX"] = f"{_PREFIX}{_WORKER}_"
if _WORKER not in ("", "gw0"):
    _SERVER = _own_redis(_WORKER)
    os.environ["CROWDTRAIN_STACK_REDIS"] = _SERVER
    os.environ["REDIS_URL"] = f"{_SERVER}/15"
