"""Hostile volunteers: training progress with 20% of the crowd sending poisoned results, against none.

    .venv/bin/python -m benchmarks.security.hostile [--honest 8] [--attackers 2] [--work-units 150]
        [--invalid-backoff SECONDS] [--output security_hostile.json]

Runs four phases in the order clean, attacked, attacked, clean, each on a freshly started platform
(devstack/stack.py on a new PostgreSQL database, Redis db 7) with fresh simulated volunteers on the MNIST
demo: --honest volunteers doing --work-units each, alone or beside --attackers poisoning volunteers
(workers/simulator.py byzantine="poison": deep safetensors header, NaN, wrong shapes, model version + 999,
compute_ms 2**63 - 1, in turn). A fresh stack per phase and the ABBA order keep a phase's position (a
database grown by earlier phases, a machine warming up) out of the comparison. Prints versions per minute
and per honest result of each kind, the attackers' earnings and the server processes' peak RSS; writes
benchmarks/results/security_hostile.json. Exits 1 if a phase stalled, the attacked phases published under
80% of the clean phases' versions per minute or per honest result, or an attacker was paid.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from tests.security.fuzz import Phase, earned, hostile_phase

from .fuzz import RESULTS, bench_stack, environment, peak_memory, table

MIN_RATIO = 0.8
ORDER = ("clean", "attacked", "attacked", "clean")


Run = tuple[Phase, tuple[int, int], dict[str, float]]


def run_phase(args: argparse.Namespace, index: int, label: str) -> Run:
    """One phase on its own stack: the phase, what its attackers earned and the processes' peak RSS."""
    attackers = args.attackers if label == "attacked" else 0
    backoff = args.invalid_backoff
    env = {} if backoff is None else {"CROWDTRAIN_INVALID_BACKOFF_SECONDS": str(backoff)}
    with bench_stack("security_hostile", 7, round_timeout=10, env=env) as stack:
        phase = asyncio.run(
            hostile_phase(
                stack.url,
                stack.database_url,
                label=f"{label}{index}",
                honest=args.honest,
                attackers=attackers,
                work_units=args.work_units,
                cap_seconds=args.cap_minutes * 60,
            )
        )
        return phase, earned(stack.database_url, f"{label}{index}-attacker"), peak_memory(stack)


def rates(phases: list[Phase]) -> dict[str, float]:
    versions = sum(p.versions for p in phases)
    return {
        "versions_per_minute": round(60 * versions / sum(p.seconds for p in phases), 2),
        "versions_per_honest_result": round(versions / sum(p.honest_results for p in phases), 4),
    }


def verdict(phases: list[Phase], ratios: dict[str, float], earnings: tuple[int, int]) -> list[str]:
    problems = [f"{p.label} stalled: its honest volunteers did not finish" for p in phases if not p.completed]
    problems += [
        f"attacked {name} is {ratio:.0%} of clean (< {MIN_RATIO:.0%})"
        for name, ratio in ratios.items()
        if ratio < MIN_RATIO
    ]
    if earnings != (0, 0):
        problems.append(f"attackers earned (FLOPs, valid results) {earnings}")
    return problems


def summarise(args: argparse.Namespace, runs: list[Run]) -> dict[str, Any]:
    phases = [phase for phase, _, _ in runs]
    clean = rates([p for p in phases if p.label.startswith("clean")])
    attacked = rates([p for p in phases if p.label.startswith("attacked")])
    ratios = {name: round(attacked[name] / max(clean[name], 1e-9), 3) for name in clean}
    earnings = (sum(e[0] for _, e, _ in runs), sum(e[1] for _, e, _ in runs))
    memory = {name: max(m[name] for _, _, m in runs) for name in runs[0][2]}
    return {
        "args": vars(args),
        "order": list(ORDER),
        "clean": clean,
        "attacked": attacked,
        "ratios": ratios,
        "phases": [p.summary() for p in phases],
        "attacker_earnings": {"flops": earnings[0], "valid_results": earnings[1]},
        "peak_rss_mb": memory,
        "problems": verdict(phases, ratios, earnings),
        "environment": environment(),
    }


def print_report(summary: dict[str, Any]) -> None:
    keys = (
        "label",
        "versions",
        "seconds",
        "versions_per_minute",
        "versions_per_honest_result",
        "honest_results",
        "honest_invalid",
        "honest_late",
        "completed",
    )
    print(table([(k, " | ".join(str(p[k]) for p in summary["phases"])) for k in keys]))
    print()
    attackers = [(p["label"] + " attackers", p["attackers"]) for p in summary["phases"] if p["attackers"]]
    print(
        table(
            [
                ("clean", summary["clean"]),
                ("attacked", summary["attacked"]),
                ("attacked / clean", summary["ratios"]),
                ("attacker earnings", summary["attacker_earnings"]),
                ("peak RSS (MiB)", summary["peak_rss_mb"]),
                *attackers,
            ]
        )
    )
    print("\n".join(summary["problems"]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--honest", type=int, default=8)
    parser.add_argument("--attackers", type=int, default=2)
    parser.add_argument("--work-units", type=int, default=150)
    parser.add_argument("--cap-minutes", type=float, default=10.0)
    parser.add_argument(
        "--invalid-backoff",
        type=int,
        default=None,
        help="seconds (CROWDTRAIN_INVALID_BACKOFF_SECONDS); 0 turns the back-off off",
    )
    parser.add_argument("--output", default="security_hostile.json", help="file name in benchmarks/results/")
    args = parser.parse_args()
    summary = summarise(args, [run_phase(args, i, label) for i, label in enumerate(ORDER)])
    print_report(summary)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / args.output).write_text(json.dumps(summary, indent=2) + "\n")
    return 1 if summary["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
