"""Scaling: time to a target test accuracy on a Fashion-MNIST MLP with 1..16 simulated volunteers.

    .venv/bin/python -m benchmarks.scaling.run [--quick] [--volunteers 1,2,4,8,16] [--methods sync,avg]
    .venv/bin/python -m benchmarks.scaling.run --heterogeneous [--volunteers 32,64] [--churn-per-hour 0.2]

Every run starts the real platform (devstack/stack.py: daphne + Celery workers + beat on a fresh
PostgreSQL database crowdtrain_h10_<method>_<n>, cloned from a seeded template; Redis db 2), configures
the benchmark project (seed.py: the mlp preset on the 60,000 Fashion-MNIST training images) through Django,
and starts N workers/simulator.py volunteers in this process, each behind an emulated 100 Mbit/s, 20 ms
link. The clock starts when the volunteers start and stops at the first model version whose test
accuracy (evaluated here on the 10,000 test images, every version) reaches the target.

Each method is ONE algorithm whatever the number of volunteers: a round is 16 work units on one model
version, so 1 volunteer computes all 16 in turn and 16 volunteers one each, and the number of rounds needed
does not depend on N (benchmarks/scaling/offline.py runs the same math without the platform). Speedup is
then what the platform makes of more volunteers: the work split, the traffic, the validation and the
aggregation on the real server. Methods (see METHODS): `sync` = fp32 sync_sgd, a 1,024-sample step made of
16 gradients of 64 (the DistML.js way); `avg` = averaging with int8 updates AND int8 weight downloads,
16 work units of 3,000 samples, each 47 local SGD steps of 64 in the volunteer, outer Nesterov on the server.
Validation is the platform default in both: every result spot-checked (recomputed on the server) until its
volunteer has 5 valid results in a row, then 10% of them.

Emulation: each volunteer computes its update for real but does not answer before
samples x FLOPs-per-sample / --gflops. The machine's 2 cores run the volunteers AND the server, so by default
--gflops is set from the measured throughput of 16 concurrent volunteers (calibrated at start, recorded in
the JSON): 16 volunteers together emulate half of it, and the other half is the server's. The device then is
as fast relative to the server on any machine (0.5 GFLOP/s on one whose 2 cores give 20). Every work unit
whose real compute took longer than its emulated time is counted and flagged in the output.

Heterogeneous runs (--heterogeneous, issue 15 items 7 and 5; results in scaling-heterogeneous.json): 32 and 64
volunteers whose speeds spread 10x (fleet.py: log-uniform between 0.1x and 1x of a top speed), 20% of them
leaving mid-unit per hour of the run's clock and replaced by fresh ones, on the platform's crowd-sized
averaging rounds (method avg_crowd: a unit per connected device, each taking target_seconds on that device;
spot checks as in production). The top speed is the one whose target_seconds unit fills a 6,000-sample shard
(a unit never spans two), lowered if the fleet would emulate over a quarter of the calibrated capacity. The
speedup is over ONE volunteer of the fleet's mean speed computing the samples aggregated up to the target
back to back with no network, server or waiting (runner.baseline): a lower bound on that volunteer's time
on the same algorithm, measured from the run's own counts. Each device's busy fraction is its emulated
compute time over its wall time from its first unit to the target (or its departure).

Modules: config.py (constants, methods, options), emulation.py (device speed, the volunteers' accounts),
runner.py (one run on the platform), report.py (table, plot, JSON), seed.py (the project, via Django),
fleet.py (the heterogeneous fleet: speeds, churn, busy fractions).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import time
from pathlib import Path

from . import fleet, report
from .config import CHURN_PER_HOUR, METHODS, Options
from .emulation import Emulation, calibrate, capacity, emulation
from .runner import ScalingStack, run_one


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="1 and 4 volunteers, sync + avg, target 80%%")
    p.add_argument("--volunteers", default=None, help="comma-separated, default 1,2,4,8,16")
    p.add_argument("--methods", default=None, help=f"comma-separated of {','.join(METHODS)}")
    p.add_argument("--target", type=float, default=None, help="default 0.84 (0.80 with --quick)")
    p.add_argument(
        "--gflops", type=float, default=None, help="emulated device speed per volunteer (default: calibrated)"
    )
    p.add_argument("--timeout", type=float, default=None, help="seconds per run before giving up")
    p.add_argument("--output", default=None, help="results file (default benchmarks/results/scaling.json)")
    p.add_argument(
        "--replot",
        action="store_true",
        help="only recompute the summary, table and plot from the results file",
    )
    p.add_argument(
        "--database-prefix",
        default=Options.database_prefix,
        help="databases <prefix>_template and <prefix>_<method>_<n> (default %(default)s)",
    )
    p.add_argument("--redis-db", type=int, default=Options.redis_db, help="Redis db (default %(default)s)")
    p.add_argument(
        "--heterogeneous",
        action="store_true",
        help="speeds spread 10x with churn (fleet.py); default 32,64 volunteers, method avg_crowd, "
        "--gflops is the top speed; results in scaling-heterogeneous.json",
    )
    p.add_argument(
        "--churn-per-hour",
        type=float,
        default=CHURN_PER_HOUR,
        help="with --heterogeneous: share of the fleet leaving (and replaced) per hour (default %(default)s)",
    )
    p.add_argument(
        "--device-nice",
        type=int,
        default=Options.device_nice,
        help="CPU priority (nice) of the emulated volunteers' threads; 0 shares the CPU equally with the "
        "server under test (default %(default)s, the lowest: emulation.device_pool)",
    )
    p.add_argument(
        "--device-processes",
        type=int,
        default=Options.device_processes,
        help="processes the emulated volunteers train in, off the harness's GIL; 0 trains in threads of the "
        "harness, as before (default %(default)s: emulation.device_processes)",
    )
    p.add_argument(
        "--no-prefetch",
        dest="prefetch",
        action="store_false",
        help="volunteers ask for a unit only once the last is done (browsers ask as soon as they get one)",
    )
    return p


def _defaults(args: argparse.Namespace) -> tuple[str, str]:
    """Volunteers and methods when not given."""
    if args.heterogeneous:
        return "32,64", "avg_crowd"
    return ("1,4" if args.quick else "1,2,4,8,16"), "sync,avg"


def options(args: argparse.Namespace) -> Options:
    volunteers, methods = _defaults(args)
    return Options(
        quick=args.quick,
        volunteers=[int(v) for v in (args.volunteers or volunteers).split(",")],
        methods=(args.methods or methods).split(","),
        target=args.target or (0.80 if args.quick else 0.84),
        gflops=args.gflops,
        timeout=args.timeout,
        output=Path(args.output) if args.output else None,
        database_prefix=args.database_prefix,
        redis_db=args.redis_db,
        heterogeneous=args.heterogeneous,
        churn_per_hour=args.churn_per_hour,
        device_nice=args.device_nice,
        device_processes=args.device_processes,
        prefetch=args.prefetch,
    )


def emulate(opts: Options) -> Emulation:
    """Calibrate this machine and choose the emulated device speed."""
    most = max(opts.volunteers)
    print(f"calibrating: real MLP throughput with {most} concurrent volunteers ...", flush=True)
    calib = calibrate(most, seconds=2.0 if opts.quick else 4.0)
    chosen = emulation(calib, opts.gflops, opts.timeout, opts.quick, most if opts.heterogeneous else 0)
    chosen = dataclasses.replace(
        chosen, device_nice=opts.device_nice, device_processes=opts.device_processes, prefetch=opts.prefetch
    )
    need = sum(fleet.speeds(most, chosen.gflops)) if opts.heterogeneous else most * chosen.gflops
    print(
        f"  {calib}\n  emulating {'up to ' if opts.heterogeneous else ''}{chosen.gflops} GFLOP/s x {most} = "
        f"{need:g} GFLOP/s; real capacity "
        f"{calib['gradient_64_gflops_total']} (gradients) / {calib['local_steps_3000_gflops_total']} (local "
        f"steps) GFLOP/s -> headroom {capacity(calib) / need:.1f}x"
        " (before the server's own CPU use)",
        flush=True,
    )
    return chosen


def seed_template(opts: Options) -> None:
    print(f"seeding the template database {opts.template_database} once ...", flush=True)
    shutil.rmtree(opts.var_dir, ignore_errors=True)
    opts.var_dir.mkdir(parents=True)
    ScalingStack(
        var_dir=opts.var_dir, redis_db=opts.redis_db, template=opts.template_database
    ).seed_template()


def run_all(opts: Options, chosen: Emulation) -> list[report.Row]:
    """Every method with every number of volunteers, each row saved as soon as its run ends."""
    rows = []
    for method in opts.methods:
        for n in opts.volunteers:
            print(f"run {method} N={n} (load {os.getloadavg()[0]:.1f}) ...", flush=True)
            rows.append(run_one(opts, chosen, method, n))
            opts.partial.write_text(json.dumps(rows, indent=1) + "\n")
            print(report.run_line(rows[-1], opts.target), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    opts = options(args)
    if args.replot:
        (report.replot_heterogeneous if opts.heterogeneous else report.replot)(opts.results)
        return 0
    started = time.monotonic()
    chosen = emulate(opts)
    seed_template(opts)
    rows = run_all(opts, chosen)
    if opts.heterogeneous:
        return heterogeneous_report(opts, chosen, rows, started)
    report.summarize(rows)
    resnet = report.resnet18_bytes({"sync": METHODS["sync"].work_unit, "avg": METHODS["avg"].work_unit})
    report.print_summary(rows, resnet)
    wall = round(time.monotonic() - started, 1)
    report.write(opts.results, report.result(opts, chosen, rows, resnet, wall), rows, opts.target)
    opts.partial.unlink(missing_ok=True)
    print(f"\nwrote {opts.results} and {opts.results.with_suffix('.png')} in {wall} s")
    return 0


def heterogeneous_report(opts: Options, chosen: Emulation, rows: list[report.Row], started: float) -> int:
    report.print_heterogeneous(rows)
    wall = round(time.monotonic() - started, 1)
    report.write_heterogeneous(opts.results, report.heterogeneous_result(opts, chosen, rows, wall), rows)
    opts.partial.unlink(missing_ok=True)
    print(f"\nwrote {opts.results} and {opts.results.with_suffix('.png')} in {wall} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
