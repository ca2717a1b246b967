"""Storage over a long run: bytes of blobs on disk against model versions, with and without reclaiming.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/<scratch> .venv/bin/python -m benchmarks.storage.run \
        [--versions 100] [--keep-every 10]

The database named in DATABASE_URL is dropped and created anew (default crowdtrain_storage_bench), blobs go
to a temporary directory, and Celery runs eagerly in this process: the platform's own services (lifecycle,
validation, training, evaluation every 5 versions) train the MNIST demo's MLP with two honest in-process
volunteers (updates computed with engine/, int8 on the wire, int8 weights for volunteers, momentum), one
round of two work units per version. Each run trains --versions versions from scratch; "kept" runs the
storage sweep (projects/storage.py: release decided updates, prune all but every Kth/best/latest version,
collect unreferenced blobs with no grace period) after every version, "everything" never does.

Prints a table, writes benchmarks/results/storage.json and, with matplotlib, benchmarks/results/storage.png
(bytes on disk against versions, both runs).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent.parent / "results"
DEFAULT_DATABASE = "crowdtrain_storage_bench"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--versions", type=int, default=100, help="versions per run (default 100)")
    p.add_argument("--keep-every", type=int, default=10, help="KEEP_EVERY_K_VERSIONS (default 10)")
    p.add_argument("--output", type=Path, default=RESULTS / "storage.json")
    return p


def setup_django(*, keep_every: int) -> None:
    """A fresh database and blob directory, eager Celery, before Django is set up."""
    from devstack.stack import recreate_database

    name = os.environ.get("DATABASE_URL", f"/{DEFAULT_DATABASE}").rsplit("/", 1)[1] or DEFAULT_DATABASE
    os.environ["DATABASE_URL"] = recreate_database(name)
    os.environ.setdefault("CROWDTRAIN_VAR_DIR", tempfile.mkdtemp(prefix="crowdtrain-storage-bench-"))
    os.environ["CELERY_TASK_ALWAYS_EAGER"] = "1"
    os.environ["CROWDTRAIN_KEEP_EVERY_K_VERSIONS"] = str(keep_every)
    os.environ["CROWDTRAIN_EVAL_EVERY"] = "5"
    os.environ["CROWDTRAIN_BASELINE_MAX_FLOPS_PER_SAMPLE"] = "0"  # no one-CPU baseline: not what is measured
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)


@dataclass
class Run:
    name: str
    reclaim: bool
    versions: list[int] = field(default_factory=list)
    disk_bytes: list[int] = field(default_factory=list)
    blob_rows: list[int] = field(default_factory=list)
    by_kind: list[dict[str, int]] = field(default_factory=list)
    seconds: float = 0.0


def train(run: Run, *, versions: int, dataset: Any, owner: Any, volunteers: list[Any]) -> Run:
    from projects.models import Project
    from projects.services import project_create, project_start

    settings = {"batch_size": 50, "round_samples": 100, "codec": "int8", "weights_codec": "int8"}
    project = project_create(
        owner=owner, name=f"storage {run.name}", dataset=dataset, preset="mlp", settings=settings
    )
    project_start(project=project)
    started, last = time.monotonic(), -1
    while True:
        number = Project.objects.get(pk=project.pk).current_version().number
        if number != last:
            record(run, number)
            last = number
        if number >= versions:
            break
        for user in volunteers:
            work(user)
        if run.reclaim:
            reclaim()
    run.seconds = time.monotonic() - started
    # The next run starts from the same disk: the dataset's shards and the (same) graph only.
    Project.objects.filter(pk=project.pk).delete()
    reclaim()
    return run


def work(user: Any) -> None:
    """One honest instance, if any is open: what a browser computes, validated and aggregated eagerly."""
    from engine import codecs
    from projects import lifecycle
    from projects.validation import recompute

    result = lifecycle.work_unit_assign(user=user)
    if result is None:
        return
    unit = result.work_unit
    payload = codecs.encode(recompute(work_unit=unit), codec=unit.project.codec)
    lifecycle.result_receive(
        user=user, work_unit_id=unit.pk, samples=unit.count, loss=1.0, compute_ms=5, payload=payload
    )


def reclaim() -> None:
    from projects import storage

    storage.storage_release_decided()
    storage.versions_prune()
    storage.blobs_collect_garbage(grace_seconds=0)


def record(run: Run, number: int) -> None:
    from projects.storage import storage_report

    report = storage_report()
    run.versions.append(number)
    run.disk_bytes.append(report.disk_bytes)
    run.blob_rows.append(report.blob_rows)
    run.by_kind.append(report.totals)


def table(runs: list[Run], *, every: int) -> str:
    lines = [f"{'version':>8}" + "".join(f"{r.name + ' (MiB)':>20}{'blobs':>8}" for r in runs)]
    longest = max(runs, key=lambda r: len(r.versions))
    for i, number in enumerate(longest.versions):
        if number % every and i != len(longest.versions) - 1:
            continue
        cells = ""
        for r in runs:
            j = r.versions.index(number) if number in r.versions else -1
            cells += f"{r.disk_bytes[j] / 2**20:>20.2f}{r.blob_rows[j]:>8}" if j >= 0 else f"{'':>28}"
        lines.append(f"{number:>8}" + cells)
    return "\n".join(lines)


def plot(runs: list[Run], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in runs:
        ax.plot(r.versions, [b / 2**20 for b in r.disk_bytes], label=r.name)
    ax.set_xlabel("model version")
    ax.set_ylabel("blobs on disk (MiB)")
    ax.set_title("Blob storage during a long run: MNIST MLP, 2 work units per version")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main() -> None:
    args = parser().parse_args()
    setup_django(keep_every=args.keep_every)
    from django.contrib.auth.models import User

    from projects import demo
    from projects.datasets import dataset_create_from_npz

    owner = User.objects.create_user("bench-researcher", password="bench-pass-123", is_staff=True)
    dataset = dataset_create_from_npz(owner=owner, name="MNIST digits", data=demo.mnist_npz())
    volunteers = [User.objects.create_user(f"bench-{i}", password="bench-pass-123") for i in range(2)]
    runs = [
        train(Run(name, reclaim), versions=args.versions, dataset=dataset, owner=owner, volunteers=volunteers)
        for name, reclaim in (("kept", True), ("everything", False))
    ]
    print(table(runs, every=10))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    meta = {"versions": args.versions, "keep_every_k_versions": args.keep_every, "volunteers": 2}
    args.output.write_text(json.dumps({"config": meta, "runs": [r.__dict__ for r in runs]}, indent=1) + "\n")
    png = args.output.with_suffix(".png")
    print(f"wrote {args.output}" + (f" and {png}" if plot(runs, png) else " (no matplotlib: no plot)"))


if __name__ == "__main__":
    main()
