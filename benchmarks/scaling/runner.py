"""One run: the platform on a clone of the seeded template, N emulated volunteers, the clock to the target.

The benchmark process is not a Django process (it runs the volunteers, as outside clients): it writes to
the database only through Django (seed.serve_run, in a `manage.py shell` process) and reads the versions,
shards and result outcomes with plain SQL. Creating and dropping the databases is DDL on the admin database.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import re
import statistics
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import psycopg
import redis
import torch
from safetensors.numpy import load as load_shard

from devstack.stack import DATABASE_PREFIX, PYTHON, ROOT, Stack, recreate_database
from engine import codecs
from engine.graph import load_graph
from engine.runtime import evaluate
from workers.simulator import SimulatorConfig

from . import fleet as fleet_
from .config import (
    ADMIN_URL,
    BANDWIDTH_MBIT,
    LATENCY_MS,
    METHODS,
    PASSWORD,
    SHARD_SAMPLES,
    Method,
    Options,
    round_columns,
)
from .emulation import (
    CountingSimulator,
    Emulation,
    device_pool,
    device_processes,
    share_parsed_shards,
    totals,
    unit_timings,
    warm_up,
)
from .seed import CONFIGURED, OPENED

WORKERS = ("worker", "validator")  # the Celery workers' logs


@dataclass
class ScalingStack(Stack):
    """devstack's Stack, but migrated and seeded once: every run clones a template database
    (CREATE DATABASE ... TEMPLATE, seconds instead of a minute of migrate + seed on this loaded machine) and
    shares the var dir (blobs are content-addressed and immutable). The caller configures the fresh
    database (`django`) before daphne, the workers and beat start."""

    template: str = "crowdtrain_h10_template"

    def env(self) -> dict[str, str]:
        env = super().env()
        env["CROWDTRAIN_SHARD_SAMPLES"] = str(SHARD_SAMPLES)
        # Every emulated volunteer connects from 127.0.0.1: the per-address connect limit (60 a minute) is for
        # many volunteers behind one address, and would make 64 of them wait out a throttle at the start.
        env["CROWDTRAIN_WS_CONNECTS_PER_MINUTE_IP"] = "100000"
        return env

    def seed_template(self) -> None:
        database = self.database
        self.database = self.template
        self.database_url = recreate_database(self.template)
        self.manage("migrate", "--verbosity", "0")
        self.manage("ensure_admin")
        self.manage("seed_demo", *self.seed_args)
        self.manage("shell", "-c", "from benchmarks.scaling.seed import seed; seed()")
        self.database = database

    def clone(self) -> None:
        # recreate_database (the template's) prefixes names with the checkout's CROWDTRAIN_STACK_DB_PREFIX
        database, template = DATABASE_PREFIX + self.database, DATABASE_PREFIX + self.template
        with psycopg.connect(ADMIN_URL, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
            conn.execute(f'CREATE DATABASE "{database}" TEMPLATE "{template}"')
        self.database_url = ADMIN_URL.rsplit("/", 1)[0] + f"/{database}"
        redis.Redis.from_url(self.env()["REDIS_URL"]).flushdb()  # our own db only

    def drop(self) -> None:
        with contextlib.suppress(psycopg.Error), psycopg.connect(ADMIN_URL, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{DATABASE_PREFIX + self.database}" WITH (FORCE)')

    def start(self) -> None:
        for log in ("web", *WORKERS, "beat"):
            (self.var_dir / f"{log}.log").unlink(missing_ok=True)
        (self.var_dir / "beat-schedule").unlink(missing_ok=True)
        self.spawn_processes()

    def django(self, code: str) -> subprocess.Popen[str]:
        """`manage.py shell -c code` on this stack's database, talking over its stdin and stdout."""
        argv = [PYTHON, "manage.py", "shell", "-c", code]
        pipe = subprocess.PIPE
        return subprocess.Popen(argv, cwd=ROOT, env=self.env(), stdin=pipe, stdout=pipe, text=True)

    def worker_logs(self) -> str:
        return "\n".join(self.log(name) for name in WORKERS if (self.var_dir / f"{name}.log").exists())


class ProjectControl:
    """The run's writes (seed.serve_run): the project configured on entering, the first round opened
    on request. One Django process, started before the platform, so opening the round is instant."""

    def __init__(self, stack: ScalingStack, method: Method) -> None:
        columns = json.dumps(round_columns(method))
        self.process = stack.django(f"from benchmarks.scaling.seed import serve_run; serve_run({columns!r})")
        self.project_id, self.opened = 0, False

    def __enter__(self) -> Self:
        self.project_id = int(self._await(CONFIGURED).split()[-1])
        return self

    def open_first_round(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write("\n")
        self.process.stdin.flush()
        self._await(OPENED)
        self.opened = True

    def _await(self, prefix: str) -> str:
        """serve_run's next line starting with `prefix` (Django's shell prints lines of its own)."""
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith(prefix):
                return line
        raise RuntimeError(f"seed.serve_run ended before {prefix!r} (exit {self.process.wait()})")

    def close(self) -> None:
        """Let serve_run exit once it has done its part; end it if the run failed before its clock (the
        round must not be opened then) or if it hangs."""
        if not self.opened:
            self.process.kill()
        try:
            self.process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.close()


def worker_task_times(log: str) -> dict[str, dict[str, float]]:
    """Per Celery task: how many ran and how long they took (from the worker's own log lines)."""
    times: dict[str, list[float]] = {}
    for match in re.finditer(r"Task ([\w.]+)\[[^\]]+\] succeeded in ([0-9.]+)s", log):
        times.setdefault(match.group(1).rsplit(".", 1)[-1], []).append(float(match.group(2)))
    return {
        name: {
            "count": len(v),
            "total_s": round(sum(v), 2),
            "median_s": round(statistics.median(v), 4),
            "max_s": round(max(v), 3),
        }
        for name, v in sorted(times.items())
    }


class Evaluator:
    """Test accuracy of every published version, from the weights blobs on disk (never over the wire)."""

    def __init__(self, conn: psycopg.Connection[Any], blobs: Path, project_id: int) -> None:
        self.conn, self.blobs, self.project_id = conn, blobs, project_id
        graph_sha = self._one("SELECT graph_id FROM projects_project WHERE id = %s")
        self.graph_url = f"/blobs/{graph_sha}"
        self.graph = load_graph(self.blob(graph_sha))
        shards = conn.execute(
            "SELECT s.split, s.blob_id FROM projects_datasetshard s JOIN projects_project p "
            "ON p.dataset_id = s.dataset_id WHERE p.id = %s ORDER BY s.split, s.index",
            (project_id,),
        ).fetchall()
        self.train_shards = [f"/blobs/{sha}" for split, sha in shards if split == "train"]
        tests = [load_shard(self.blob(sha)) for split, sha in shards if split == "test"]
        self.x = torch.cat([torch.from_numpy(t["x"]) for t in tests])
        self.y = torch.cat([torch.from_numpy(t["y"]) for t in tests])
        self.seen = -1
        self.history: list[dict[str, float]] = []

    def _one(self, query: str) -> Any:
        row = self.conn.execute(query, (self.project_id,)).fetchone()
        assert row is not None, "benchmark project missing"
        return row[0]

    def round_fed(self) -> bool:
        return bool(
            self._one("SELECT count(*) FROM projects_workunit WHERE project_id = %s AND status = 'open'")
        )

    def blob(self, sha: str) -> bytes:
        return (self.blobs / sha[:2] / sha).read_bytes()

    def shard_cache(self) -> dict[str, bytes]:
        """The training shards by URL, as a browser that has them cached already (immutable blobs)."""
        return {url: self.blob(url.removeprefix("/blobs/")) for url in self.train_shards}

    def poll(self) -> list[dict[str, float]]:
        rows = self.conn.execute(
            "SELECT number, weights_id, extract(epoch FROM created_at), samples FROM projects_modelversion "
            "WHERE project_id = %s AND number > %s ORDER BY number",
            (self.project_id, self.seen),
        ).fetchall()
        new = [
            self._evaluated(int(number), sha, float(created), int(samples))
            for number, sha, created, samples in rows
        ]
        self.history.extend(new)
        self.seen = int(new[-1]["version"]) if new else self.seen
        return new

    def _evaluated(self, number: int, sha: str, created: float, samples: int) -> dict[str, float]:
        weights = codecs.decode(self.blob(sha))[0]
        inputs, targets = {self.graph.inputs[0].name: self.x}, {self.graph.targets[0].name: self.y}
        metrics = evaluate(self.graph, weights, inputs, targets)
        return {
            "version": number,
            "created": created,
            "samples": samples,
            "accuracy": round(metrics["accuracy"], 4),
        }

    def outcomes(self, label: str, where: str = "") -> dict[str, int]:
        """Results of the project counted by `label` (an SQL expression over r)."""
        rows = self.conn.execute(
            f"SELECT {label}, count(*) FROM projects_result r JOIN projects_workunit w "
            f"ON w.id = r.work_unit_id WHERE w.project_id = %s {where} GROUP BY 1",
            (self.project_id,),
        ).fetchall()
        return dict(rows)


def round_timeline(conn: psycopg.Connection[Any], project_id: int) -> list[dict[str, float]]:
    """Each round after the first (version 2 on) that a next version closed: its length, and how long its
    devices took from their unit's sending to computing (Result.download_ms of the units sent in the round's
    first ROUND_START_S). A round longer than target_seconds is devices waiting."""
    rows = conn.execute(ROUNDS_SQL, {"project": project_id, "start": ROUND_START_S}).fetchall()
    return [
        {
            "version": int(n),
            "seconds": round(float(s), 2),
            "start_ms_p50": float(p50),
            "start_ms_p90": float(p90),
        }
        for n, s, p50, p90 in rows
        if s is not None and p50 is not None and n >= 2
    ]


ROUND_START_S = 5.0
ROUNDS_SQL = """
SELECT v.number,
       extract(epoch FROM lead(v.created_at) OVER (ORDER BY v.number) - v.created_at),
       percentile_cont(0.5) WITHIN GROUP (ORDER BY r.download_ms),
       percentile_cont(0.9) WITHIN GROUP (ORDER BY r.download_ms)
FROM projects_modelversion v
LEFT JOIN projects_workunit w ON w.version_id = v.id
LEFT JOIN projects_result r ON r.work_unit_id = w.id AND r.received_at IS NOT NULL
     AND r.sent_at < v.created_at + make_interval(secs => %(start)s)
WHERE v.project_id = %(project)s
GROUP BY v.number, v.created_at
ORDER BY v.number
"""


# --- the race to the target ------------------------------------------------------------------------------


@dataclass
class Race:
    sims: list[CountingSimulator]
    started_wall: float = 0.0
    elapsed: float = 0.0
    reached: dict[str, Any] | None = None
    snapshot: dict[str, int] = field(default_factory=dict)  # totals() when the target was reached
    crashed: list[str] = field(default_factory=list)
    churn: Churn | None = None
    started: float = 0.0  # the clock's start and end, on the monotonic clock
    ended: float = 0.0
    steady: float | None = None  # when version STEADY_VERSION was published, on the monotonic clock
    tasks: list[asyncio.Task[Any]] = field(default_factory=list)


@dataclass
class Fleet:
    """Who volunteers: the emulated speed of each slot, and how to make a fresh volunteer for a slot."""

    url: str
    evaluator: Evaluator
    speeds: list[float]
    shards: dict[str, bytes] = field(default_factory=dict)  # the training shards, read once
    compute: concurrent.futures.Executor | None = None  # where they train (emulation.device_processes)
    prefetch: bool = True  # Emulation.prefetch

    def __post_init__(self) -> None:
        self.shards = self.shards or self.evaluator.shard_cache()

    def volunteer(self, slot: int, generation: int = 0) -> CountingSimulator:
        """Slot `slot`'s volunteer; generation > 0: a fresh one who joined after its predecessor left."""
        name = f"h10-vol-{slot:02d}" + (f"-j{generation}" if generation else "")
        config = SimulatorConfig(
            url=self.url,
            username=name,
            password=PASSWORD,
            signup=True,
            gflops=self.speeds[slot],
            bandwidth_mbit=BANDWIDTH_MBIT,
            latency_ms=LATENCY_MS,
            prefetch=self.prefetch,
            verdict_timeout_s=3.0,
            seed=slot + 1000 * generation,
        )
        sim = CountingSimulator(config, self.evaluator.graph_url, self.compute)
        for shard_url, data in self.shards.items():  # in the browser cache (immutable)
            sim.cache.put(shard_url, data)
        return sim

    def volunteers(self) -> list[CountingSimulator]:
        return [self.volunteer(slot) for slot in range(len(self.speeds))]


@dataclass
class Churn:
    """The run's departures and arrivals (fleet.churn), done as the clock passes them."""

    fleet: Fleet
    departures: list[fleet_.Departure]
    occupant: dict[int, CountingSimulator] = field(default_factory=dict)  # slot -> its volunteer now
    left: set[int] = field(default_factory=set)  # departures done (index)
    joined: set[int] = field(default_factory=set)  # arrivals done (index)
    log: list[dict[str, Any]] = field(default_factory=list)

    def due(self, race: Race, now_s: float) -> None:
        for index, departure in enumerate(self.departures):
            if departure.at_s <= now_s and index not in self.left:
                self.left.add(index)
                self._leave(departure, now_s)
            if departure.rejoin_at_s <= now_s and index not in self.joined:
                self.joined.add(index)
                self._join(race, departure, generation=index + 1, now_s=now_s)

    def _leave(self, departure: fleet_.Departure, now_s: float) -> None:
        """A closed tab: the connection drops without a goodbye, mid-unit if it computes one."""
        sim = self.occupant[departure.slot]
        sim.left_at = time.monotonic()
        sim.stopped = True
        computing = any(stop > sim.left_at for _, stop in sim.tally.computing)
        if sim.session is not None:
            sim.session.ws.transport.abort()
        self.log.append({"left_s": round(now_s, 1), "slot": departure.slot, "computing": computing})

    def _join(self, race: Race, departure: fleet_.Departure, generation: int, now_s: float) -> None:
        sim = self.fleet.volunteer(departure.slot, generation)
        self.occupant[departure.slot] = sim
        race.sims.append(sim)
        race.tasks.append(asyncio.create_task(sim.run()))
        self.log.append({"joined_s": round(now_s, 1), "slot": departure.slot, "name": sim.config.username})


async def before_clock(sims: list[CountingSimulator], evaluator: Evaluator, control: ProjectControl) -> None:
    """Sign up / log in (PBKDF2 on a loaded 2-core box takes seconds and is no part of training), wait until
    the feeder (beat, every 5 s) has put the first round up, and open it."""
    await asyncio.gather(*(s.authenticate() for s in sims))
    for s in sims:
        s.config.signup = False  # run() then reuses the session cookie
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not await asyncio.to_thread(evaluator.round_fed):
        await asyncio.sleep(0.2)
    await asyncio.to_thread(control.open_first_round)


async def run_to_target(race: Race, evaluator: Evaluator, target: float, timeout: float) -> None:
    """Run the volunteers until a version reaches `target` (or they all end, or `timeout`)."""
    race.started_wall, race.started = time.time(), time.monotonic()
    race.tasks = [asyncio.create_task(s.run()) for s in race.sims]
    while time.monotonic() - race.started < timeout:
        await asyncio.sleep(0.25)
        if race.churn is not None:
            race.churn.due(race, time.monotonic() - race.started)
        for entry in await asyncio.to_thread(evaluator.poll):
            if entry["version"] == STEADY_VERSION:
                race.steady = race.started + entry["created"] - race.started_wall
            if race.reached is None and entry["accuracy"] >= target:
                race.reached, race.snapshot = entry, totals(race.sims)
        if race.reached is not None or all(t.done() for t in race.tasks):
            break
    race.ended = time.monotonic()
    race.elapsed = race.ended - race.started
    race.snapshot = race.snapshot or totals(race.sims)
    race.crashed = await stop(race.sims, race.tasks)


async def stop(sims: list[CountingSimulator], tasks: list[asyncio.Task[Any]]) -> list[str]:
    """Stop the volunteers; the exceptions of those that crashed."""
    for sim in sims:
        sim.stop()
    done, pending = await asyncio.wait(tasks, timeout=15)
    for task in pending:
        task.cancel()
    return [repr(t.exception()) for t in done if not t.cancelled() and t.exception() is not None]


async def drive(
    race: Race, evaluator: Evaluator, control: ProjectControl, target: float, emulation: Emulation
) -> None:
    arrivals = len(race.churn.departures) if race.churn else 0
    pool = device_pool(len(race.sims) + arrivals + 4, nice=emulation.device_nice)
    asyncio.get_running_loop().set_default_executor(pool)
    await before_clock(race.sims, evaluator, control)
    await run_to_target(race, evaluator, target, emulation.timeout)


# --- one run ---------------------------------------------------------------------------------------------


@dataclass
class Measured:
    race: Race
    setup_seconds: float
    history: list[dict[str, float]]
    outcomes: dict[str, int]
    reasons: dict[str, int]
    rounds: list[dict[str, float]] = field(default_factory=list)


@dataclass(frozen=True)
class Plan:
    """One run's fleet: each volunteer's speed, and the churn (none in the homogeneous runs)."""

    speeds: list[float]
    departures: list[fleet_.Departure]


def plan(options: Options, emulation: Emulation, n: int) -> Plan:
    if not options.heterogeneous:
        return Plan([emulation.gflops] * n, [])
    departures = fleet_.churn(n, options.churn_per_hour, emulation.timeout, seed=n)
    return Plan(fleet_.speeds(n, emulation.gflops), departures)


def measure(stack: ScalingStack, method: Method, run: Plan, emulation: Emulation, target: float) -> Measured:
    """Clone, configure, start the platform, warm up, and race the planned volunteers to `target`."""
    t_setup = time.monotonic()
    stack.clone()
    with (
        ProjectControl(stack, method) as control,
        psycopg.connect(stack.database_url, autocommit=True) as conn,
        _training(emulation) as compute,
    ):
        stack.start()
        evaluator = Evaluator(conn, stack.var_dir / "media" / "blobs", control.project_id)
        warm_up(evaluator.graph, evaluator.x, evaluator.y)
        share_parsed_shards()
        volunteers = Fleet(stack.url, evaluator, run.speeds, compute=compute, prefetch=emulation.prefetch)
        race = Race(volunteers.volunteers())
        if run.departures:
            race.churn = Churn(volunteers, run.departures, occupant=dict(enumerate(race.sims)))
        setup_s = time.monotonic() - t_setup
        asyncio.run(drive(race, evaluator, control, target, emulation))
        outcomes = evaluator.outcomes("r.validation || '/' || r.status")
        reasons = evaluator.outcomes(
            "r.validation || '/' || r.status || ': ' || left(r.reason, 100)", "AND r.reason <> ''"
        )
        return Measured(
            race, setup_s, evaluator.history, outcomes, reasons, round_timeline(conn, control.project_id)
        )


@contextlib.contextmanager
def _training(emulation: Emulation) -> Iterator[concurrent.futures.Executor | None]:
    """The emulated volunteers' processes (None: they train in the default executor's threads)."""
    if not emulation.device_processes:
        yield None
        return
    with device_processes(emulation.device_processes, nice=emulation.device_nice) as pool:
        yield pool


def run_one(options: Options, emulation: Emulation, method_key: str, n: int) -> dict[str, Any]:
    stack = ScalingStack(
        var_dir=options.var_dir,
        database=options.database(method_key, n),
        redis_db=options.redis_db,
        template=options.template_database,
    )
    load_before = os.getloadavg()[0]
    run = plan(options, emulation, n)
    try:
        measured = measure(stack, METHODS[method_key], run, emulation, options.target)
    finally:
        stack.stop()
        tasks = worker_task_times(stack.worker_logs())
    row = result_row(method_key, n, options.target, measured)
    row.update(worker_tasks=tasks, **errors(measured.race.sims), load_average_before=round(load_before, 2))
    row.update(load_average_after=round(os.getloadavg()[0], 2), config=round_columns(METHODS[method_key]))
    row.update(accuracy_curve=accuracy_curve(measured), bytes_per_sample=bytes_per_sample(row))
    if options.heterogeneous:
        row.update(heterogeneous_row(run, measured.race, row, options, emulation))
        row.update(rounds=rounds_summary(measured.rounds))
    if not os.environ.get("SCALING_KEEP_DATABASES"):  # keep them to study a run's timeline in SQL
        stack.drop()
    return row


def result_row(method_key: str, n: int, target: float, measured: Measured) -> dict[str, Any]:
    race, history, reached = measured.race, measured.history, measured.race.reached
    snap = race.snapshot
    return {
        "method": method_key,
        "volunteers": n,
        "target": target,
        "reached": reached is not None,
        "seconds_to_target": round(reached["created"] - race.started_wall, 2) if reached else None,
        "versions_to_target": reached["version"] if reached else None,
        "best_accuracy": max((h["accuracy"] for h in history), default=0.0),
        "versions_published": len(history) - 1,
        "run_seconds": round(race.elapsed, 2),
        "setup_seconds": round(measured.setup_seconds, 1),
        "samples_aggregated_to_target": sum(
            h["samples"] for h in history if reached and 0 < h["version"] <= reached["version"]
        ),
        **snap,
        "training_bytes_to_target": snap["bytes_sent"] + snap["bytes_received"],
        **unit_timings(race.sims),
        "result_outcomes": measured.outcomes,
        "result_reasons": measured.reasons,
        "crashed": race.crashed,
    }


def errors(sims: list[CountingSimulator]) -> dict[str, int]:
    return {"reconnects": sum(s.stats.reconnects for s in sims), "errors": sum(s.stats.errors for s in sims)}


def accuracy_curve(measured: Measured) -> list[tuple[float, int, float]]:
    """(seconds since the clock started, version, test accuracy) of every version."""
    start = measured.race.started_wall
    return [(round(h["created"] - start, 2), int(h["version"]), h["accuracy"]) for h in measured.history]


def bytes_per_sample(row: dict[str, Any]) -> float | None:
    samples = row["samples_aggregated_to_target"]
    return round(row["training_bytes_to_target"] / samples, 1) if samples else None


# --- the heterogeneous fleet's own numbers ------------------------------------------------------------------


def heterogeneous_row(
    run: Plan, race: Race, row: dict[str, Any], options: Options, emulation: Emulation
) -> dict[str, Any]:
    """The fleet, the churn that happened, how busy the devices were, and the speedup over one volunteer of
    the fleet's mean speed (`baseline`)."""
    mean = statistics.fmean(run.speeds)
    return {
        "fleet": {
            "top_gflops": max(run.speeds),
            "slowest_gflops": min(run.speeds),
            "mean_gflops": round(mean, 6),
            "total_gflops": round(sum(run.speeds), 4),
        },
        "churn": {
            "rate_per_hour": options.churn_per_hour,
            "planned": [vars(d) for d in run.departures if d.at_s < race.elapsed],
            "done": race.churn.log if race.churn else [],
        },
        "busy": busy(race),
        "baseline": baseline(row, mean, emulation.calibration["flops_per_sample"]),
    }


def rounds_summary(rounds: list[dict[str, float]]) -> dict[str, Any]:
    """The medians over the rounds of their length and their devices' time to start (round_timeline)."""

    def middle(key: str) -> float | None:
        return round(statistics.median(r[key] for r in rounds), 2) if rounds else None

    return {
        "seconds_median": middle("seconds"),
        "start_ms_p50_median": middle("start_ms_p50"),
        "start_ms_p90_median": middle("start_ms_p90"),
        "each": rounds,
    }


def busy(race: Race) -> dict[str, Any]:
    """Each device's computing time over its wall time (fleet.busy_fraction) from its first unit, and at
    steady state: from version STEADY_VERSION on, up to the target (or its departure)."""
    steady = _busy_fractions(race, since=race.steady) if race.steady is not None else []
    whole = _busy_summary(_busy_fractions(race, since=None))
    return {**whole, "steady": _busy_summary(steady), "first_unit_wait_s": _first_unit_waits(race)}


def _first_unit_waits(race: Race) -> dict[str, float | None]:
    """Seconds from each volunteer's start (sign-in, connection) to its first unit's computing: what clicking
    Contribute costs before any work, which the busy fraction (counted from that first unit) leaves out."""
    computed = [sim for sim in race.sims if sim.tally.computing]
    waits = sorted(min(start for start, _ in sim.tally.computing) - sim.started for sim in computed)
    if not waits:
        return {"median": None, "p90": None, "max": None}
    p90 = statistics.quantiles(waits, n=10, method="inclusive")[-1] if len(waits) > 1 else waits[0]
    return {"median": round(statistics.median(waits), 2), "p90": round(p90, 2), "max": round(waits[-1], 2)}


def _busy_summary(per_device: list[tuple[float, float]]) -> dict[str, Any]:
    return {
        **fleet_.busy_summary([f for _, f in per_device]),
        "per_device_gflops_busy": sorted(per_device, reverse=True),
    }


# The first round planned for the whole fleet opens with version 2: version 1's round was planned while
# volunteers were still signing in, and those who came later got what was left of it, then waited.
STEADY_VERSION = 2


def _busy_fractions(race: Race, *, since: float | None) -> list[tuple[float, float]]:
    per_device = []
    for sim in race.sims:
        end = min(race.ended, sim.left_at or race.ended)
        fraction = fleet_.busy_fraction(sim.tally.computing, end, since=since)
        if fraction is not None:
            per_device.append((sim.config.gflops, round(fraction, 4)))
    return per_device


def baseline(row: dict[str, Any], mean_gflops: float, flops_per_sample: float) -> dict[str, Any]:
    """One volunteer of the fleet's mean speed computing the samples that the versions up to the target
    aggregated, back to back, with no network, no server and no waiting: a lower bound of its time to the
    target on the same algorithm, so the speedup over it is a conservative one."""
    samples = row["samples_aggregated_to_target"]
    if not row["reached"] or not samples:
        return {"one_mean_volunteer_seconds": None, "speedup": None, "efficiency": None}
    serial = samples * flops_per_sample / (mean_gflops * 1e9)
    speedup = serial / row["seconds_to_target"]
    return {
        "one_mean_volunteer_seconds": round(serial, 1),
        "speedup": round(speedup, 2),
        "efficiency": round(speedup / row["volunteers"], 3),
    }
