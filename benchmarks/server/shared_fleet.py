"""Two crowd averaging projects sharing one fleet (issue 15's crowd rounds with BOINC's resource shares): how
long their rounds take, before and after rounds are planned for each device's share of its time.

    .venv/bin/python -m benchmarks.server.shared_fleet [--volunteers 6] [--seconds 120] [--no-before]

For each tree ("before": --before-rev, or where this branch left main, in a temporary `git worktree`; "after":
this checkout), the real stack (daphne, the Celery worker, the validator and beat on PostgreSQL and Redis)
runs two MNIST MLP projects on the demo's data, both averaging in crowd-sized rounds of --target-seconds, with
equal resource shares, and N simulated volunteers (workers/simulator.py: the real protocol and real updates,
each device emulated at the speed that computes --samples-per-second) who allow both. After a warm-up, over
--seconds:

- each project's rounds: versions published, and the time between two versions (median, 90th percentile),
  against the target_seconds the platform plans each round for;
- the results received and their samples (median): a round planned for whole devices that the other
  project also uses is cut, at sending, into the pieces left at the round's end;
- the volunteers' busy share: the device seconds of the results received in the window over the window's
  volunteer seconds.

Prints a table and writes benchmarks/results/server-shared-fleet.json. The stacks' databases are dropped and
created anew.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import psycopg

from benchmarks.server.throughput import base_commit, before_tree
from devstack.stack import ROOT, Stack
from workers.simulator import SimulatorConfig, SimulatorStats, simulate_all

RESULTS = Path(__file__).resolve().parent.parent / "results"
PASSWORD = "shared-fleet-pass-8642"
# The demo becomes crowd averaging, and a second project of the same model and data joins it; both take
# equal shares. Nothing else runs.
SETUP = """
from django.db import transaction
from projects.lifecycle import work_units_cancel
from projects.models import Project, WorkUnit
from projects.services import project_create, project_start
crowd = {CROWD}
demo = Project.objects.get(name="MNIST MLP (demo)")
Project.objects.exclude(pk=demo.pk).update(status=Project.Status.PAUSED)
Project.objects.filter(pk=demo.pk).update(**crowd)
with transaction.atomic():
    work_units_cancel(work_units=list(WorkUnit.objects.filter(project=demo, status="open")), reason="resized")
other = project_create(owner=demo.owner, name="MNIST MLP (second)", dataset=demo.dataset, preset="mlp",
                       settings={{"codec": demo.codec, "learning_rate": demo.learning_rate}})
Project.objects.filter(pk=other.pk).update(**crowd)
project_start(project=Project.objects.get(pk=other.pk))
"""
ROUNDS = """
SELECT p.name, array_agg(extract(epoch FROM v.created_at) ORDER BY v.number) FROM projects_modelversion v
JOIN projects_project p ON p.id = v.project_id WHERE v.created_at >= to_timestamp(%s) AND v.number > 0
GROUP BY p.name ORDER BY p.name
"""
RESULTS_SQL = """
SELECT p.name, count(*), percentile_cont(0.5) WITHIN GROUP (ORDER BY w.count), sum(r.compute_ms) / 1000.0
FROM projects_result r
JOIN projects_workunit w ON w.id = r.work_unit_id JOIN projects_project p ON p.id = w.project_id
WHERE r.received_at BETWEEN to_timestamp(%s) AND to_timestamp(%s) GROUP BY p.name ORDER BY p.name
"""
FLOPS = "SELECT flops_per_sample FROM projects_project WHERE name = 'MNIST MLP (demo)'"
NOW = "SELECT extract(epoch FROM now())"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--volunteers", type=int, default=6)
    p.add_argument("--seconds", type=float, default=120, help="measured window (default 120)")
    p.add_argument("--warmup", type=float, default=30, help="seconds before the window (default 30)")
    p.add_argument("--target-seconds", type=int, default=10, help="each project's target_seconds")
    p.add_argument("--samples-per-second", type=float, default=40, help="each emulated device's speed")
    p.add_argument(
        "--before-rev", default="", help="the 'before' commit (default: where this branch left main)"
    )
    p.add_argument("--no-before", action="store_true", help="measure this checkout only")
    p.add_argument("--database", default="crowdtrain_shared_fleet_bench", help="scratch database (dropped)")
    p.add_argument("--redis-db", type=int, default=13, help="Redis database (flushed first)")
    p.add_argument("--output", type=Path, default=RESULTS / "server-shared-fleet.json")
    return p


def setup_code(args: argparse.Namespace) -> str:
    crowd = {
        "mode": "averaging",
        "crowd_rounds": True,
        "target_seconds": args.target_seconds,
        "batch_size": 32,
        "round_samples": 64,
        "resource_share": 100,
    }
    return SETUP.format(CROWD=repr(crowd))


def measure(args: argparse.Namespace, root: Path, label: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix=f"shared-fleet-{label}-") as var_dir:
        stack = Stack(
            var_dir=Path(var_dir),
            database=f"{args.database}_{label}",
            redis_db=args.redis_db,
            extra_env={"CROWDTRAIN_WS_CONNECTS_PER_MINUTE_IP": "100000", "DJANGO_DEBUG": "0"},
            startup_timeout=600,
            setup_code=setup_code(args),
            root=root,
        )
        with stack, psycopg.connect(stack.database_url, autocommit=True) as conn:
            return run(args, stack, conn)


def run(args: argparse.Namespace, stack: Stack, conn: psycopg.Connection[Any]) -> dict[str, Any]:
    flops = _one(conn, FLOPS)
    config = SimulatorConfig(
        url=stack.url,
        password=PASSWORD,
        signup=True,
        gflops=args.samples_per_second * flops / 1e9,
        duration_s=args.warmup + args.seconds,
        verdict_timeout_s=5,
    )
    configs = [replace(config, username=f"fleet-{i}", seed=i) for i in range(args.volunteers)]
    start = float(_one(conn, NOW)) + args.warmup
    stats = asyncio.run(simulate_all(configs))
    return summary(args, conn, start=start, stats=stats)


def _one(conn: psycopg.Connection[Any], sql: str) -> Any:
    row = conn.execute(sql).fetchone()
    assert row is not None
    return row[0]


def summary(
    args: argparse.Namespace, conn: psycopg.Connection[Any], *, start: float, stats: list[SimulatorStats]
) -> dict[str, Any]:
    end = start + args.seconds
    projects: dict[str, dict[str, Any]] = {}
    for name, times in conn.execute(ROUNDS, [start]).fetchall():
        inside = [float(t) for t in times if float(t) <= end]
        gaps = [b - a for a, b in zip(inside, inside[1:], strict=False)]
        projects[name] = {"versions": len(inside), **_spread(gaps)}
    computed = 0.0
    for name, count, samples, seconds in conn.execute(RESULTS_SQL, [start, end]).fetchall():
        projects.setdefault(name, {}).update(results=count, median_samples=float(samples))
        computed += float(seconds)
    busy = computed / (args.volunteers * args.seconds)
    return {"projects": projects, "busy": round(busy, 3), "valid": sum(s.valid for s in stats)}


def _spread(gaps: list[float]) -> dict[str, float | None]:
    if not gaps:
        return {"round_median_s": None, "round_p90_s": None}
    ordered = sorted(gaps)
    p90 = ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]
    return {"round_median_s": round(statistics.median(gaps), 2), "round_p90_s": round(p90, 2)}


def table(result: dict[str, Any]) -> str:
    config = result["config"]
    lines = [
        f"Two crowd averaging projects, equal shares, {config['volunteers']} volunteers allowing both, "
        f"target_seconds {config['target_seconds']}, window {config['seconds']:.0f} s",
        f"  {'tree':<8}{'project':<22}{'versions':>9}{'round p50 s':>12}{'round p90 s':>12}"
        f"{'results':>9}{'samples p50':>12}{'busy':>7}",
    ]
    for label, measured in result["trees"].items():
        for name, p in measured["projects"].items():
            lines.append(
                f"  {label:<8}{name:<22}{p.get('versions', 0):>9}{_fmt(p.get('round_median_s')):>12}"
                f"{_fmt(p.get('round_p90_s')):>12}{p.get('results', 0):>9}{_fmt(p.get('median_samples')):>12}"
                f"{measured['busy']:>7.2f}"
            )
    return "\n".join(lines)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def main() -> None:
    args = parser().parse_args()
    trees: dict[str, dict[str, Any]] = {}
    if not args.no_before:
        args.before_rev = args.before_rev or base_commit()
        with before_tree(args.before_rev) as path:
            trees["before"] = measure(args, path, "before")
    trees["after"] = measure(args, ROOT, "after")
    config = {k: getattr(args, k) for k in ("volunteers", "seconds", "warmup", "target_seconds")}
    revs = {
        "before_rev": None if args.no_before else args.before_rev,
        "samples_per_second": args.samples_per_second,
    }
    result = {"config": {**config, **revs}, "trees": trees}
    print(table(result))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
