"""The upload fuzz (issue 9, item 4): hostile datasets, graphs and weights through the admin's forms, with
the time and memory each one costs.

    .venv/bin/python -m benchmarks.security.uploads [--cases 3000] [--seed 1]

In one process on a fresh PostgreSQL test database (DATABASE_URL's name with a test_ prefix; default
crowdtrain_uploads_bench) and a temporary BLOB_ROOT: first the issue's cases at full size (a 4 TB .npy
header, a 253 KB zip bomb inflating to 1.47 GB, graphs and safetensors headers nested 100,000 deep, an
89.5 MB safetensors header, activations of 1.5 TB per sample) next to an honest 60 MB upload, then
--cases random ones (tests/security/uploads.py). Every upload is written to disk first and handed to the
form as Django hands over a spooled upload, so the input itself never counts as the parser's memory.

Prints a table and writes benchmarks/results/security_uploads.json: cases, refusals, crashes (any
exception out of a form: must be 0), anything saved by a refused upload (must be 0), the slowest case and
the peak RSS above the baseline before each case (sampled every 2 ms). Exits 1 on a crash or on anything
saved by a refused upload.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import psutil
from django.utils.datastructures import MultiValueDict

from tests.security import uploads as u

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
MIB = 2**20


def setup_django() -> tuple[Any, str]:
    os.environ.setdefault("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/crowdtrain_uploads_bench")
    os.environ.setdefault("CROWDTRAIN_VAR_DIR", tempfile.mkdtemp(prefix="crowdtrain-uploads-bench-"))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    os.environ.setdefault("CELERY_TASK_ALWAYS_EAGER", "1")
    import django

    django.setup()
    from django.db import connection
    from django.test.utils import setup_test_environment

    setup_test_environment()
    name = connection.settings_dict["NAME"]
    connection.creation.create_test_db(verbosity=0, autoclobber=True)
    return connection, name


class PeakSampler:
    """The process's largest RSS while a block runs, sampled every 2 ms in a thread."""

    def __init__(self) -> None:
        self.process = psutil.Process()
        self.peak = 0
        self._running = False

    def _loop(self) -> None:
        while self._running:
            self.peak = max(self.peak, self.process.memory_info().rss)
            time.sleep(0.002)

    @contextmanager
    def measure(self, collect: bool) -> Iterator[dict[str, float]]:
        if collect:  # a stable baseline for the big cases; too slow to do before every small one
            gc.collect()
        out: dict[str, float] = {}
        baseline = self.process.memory_info().rss
        self.peak, self._running = baseline, True
        thread = threading.Thread(target=self._loop, daemon=True)
        thread.start()
        start = time.perf_counter()
        try:
            yield out
        finally:
            out["seconds"] = time.perf_counter() - start
            self._running = False
            thread.join()
            out["rss_delta_mib"] = max(0, self.peak - baseline) / MIB


def spooled(name: str, data: bytes) -> Any:
    """The upload as Django passes a large one to a form: a temporary file on disk."""
    from django.core.files.uploadedfile import TemporaryUploadedFile

    upload = TemporaryUploadedFile(name, "application/octet-stream", len(data), None)
    upload.write(data)
    upload.seek(0)
    return upload


class Bench:
    def __init__(self) -> None:
        from django.contrib.auth.models import User

        from projects.datasets import dataset_create_from_npz

        self.owner = User.objects.create_superuser("bench", password="bench-pass-123")
        self.dataset = dataset_create_from_npz(owner=self.owner, name="tiny", data=u.valid_npz(samples=40))
        self.valid_graph = json.dumps(u.mlp_graph()).encode()
        self.valid_weights = u.weights_for(u.mlp_graph())
        self.sampler = PeakSampler()
        for kind in (u.GRAPH, u.WEIGHTS, u.NPZ):  # first use of each form pays for imports and warm-up
            self.run(u.Upload(kind, f"warm-up {kind}", b"{}"))

    def form(self, upload: u.Upload) -> Any:
        from projects import forms
        from tests.integration.test_admin import project_form

        if upload.kind == u.NPZ:
            return forms.DatasetAddForm(
                {"name": upload.name}, MultiValueDict({"file": [spooled("f.npz", upload.data)]})
            )
        graph, weights = (
            (upload.data, self.valid_weights) if upload.kind == u.GRAPH else (self.valid_graph, upload.data)
        )
        files = {
            "graph_file": spooled("graph.json", graph),
            "weights_file": spooled("weights.safetensors", weights),
        }
        data = project_form(name=upload.name, model_source="upload", preset="", dataset=str(self.dataset.pk))
        return type("Form", (forms.ProjectAddForm,), {"owner": self.owner})(data, files)

    def saved(self) -> tuple[int, ...]:
        from django.conf import settings

        from projects.models import Blob, Dataset, Project

        files = sum(1 for p in Path(settings.BLOB_ROOT).rglob("*") if p.is_file())
        return Dataset.objects.count(), Project.objects.count(), Blob.objects.count(), files

    def run(self, upload: u.Upload) -> dict[str, Any]:
        """One upload: refused (with its first error), accepted (and saved), or a crash."""
        form, before = self.form(upload), self.saved()
        row: dict[str, Any] = {"kind": upload.kind, "name": upload.name, "bytes": len(upload.data)}
        with self.sampler.measure(collect=len(upload.data) > MIB) as cost:
            try:
                valid = form.is_valid()
                if valid:
                    form.create(owner=self.owner)
            except Exception as exc:  # noqa: BLE001 - a crash is what this benchmark counts
                row.update(outcome="crash", error=f"{type(exc).__name__}: {str(exc)[:300]}")
        row.update(seconds=round(cost["seconds"], 4), rss_delta_mib=round(cost["rss_delta_mib"], 1))
        if "outcome" not in row:
            row["outcome"] = "accepted" if valid else "refused"
            row["error"] = "" if valid else _first_error(form)
            row["saved_by_refusal"] = not valid and self.saved() != before
        return row


def _first_error(form: Any) -> str:
    for field, errors in form.errors.items():
        return f"{field}: {errors[0][:160]}"
    return ""


def named_cases() -> list[tuple[str, Callable[[], u.Upload]]]:
    def honest() -> u.Upload:
        x = np.random.default_rng(0).random((20_000, 784), dtype=np.float32)
        data = u.zip_of([("x.npy", u.npy_array(x)), ("y.npy", u.labels(20_000))])
        return u.Upload(u.NPZ, "honest 20,000 x 784 float32 (63 MB)", data)

    def big_header() -> bytes:
        pad = "p" * (89_500_000 - 40)
        return u.safetensors(json.dumps({"__metadata__": {"pad": pad}}).encode())

    bomb = u.activation_bomb(features=4, side=153_664, classes=2)
    return [
        ("honest", honest),
        ("npz", lambda: u.Upload(u.NPZ, "npz header shape (10**12, 1)", u.huge_shape_npz())),
        ("bomb", lambda: u.Upload(u.NPZ, "zip bomb: 1.47 GB of zeros", u.zip_bomb(1_470_000_000))),
        (
            "bomb400",
            lambda: u.Upload(u.NPZ, "zip bomb: 400 MB (under the size limit)", u.zip_bomb(400 * MIB)),
        ),
        ("graph", lambda: u.Upload(u.GRAPH, "graph.json nested 100,000 deep", u.nested_json(100_000))),
        (
            "act",
            lambda: u.Upload(
                u.GRAPH, "graph with activations of 1.5 TB per sample", json.dumps(bomb).encode()
            ),
        ),
        (
            "st",
            lambda: u.Upload(
                u.WEIGHTS, "safetensors header nested 100,000 deep", u.safetensors(u.nested_json(100_000))
            ),
        ),
        ("st89", lambda: u.Upload(u.WEIGHTS, "safetensors header of 89.5 MB", big_header())),
        (
            "st16",
            lambda: u.Upload(
                u.WEIGHTS,
                "safetensors header of 16 MiB (the limit)",
                u.safetensors(json.dumps({"__metadata__": {"p": "p" * (16 * MIB - 30)}}).encode()),
            ),
        ),
    ]


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    outcomes = Counter(row["outcome"] for row in rows)
    slowest = max(rows, key=lambda row: row["seconds"])
    return {
        "cases": len(rows),
        "by_kind": dict(Counter(row["kind"] for row in rows)),
        "refused": outcomes["refused"],
        "accepted": outcomes["accepted"],
        "crashes": outcomes["crash"],
        "saved_by_refusals": sum(bool(row.get("saved_by_refusal")) for row in rows),
        "slowest_seconds": slowest["seconds"],
        "slowest_case": slowest["name"],
        "peak_rss_delta_mib": max(row["rss_delta_mib"] for row in rows),
    }


def table(rows: list[tuple[str, Any]]) -> str:
    width = max(len(str(label)) for label, _ in rows)
    return "\n".join(f"{label:<{width}}  {value}" for label, value in rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    connection, database = setup_django()
    try:
        bench = Bench()
        named = [bench.run(make()) for _, make in named_cases()]
        fuzz = []
        for index, upload in enumerate(u.random_uploads(args.seed, args.cases), 1):
            fuzz.append(bench.run(upload))
            if index % 250 == 0:
                print(f"{index} / {args.cases} uploads", file=sys.stderr, flush=True)
        summary = {"named": summarise(named), "fuzz": summarise(fuzz)}
    finally:
        connection.creation.destroy_test_db(database, verbosity=0)
    print(
        table(
            [
                (
                    row["name"],
                    f"{row['outcome']:<8} {row['seconds']:>7.3f} s "
                    f"{row['rss_delta_mib']:>8.1f} MiB  {row['error'][:90]}",
                )
                for row in named
            ]
        )
    )
    print()
    print(table(list(summary["fuzz"].items())))
    crashes = [row for row in named + fuzz if row["outcome"] == "crash"]
    for row in crashes[:20]:
        print("CRASH", row["name"], row["error"])
    RESULTS.mkdir(exist_ok=True)
    report = {
        "args": vars(args),
        **summary,
        "named_cases": named,
        "crashes_detail": crashes[:50],
        "environment": _environment(),
    }
    (RESULTS / "security_uploads.json").write_text(json.dumps(report, indent=2) + "\n")
    saved = summary["fuzz"]["saved_by_refusals"] + summary["named"]["saved_by_refusals"]
    return 1 if crashes or saved else 0


def _environment() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


if __name__ == "__main__":
    sys.exit(main())
