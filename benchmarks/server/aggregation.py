"""Aggregation cost (issue 15, item 4): one ResNet-18-sized int8 update checked and folded into its round,
and one version published, before (benchmarks/server/before.py, the code as it was) and after, in one run.

Everything runs on the platform's own functions and blob store (a scratch PostgreSQL database, blobs in a
temporary directory) for a real ResNet-18 project (the preset: 11.2M parameters, SGD momentum 0.9, updates
int8 in blocks of 256, fp32 weights down, as the defaults are). CPU time is time.process_time (this
process, user + system), median of the trials, on one torch thread as the Celery workers run
(CROWDTRAIN_TORCH_THREADS).

- per update: validation's checks (read the blob, decode or parse it, names and shapes, finite values, norm)
  plus aggregation's share (read it again, decode or parse it, fold it into the round). Before: read and
  decoded twice into float32, and its share of weighted_mean over the round's updates held decoded (measured
  over 4, divided by 4). After: mapped (mmap) and parsed twice (the header is checked once per process),
  never decoded: the norm and the fold read the int8 values a chunk at a time. Database queries of
  validation (replays, norm history) are not counted: the same before and after, and item 1's business.
- publish: from the round's mean update to the next version stored: the optimizer step on the current
  weights and momentum, then both encoded, hashed (SHA-256: blobs are content-addressed) and written, and the
  version's row. After: training._version_next as project_step runs it, in one transaction timed to its
  commit (the round's results marked aggregated, the momentum's storing started on commit); the version the
  round was on is the input, fetched untimed as the update is made. Warm: the weights and momentum this
  process published last are still in memory (training._published); cold: they are read from their blobs,
  as on another worker process.
"""

from __future__ import annotations

import gc
import hashlib
import io
import math
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from . import before

TARGETS = {"per_update_ms": 15.0, "publish_ms": 30.0}
FOLD_ROUND = 4  # updates in the "before" weighted mean (held decoded at once, as the old round did)
SAMPLES = 64.0  # each update's weight: its sample count


@dataclass
class Measured:
    """CPU milliseconds of each trial of one step; the median is what counts."""

    samples: list[float] = field(default_factory=list)
    wall: list[float] = field(default_factory=list)  # elapsed milliseconds of the same trials

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def wall_median(self) -> float:
        return statistics.median(self.wall)


def cpu(
    fn: Callable[[], object],
    trials: int,
    setup: Callable[[], object] | None = None,
    teardown: Callable[[], object] | None = None,
) -> Measured:
    """CPU time of this process (every thread's) and elapsed time of `fn`; `setup` and `teardown` (e.g.
    waiting for what `fn` left running after it returned) are not timed."""
    measured = Measured()
    for _ in range(trials):
        if setup is not None:
            setup()
        gc.collect()
        start, started = time.process_time(), time.perf_counter()
        fn()
        measured.samples.append((time.process_time() - start) * 1000)
        measured.wall.append((time.perf_counter() - started) * 1000)
        if teardown is not None:
            teardown()
    return measured


def resnet_project() -> Any:
    """A running ResNet-18 project (the preset) on a tiny random 3x32x32 dataset."""
    from django.contrib.auth.models import User

    from projects.datasets import dataset_create_from_npz
    from projects.services import project_create, project_start

    owner = User.objects.create_user("bench-aggregation", password="bench-pass-123", is_staff=True)
    rng = np.random.default_rng(0)
    buffer = io.BytesIO()
    x, y = rng.standard_normal((40, 3, 32, 32), dtype=np.float32), np.arange(40) % 10
    np.savez(buffer, x=x, y=y, x_test=x[:10], y_test=y[:10])
    dataset = dataset_create_from_npz(owner=owner, name="random 3x32x32", data=buffer.getvalue())
    settings = {"codec": "int8", "momentum": 0.9, "learning_rate": 0.1}
    project = project_create(
        owner=owner, name="ResNet-18", dataset=dataset, preset="resnet18", settings=settings
    )
    return project_start(project=project)


def honest_update(names: list[str], shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shapes[name], generator=g) * 1e-2 for name in names}


def per_update(project: Any, trials: int) -> dict[str, Any]:
    """Check one update and fold it into its round, before and after."""
    from engine import aggregate, codecs
    from projects.blobs import blob_put, blob_view
    from projects.services import project_graph

    graph = project_graph(project=project)
    names, buffers = [p.name for p in graph.params], graph.trained_buffers()
    shapes = {t.name: tuple(t.shape) for t in [*graph.params, *graph.buffers]}
    update = honest_update([*names, *buffers], shapes, seed=1)
    blob = blob_put(data=codecs.encode(update, "int8"))  # what a volunteer uploads, in the blob store
    expected = {name: shapes[name] for name in [*names, *buffers]}

    def validate_before() -> None:
        decoded = before.decode(before.read(blob))[0]
        assert before.check_update(decoded, expected) is None
        before.norm({name: decoded[name] for name in names})

    def validate_after() -> None:
        packed = codecs.parse(blob_view(blob=blob))
        assert aggregate.check_update(packed, expected) is None
        math.sqrt(packed.select(names).sq_norm())

    held = [before.decode(before.read(blob))[0] for _ in range(FOLD_ROUND)]
    sums, buffer_sums = aggregate.WeightedSum(names), aggregate.WeightedSum(buffers)

    def fold_after() -> None:
        packed = codecs.parse(blob_view(blob=blob))
        sums.add(packed, SAMPLES)
        buffer_sums.add(packed, SAMPLES)

    first_fold = cpu(fold_after, 1)  # allocates the round's sums: once per round
    steps = {
        "before": {
            "validation: decode + check + norm": cpu(validate_before, trials),
            "aggregation: decode again": cpu(lambda: before.decode(before.read(blob)), trials),
            "aggregation: share of the weighted mean": _share(held, names, buffers, trials),
        },
        "after": {
            "validation: parse + check + norm": cpu(validate_after, trials),
            "aggregation: parse + fold into the sum": cpu(fold_after, trials),
        },
    }
    check = _mean_difference(held, names, blob)
    return {
        "update_bytes": blob.size,
        "parameters": sum(math.prod(shapes[n]) for n in names),
        "steps_ms": {
            side: {k: round(v.median, 2) for k, v in parts.items()} for side, parts in steps.items()
        },
        "trials_ms": {side: {k: v.samples for k, v in parts.items()} for side, parts in steps.items()},
        "total_ms": {side: round(sum(v.median for v in parts.values()), 2) for side, parts in steps.items()},
        "round_sums_allocation_ms": round(first_fold.median, 2),
        "decode_only_ms": {
            "before: decode": round(cpu(lambda: before.decode(before.read(blob)), trials).median, 2),
            "after: decode (a spot check's)": round(
                cpu(lambda: codecs.decode(blob_view(blob=blob)), trials).median, 2
            ),
            "after: parse": round(cpu(lambda: codecs.parse(blob_view(blob=blob)), trials).median, 2),
        },
        "mean_max_abs_difference": check,
    }


def _share(
    held: list[dict[str, torch.Tensor]], names: list[str], buffers: list[str], trials: int
) -> Measured:
    weights = [SAMPLES] * len(held)

    def mean() -> None:
        before.weighted_mean([{n: u[n] for n in names} for u in held], weights)
        before.weighted_mean([{n: u[n] for n in buffers} for u in held], weights)

    whole = cpu(mean, trials)
    return Measured([sample / len(held) for sample in whole.samples])


def _mean_difference(held: list[dict[str, torch.Tensor]], names: list[str], blob: Any) -> float:
    """The streamed mean against the old weighted mean of the same updates (should be float32 rounding)."""
    from engine import aggregate, codecs
    from projects.blobs import blob_view

    old = before.weighted_mean([{n: u[n] for n in names} for u in held], [SAMPLES] * len(held))
    streamed = aggregate.WeightedSum(names)
    for _ in held:
        streamed.add(codecs.parse(blob_view(blob=blob)), SAMPLES)
    new = streamed.mean()
    return max(float((old[n] - new[n]).abs().max()) for n in names)


def publish(project: Any, trials: int) -> dict[str, Any]:
    """One version published from the round's mean update (the step, the weights stored, the version's
    row), before (the code as it was), main (before this change) and after, warm and cold. After, the
    momentum is stored once the version is out (training._keep's thread): that is timed apart, off the
    critical path, and waited for between trials (the next step would wait for it too)."""
    from django.db import transaction

    from projects import training
    from projects.services import project_graph

    graph = project_graph(project=project)
    names = [p.name for p in graph.params]
    shapes = {t.name: tuple(t.shape) for t in graph.params}
    update = honest_update(names, shapes, seed=2)
    results = round_results(project)
    scratch: dict[str, torch.Tensor] = {}
    current: list[Any] = []  # the version the round was on: the publish's input, as the update is
    published: list[tuple[Any, dict[str, torch.Tensor], dict[str, torch.Tensor]]] = []

    def fresh_update() -> None:
        scratch.clear()
        scratch.update({name: value.clone() for name, value in update.items()})
        current[:] = [project.current_version()]

    def after() -> None:  # as project_step publishes: in one transaction, timed to its commit (and _keep)
        with transaction.atomic():
            training._version_next(
                project=project, current=current[0], update=dict(scratch), buffers={}, results=results
            )

    def kept() -> None:  # the momentum being stored by _keep's thread, as the next step waits for it
        _saved(training)

    def main() -> None:
        params, state = training._step(project=project, version=current[0], update=dict(scratch))
        version = before.version_publish_main(
            project=project,
            number=current[0].number + 1,
            weights=params,
            momentum=state,
            samples=64,
            wire_codec=project.weights_codec,
        )
        published.append((version, params, state))

    def main_kept() -> None:
        version, params, state = published.pop()
        training._published[project.pk] = training._Kept(version.pk, version.weights_id, params, state, None)

    def old() -> None:
        weights = before.decode(before.read(current[0].weights_blob))[0]
        state = (
            before.decode(before.read(current[0].optimizer_state))[0] if current[0].optimizer_state else {}
        )
        params, state = before.sgd_step(
            weights, scratch, state, lr=project.learning_rate, momentum=project.momentum
        )
        before.version_publish(
            project=project,
            number=current[0].number + 1,
            weights=params,
            momentum=state,
            samples=64,
            wire_codec=project.weights_codec,
        )

    def cold() -> None:
        fresh_update()
        training._published.clear()

    def once(fn: Callable[[], None], then: Callable[[], None]) -> None:  # untimed: the last version is
        fresh_update()  # now this process's own, stored as that path stores it
        fn()
        then()

    once(after, kept)  # version 1: from here on every version has a momentum state, as in a long run
    measured = {"before": cpu(old, trials, setup=fresh_update)}
    once(main, main_kept)
    measured["main (warm)"] = cpu(main, trials, setup=fresh_update, teardown=main_kept)
    measured["main (cold)"] = cpu(main, trials, setup=cold, teardown=lambda: published.clear())
    once(after, kept)
    measured[WARM] = cpu(after, trials, setup=fresh_update, teardown=kept)
    measured["after (cold: the last version read from its blobs)"] = cpu(
        after, trials, setup=cold, teardown=kept
    )
    project.weights_codec = "int8"  # volunteers download int8 weights too (a third blob, quantised)
    measured["before, int8 weights down too"] = cpu(old, trials, setup=fresh_update)
    once(main, main_kept)
    measured["main (warm), int8 weights down too"] = cpu(main, trials, setup=fresh_update, teardown=main_kept)
    once(after, kept)
    measured["after (warm), int8 weights down too"] = cpu(after, trials, setup=fresh_update, teardown=kept)
    project.weights_codec = "fp32"
    return {
        "publish_ms": {k: round(v.median, 2) for k, v in measured.items()},
        "publish_wall_ms": {k: round(v.wall_median, 2) for k, v in measured.items()},
        "trials_ms": {k: v.samples for k, v in measured.items()},
        "trials_wall_ms": {k: v.wall for k, v in measured.items()},
        "momentum_stored_after_ms": _momentum_store(project, training, trials),
        "parts_ms": _publish_parts(project, update, training, trials),
        "step_max_abs_difference": _step_difference(project, update, training),
        "recovered_momentum_max_relative_difference": _recovery_difference(project),
    }


WARM = "after (warm: this process published the last version)"


def round_results(project: Any) -> list[Any]:
    """Results of the round for the publish to mark aggregated (one per work unit project_start fed, each
    its own update of 64 samples): the same rows every trial, a real UPDATE each time."""
    from datetime import timedelta

    from django.utils import timezone

    from projects.models import Result

    deadline = timezone.now() + timedelta(days=1)
    volunteer = project.owner
    return [
        Result.objects.create(work_unit=unit, volunteer=volunteer, deadline=deadline, samples=64, loss=2.3)
        for unit in project.work_units.all()
    ]


def _saved(training: Any) -> None:
    """Wait for the momentum being stored (as the next step would)."""
    for kept in list(training._published.values()):
        if kept.saver is not None:
            kept.saver.join()


def _momentum_store(project: Any, training: Any, trials: int) -> dict[str, float]:
    """Storing a version's momentum after it was announced (training._state_store), CPU and elapsed: off
    the critical path, on the worker's time before its next task."""
    current = project.current_version()
    _, state = training._owned(version=current)
    stored = cpu(
        lambda: training._state_store(version_id=current.pk, state=state),
        trials,
        teardown=lambda: _unstored(current),
    )
    training._state_store(version_id=current.pk, state=state)
    return {"cpu": round(stored.median, 2), "elapsed": round(stored.wall_median, 2)}


def _unstored(version: Any) -> None:
    """Forget the stored state again, row reference and file, so that the next trial writes it anew (the
    same bytes at the same address; the Blob row stays)."""
    from projects.models import ModelVersion

    stored = ModelVersion.objects.select_related("optimizer_state").get(pk=version.pk).optimizer_state
    ModelVersion.objects.filter(pk=version.pk).update(optimizer_state=None)
    if stored is not None:
        Path(stored.path).unlink(missing_ok=True)


def _publish_parts(
    project: Any, update: dict[str, torch.Tensor], training: Any, trials: int
) -> dict[str, float]:
    """Where a warm publish goes, and what no code change can remove while blobs are SHA-256-addressed files:
    hashing and writing the new weights and momentum (the floor)."""
    from engine import codecs

    current = project.current_version()
    weights, state = training._owned(version=current)
    pieces = codecs.encode_parts(weights)
    step_update: dict[str, torch.Tensor] = {}
    target = Path(tempfile.mkdtemp(prefix="crowdtrain-bench-write-"))

    def step() -> None:
        from engine import optim

        optim.server_step_(
            weights, step_update, state, averaging=False, lr=0.1, momentum=0.9, weight_decay=0.0
        )

    def sha256() -> None:
        digest = hashlib.sha256()
        for piece in pieces:
            digest.update(piece)

    def write() -> None:
        path = target / "weights"
        with open(path, "wb") as handle:
            for piece in pieces:
                handle.write(piece)
        path.unlink()

    def both() -> None:  # as blob_put does: written by a thread of its own while this one hashes
        writer = threading.Thread(target=write)
        writer.start()
        sha256()
        writer.join()

    parts = {
        "optimizer step (in place)": cpu(
            step, trials, setup=lambda: step_update.update({k: v.clone() for k, v in update.items()})
        ),
        "encode weights (header; the tensors are not copied)": cpu(
            lambda: codecs.encode_parts(weights), trials
        ),
        "SHA-256 of the weights (45 MB)": cpu(sha256, trials),
        "write the weights file (45 MB)": cpu(write, trials),
    }
    together = cpu(both, trials)
    os.rmdir(target)
    result = {k: round(v.median, 2) for k, v in parts.items()}
    result["SHA-256 and write in two threads: CPU"] = round(together.median, 2)
    result["SHA-256 and write in two threads: elapsed"] = round(together.wall_median, 2)
    result["SHA-256 of the weights: elapsed (the floor of a publish: one hash chain)"] = round(
        parts["SHA-256 of the weights (45 MB)"].wall_median, 2
    )
    result["main's floor: SHA-256 + write of weights and momentum (CPU)"] = round(
        2 * (parts["SHA-256 of the weights (45 MB)"].median + parts["write the weights file (45 MB)"].median),
        2,
    )
    return result


def _step_difference(project: Any, update: dict[str, torch.Tensor], training: Any) -> float:
    """The in-place step against the old one on the same weights, momentum and update (should be 0)."""
    current = project.current_version()
    weights = before.decode(before.read(current.weights_blob))[0]
    state = before.decode(before.read(current.optimizer_state))[0]
    expected, _ = before.sgd_step(weights, update, state, lr=project.learning_rate, momentum=project.momentum)
    training._published.clear()
    got, _, _ = training._step_stored(
        project=project, version=current, update={k: v.clone() for k, v in update.items()}, buffers={}
    )
    return max(float((expected[n] - got[n]).abs().max()) for n in update)


def _recovery_difference(project: Any) -> float:
    """The momentum a step recomputes when its version's was never stored (the publishing process died)
    against the stored one: float32 rounding, relative to the buffer's largest value."""
    from engine import optim

    current = project.current_version()
    previous = project.versions.get(number=current.number - 1)
    true = before.decode(before.read(current.optimizer_state))[0]
    recovered = optim.momentum_recovered(
        before.decode(before.read(previous.weights_blob))[0],
        before.decode(before.read(current.weights_blob))[0],
        before.decode(before.read(previous.optimizer_state))[0],
        [key.split(":", 1)[1] for key in true],
        nesterov=False,
        lr=project.learning_rate,
        momentum=project.momentum,
    )
    return max(
        float((true[k] - recovered[k]).abs().max() / true[k].abs().max().clamp_min(1e-30)) for k in true
    )


def measure(*, trials: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    project = resnet_project()
    updates = per_update(project, trials)
    versions = publish(project, trials)
    after, before_total = updates["total_ms"]["after"], updates["total_ms"]["before"]
    warm = versions["publish_wall_ms"][WARM]
    return {
        "config": {
            "model": "ResNet-18 preset (CIFAR variant)",
            "parameters": updates["parameters"],
            "update": f"int8, blocks of 256, {updates['update_bytes']:,} bytes",
            "trials": trials,
            "torch_threads": torch.get_num_threads(),
            "cpus": os.cpu_count(),
            "load_average_1min": {"start": round(load_before[0], 2), "end": round(os.getloadavg()[0], 2)},
        },
        "targets": TARGETS,
        "per_update": updates,
        "publish": versions,
        "met": {
            "per_update_ms": after <= TARGETS["per_update_ms"],
            "publish_ms": warm <= TARGETS["publish_ms"],
        },
        "speedup": {
            "per_update": round(before_total / after, 1),
            "publish_warm_elapsed": round(versions["publish_wall_ms"]["before"] / warm, 1),
            "publish_warm_elapsed_vs_main": round(versions["publish_wall_ms"]["main (warm)"] / warm, 1),
        },
    }


def table(result: dict[str, Any]) -> str:
    config, updates, versions, met = result["config"], result["per_update"], result["publish"], result["met"]
    lines = [f"Aggregation: {config['model']}, {config['update']} (CPU ms, median of {config['trials']})"]
    rows: list[tuple[str, float]] = []
    for side in ("before", "after"):
        rows += [(f"{side:<7}{step}", ms) for step, ms in updates["steps_ms"][side].items()]
        rows.append((f"{side:<7}per update, total", updates["total_ms"][side]))
    rows.append((f"{'':<7}(once per round: allocating the sums)", updates["round_sums_allocation_ms"]))
    lines += [f"  {label:<68}{ms:>9.2f}" for label, ms in rows]
    lines.append(f"  {'publish (CPU ms, elapsed ms)':<68}{'CPU':>9}{'elapsed':>9}")
    for step, ms in versions["publish_ms"].items():
        lines.append(f"  {step:<68}{ms:>9.2f}{versions['publish_wall_ms'][step]:>9.2f}")
    stored = versions["momentum_stored_after_ms"]
    label = "  momentum stored after the announcement (off the path)"
    lines.append(f"  {label:<68}{stored['cpu']:>9.2f}{stored['elapsed']:>9.2f}")
    lines += [f"  {'  ' + step:<68}{ms:>9.2f}" for step, ms in versions["parts_ms"].items()]
    verdict = {True: "met", False: "NOT met"}
    lines.append(
        f"  targets: per update <= {TARGETS['per_update_ms']:g} ms {verdict[met['per_update_ms']]}, "
        f"publish <= {TARGETS['publish_ms']:g} ms elapsed {verdict[met['publish_ms']]}"
    )
    return "\n".join(lines)
