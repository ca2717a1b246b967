"""`manage.py simulate_volunteers --url http://127.0.0.1:8000 --count 4 ...`: load-test a running server.

All volunteers are asyncio tasks in this one process, speaking the public protocol like browsers do
(workers/simulator.py); nothing here touches the database.
"""

from __future__ import annotations

import asyncio
import os
from argparse import ArgumentParser
from typing import Any

import torch
from django.core.management.base import BaseCommand, CommandError
from tqdm import tqdm

from workers.simulator import BYZANTINE, Simulator, SimulatorConfig, SimulatorStats

COLUMNS = (
    "username",
    "work_units",
    "valid",
    "invalid",
    "late",
    "unanswered",
    "dropped",
    "reconnects",
    "credit_flops",
    "bytes_sent",
    "bytes_received",
    "compute_seconds",
    "wall_seconds",
    "compute_share",
)


def configs(options: dict[str, Any]) -> list[SimulatorConfig]:
    """sim-0001 .. sim-NNNN; the first byzantine_fraction of them misbehave."""
    count = options["count"]
    byzantine = round(count * options["byzantine_fraction"]) if options["byzantine"] != "none" else 0
    return [
        SimulatorConfig(
            url=options["url"],
            username=f"sim-{i + 1:04d}",
            password=options["password"],
            signup=True,
            gflops=options["gflops"],
            bandwidth_mbit=options["bandwidth_mbit"],
            latency_ms=options["latency_ms"],
            failure_probability=options["failure_probability"],
            max_work_units=options["work_units"],
            duration_s=options["duration"],
            byzantine=options["byzantine"] if i < byzantine else "none",
            prefetch=options["prefetch"],
            verdict_timeout_s=options["verdict_timeout"],
            seed=i,
        )
        for i in range(count)
    ]


def format_table(rows: list[SimulatorStats]) -> str:
    cells = [[_cell(getattr(row, column)) for column in COLUMNS] for row in rows]
    widths = [max([len(c), *(len(r[i]) for r in cells)]) for i, c in enumerate(COLUMNS)]  # rows may be []
    lines = ["  ".join(c.ljust(w) for c, w in zip(COLUMNS, widths, strict=True))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.2f}" if value < 1 else f"{value:.1f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


Outcome = SimulatorStats | BaseException


async def simulate(all_configs: list[SimulatorConfig], bar: tqdm[Any]) -> list[Outcome]:
    # The bar counts verdicts (valid, invalid or late), which arrive after validation, not on upload.
    simulators = [Simulator(config, on_verdict=lambda unit, verdict: bar.update()) for config in all_configs]
    return list(await asyncio.gather(*(s.run() for s in simulators), return_exceptions=True))


class Command(BaseCommand):
    help = "Run simulated volunteers (real gradients, emulated speed and network) against a running server."

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("--url", default="http://127.0.0.1:8000")
        parser.add_argument("--count", type=int, default=4)
        parser.add_argument("--password", default="simulated-volunteer-pass")
        parser.add_argument("--gflops", type=float, default=20.0, help="Emulated device speed (0: no limit).")
        parser.add_argument("--bandwidth-mbit", type=float, default=0.0, help="0: no limit.")
        parser.add_argument("--latency-ms", type=float, default=0.0)
        parser.add_argument("--failure-probability", type=float, default=0.0)
        parser.add_argument("--byzantine", choices=BYZANTINE, default="none")
        parser.add_argument("--byzantine-fraction", type=float, default=0.0)
        parser.add_argument("--work-units", type=int, help="Per volunteer.")
        parser.add_argument("--duration", type=float, help="Seconds.")
        parser.add_argument("--prefetch", action="store_true", help="Ask for the next unit while computing.")
        parser.add_argument(
            "--verdict-timeout",
            type=float,
            default=30.0,
            help="Seconds to wait at the end for verdicts still being validated.",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        if options["work_units"] is None and options["duration"] is None:
            raise CommandError("Give --work-units or --duration (or both), or the simulation never ends.")
        # Many volunteers each with all cores would thrash; share the cores out instead.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // options["count"]))
        with tqdm(desc="verdicts", unit="wu") as bar:
            outcomes = asyncio.run(simulate(configs(options), bar))
        stats = [o for o in outcomes if isinstance(o, SimulatorStats)]
        self.stdout.write(format_table(stats))
        for failure in (o for o in outcomes if not isinstance(o, SimulatorStats)):
            self.stderr.write(f"a volunteer stopped: {failure!r}")
        if not stats:
            raise CommandError("No simulated volunteer could run (is the server at --url up?).")
