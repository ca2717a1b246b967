"""The long protocol fuzz: tests/security/fuzz.py against the real stack while honest volunteers train.

    .venv/bin/python -m benchmarks.security.fuzz [--frames 100000] [--minutes 30] [--seed 1]
    make fuzz

Starts the platform (devstack/stack.py: daphne + Celery worker, validator and beat on a fresh PostgreSQL
database, Redis db 8), lets two simulated volunteers train the MNIST demo, and once the first version is out
fuzzes the WebSocket protocol from three volunteer accounts until --frames frames or --minutes minutes.
Prints a table (frames, frames/s, 1011 closes, stalls, tracebacks, 500s, broken invariants, peak RSS of each
server process) and every distinct failure with the frame that caused it; writes
benchmarks/results/security_fuzz.json. Exits 1 if anything failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from devstack.stack import Stack
from tests.security.fuzz import UNTHROTTLED, Campaign, campaign, peak_rss_mb, tracebacks

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
PROCESSES = ("web", "worker", "validator", "beat")


def bench_stack(name: str, redis_db: int, round_timeout: int, env: dict[str, str] | None = None) -> Stack:
    """Not started yet: `with bench_stack(...) as stack:` starts it and always stops it."""
    var_dir = Path(tempfile.mkdtemp(prefix=f"crowdtrain-{name}-"))
    stack = Stack(
        var_dir=var_dir,
        database=os.environ.get("BENCH_STACK_DATABASE", f"crowdtrain_{name}"),
        redis_db=int(os.environ.get("BENCH_STACK_REDIS_DB", redis_db)),
        extra_env=env or {},
        round_timeout=round_timeout,
    )
    return stack


def peak_memory(stack: Stack) -> dict[str, float]:
    return {name: round(peak_rss_mb(p.pid), 1) for name, p in stack.processes.items()}


def table(rows: list[tuple[str, Any]]) -> str:
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label:<{width}}  {value}" for label, value in rows)


def environment() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def give_up_seconds() -> float:
    """projects.lifecycle's bound on unjudged results (importing it needs Django set up)."""
    import django

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    django.setup()
    from projects.lifecycle import VALIDATION_GIVE_UP_SECONDS

    return float(VALIDATION_GIVE_UP_SECONDS)


def summarise(outcome: Campaign, stack: Stack) -> tuple[dict[str, Any], list[str]]:
    logs = {name: stack.log(name) for name in PROCESSES}
    problems = outcome.problems(logs, stack.database_url, give_up_seconds=give_up_seconds())
    traced = {name: sum(n for n, _ in tracebacks(log).values()) for name, log in logs.items()}
    summary = {
        **outcome.report.summary(),
        "tracebacks": traced,
        "versions": outcome.versions,
        "longest_version_gap_s": round(outcome.longest_gap(), 1),
        "peak_rss_mb": peak_memory(stack),
        "problems": problems,
        "environment": environment(),
    }
    return summary, problems


def print_table(summary: dict[str, Any]) -> None:
    print(
        table(
            [
                ("frames", summary["frames"]),
                ("connections", summary["connections"]),
                ("seconds", summary["seconds"]),
                ("frames/s", summary["frames_per_second"]),
                ("1011 closes", summary["crashes_1011"]),
                ("stalls", summary["stalls"]),
                ("tracebacks", summary["tracebacks"]),
                ("handshake 5xx", summary["handshake_5xx"]),
                ("versions", summary["versions"]),
                ("longest gap without a version (s)", summary["longest_version_gap_s"]),
                ("peak RSS (MiB)", summary["peak_rss_mb"]),
                ("problems", len(summary["problems"])),
            ]
        )
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=100_000)
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    with bench_stack("security_fuzz", 8, round_timeout=5, env=UNTHROTTLED) as stack:
        outcome = asyncio.run(
            campaign(
                stack.url,
                stack.database_url,
                frames=args.frames,
                seconds=args.minutes * 60,
                seed=args.seed,
                web_log=stack.var_dir / "web.log",
            )
        )
        summary, problems = summarise(outcome, stack)
    print_table(summary)
    print(outcome.report.render())
    print("\n\n".join(problems))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "security_fuzz.json").write_text(json.dumps({"args": vars(args), **summary}, indent=2) + "\n")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
