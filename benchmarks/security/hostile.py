"""Hostile volunteers: training progress with 20% of the crowd sending poisoned results, against none.

    .venv/bin/python -m benchmarks.security.hostile [--honest 8] [--attackers 2] [--work-units 20]

Starts the platform (tests/e2e/stack.py on a fresh PostgreSQL database, Redis db 7) and runs two phases of
fresh simulated volunteers on the MNIST demo: the honest ones alone, then the same number of honest ones
with --attackers poisoning volunteers (workers/simulator.py byzantine="poison": deep safetensors header,
NaN, wrong shapes, model version + 999, compute_ms 2**63 - 1, in turn). Prints versions per minute and per
honest result for both phases, the attackers' earnings and each server process's peak RSS; writes
benchmarks/results/security_hostile.json. Exits 1 if the attacked phase stalled, fell under 80% of the
clean phase's versions per honest result, or paid an attacker.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from tests.e2e.stack import Stack
from tests.security.fuzz import Phase, earned, hostile_phase

from .fuzz import RESULTS, environment, peak_memory, start_stack, table

MIN_RATIO = 0.8


def run_phase(stack: Stack, args: argparse.Namespace, label: str, attackers: int) -> Phase:
    return asyncio.run(hostile_phase(stack.url, stack.database_url, label=label, honest=args.honest,
                                   attackers=attackers, work_units=args.work_units,
                                   cap_seconds=args.cap_minutes * 60))


def verdict(clean: Phase, attacked: Phase, attacker_earnings: tuple[int, int]) -> list[str]:
    problems = []
    if not (clean.completed and attacked.completed):
        problems.append("a phase stalled: its honest volunteers did not finish their work units")
    ratio = attacked.versions_per_honest_result / max(clean.versions_per_honest_result, 1e-9)
    if ratio < MIN_RATIO:
        problems.append(f"attacked progress is {ratio:.0%} of clean (< {MIN_RATIO:.0%})")
    if attacker_earnings != (0, 0):
        problems.append(f"attackers earned (FLOPs, valid results) {attacker_earnings}")
    return problems


def print_table(clean: dict[str, Any], attacked: dict[str, Any]) -> None:
    keys = ("versions", "seconds", "versions_per_minute", "versions_per_honest_result", "honest_results",
            "honest_valid", "honest_invalid", "honest_late", "completed")
    print(table([("", "clean | attacked"), *((k, f"{clean[k]} | {attacked[k]}") for k in keys)]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--honest", type=int, default=8)
    parser.add_argument("--attackers", type=int, default=2)
    parser.add_argument("--work-units", type=int, default=20)
    parser.add_argument("--cap-minutes", type=float, default=10.0)
    args = parser.parse_args()
    stack = start_stack("security_hostile", 7, round_timeout=10)
    try:
        clean = run_phase(stack, args, "clean", 0)
        attacked = run_phase(stack, args, "attacked", args.attackers)
        earnings = earned(stack.database_url, "attacked-attacker")
        memory = peak_memory(stack)
    finally:
        stack.stop()
    problems = verdict(clean, attacked, earnings)
    summary: dict[str, Any] = {"args": vars(args), "clean": clean.summary(), "attacked": attacked.summary(),
               "ratio_versions_per_honest_result": round(attacked.versions_per_honest_result
                                                         / max(clean.versions_per_honest_result, 1e-9), 3),
               "ratio_versions_per_minute": round(attacked.versions_per_minute
                                                  / max(clean.versions_per_minute, 1e-9), 3),
               "attacker_earnings": {"flops": earnings[0], "valid_results": earnings[1]},
               "peak_rss_mb": memory, "problems": problems, "environment": environment()}
    print_table(summary["clean"], summary["attacked"])
    print(table([("ratios (per honest result, per minute)", (summary["ratio_versions_per_honest_result"],
                                                           summary["ratio_versions_per_minute"])),
                 ("attacker earnings", summary["attacker_earnings"]), ("peak RSS (MiB)", memory),
                 ("attackers", summary["attacked"]["attackers"])]))
    print("\n".join(problems))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "security_hostile.json").write_text(json.dumps(summary, indent=2) + "\n")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
