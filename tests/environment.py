"""Loaded as a pytest plugin (`-p tests.environment`) before Django settings are imported.

Tests run against the real services: PostgreSQL and Redis on this machine unless the caller points
DATABASE_URL / REDIS_URL elsewhere. Celery tasks run eagerly inside integration tests; the end-to-end
tests start real worker processes with their own environment.
"""

import os
import tempfile

os.environ.setdefault("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/crowdtrain")
os.environ.setdefault("REDIS_URL", "redis://127.0.0.1:6379/15")
os.environ.setdefault("CELERY_TASK_ALWAYS_EAGER", "1")
# Each project a test creates would train its one-CPU baseline eagerly (minutes): off unless a test asks.
os.environ.setdefault("CROWDTRAIN_BASELINE_SECONDS", "0")
os.environ.setdefault("CROWDTRAIN_VAR_DIR", tempfile.mkdtemp(prefix="crowdtrain-test-"))
# WhiteNoise warns on every request when STATIC_ROOT is missing; tests serve static files from the finders.
os.makedirs(os.path.join(os.environ["CROWDTRAIN_VAR_DIR"], "static"), exist_ok=True)
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
