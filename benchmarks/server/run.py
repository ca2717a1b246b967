"""The server's costs (issue 15), measured on this machine:

    .venv/bin/python -m benchmarks.server.run [--trials 7] [--database crowdtrain_server_bench]

- aggregation (benchmarks/server/aggregation.py): one ResNet-18-sized int8 update checked and folded into
  its round, and one version published, before (the code as it was, benchmarks/server/before.py) and after,
  side by side in one run; prints a table and writes benchmarks/results/server-aggregation.json.
- work-unit throughput (benchmarks/server/throughput.py, its own process and stacks; `make bench-server`
  runs it after this one): volunteers vs units/s, CPU and database time per unit, deadlocks, before/after.

The database named by --database on the local PostgreSQL is dropped and created anew, blobs go to a
temporary directory (removed at the end) and Celery runs eagerly in this process.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path

RESULTS = Path(__file__).resolve().parent.parent / "results"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--trials", type=int, default=7, help="trials per measurement, the median counts (default 7)"
    )
    p.add_argument("--database", default="crowdtrain_server_bench", help="scratch database (dropped first)")
    p.add_argument("--output", type=Path, default=RESULTS / "server-aggregation.json")
    return p


def setup_django(*, database: str, var_dir: str) -> None:
    """A fresh database and blob directory, eager Celery, one torch thread (as the Celery workers run)."""
    from devstack.stack import recreate_database

    os.environ["DATABASE_URL"] = recreate_database(database)
    os.environ["CROWDTRAIN_VAR_DIR"] = var_dir
    os.environ["CELERY_TASK_ALWAYS_EAGER"] = "1"
    os.environ["CROWDTRAIN_BASELINE_MAX_FLOPS_PER_SAMPLE"] = "0"  # no one-CPU baseline: not what is measured
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)


def main() -> None:
    args = parser().parse_args()
    var_dir = tempfile.mkdtemp(prefix="crowdtrain-server-bench-")
    try:
        setup_django(database=args.database, var_dir=var_dir)
        from . import aggregation

        result = aggregation.measure(trials=args.trials)
    finally:
        shutil.rmtree(var_dir, ignore_errors=True)
    print(aggregation.table(result))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
