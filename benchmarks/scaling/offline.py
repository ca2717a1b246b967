"""The scaling benchmark's algorithms without the platform, to choose their settings.

    .venv/bin/python -m benchmarks.scaling.offline [--target 0.84]

Runs the server's math (engine.aggregate) on the volunteers' math (engine.runtime) over the Fashion-MNIST MLP,
walking the training split in order as the feeder does, and prints how many rounds each setting needs to
reach the target test accuracy (written to benchmarks/results/scaling-offline.json). A round's math does not
depend on how many volunteers share it, which is why the benchmark compares 1 to 16 volunteers on one
algorithm.
"""

from __future__ import annotations

import argparse
import io
import json
import os
from collections.abc import Callable
from dataclasses import dataclass

import django
import numpy as np
import torch

from engine import aggregate, codecs, optim
from engine.graph import Graph, load_graph
from engine.presets import export_preset
from engine.runtime import compute_gradients, evaluate, local_steps

from .config import LOCAL_MINIBATCH, RESULTS, UNITS_PER_ROUND

Tensors = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Setting:
    name: str
    unit: int  # samples per work unit
    local_lr: float  # 0: one gradient per work unit (sync_sgd)
    server_lr: float
    weights_codec: str = "fp32"


SETTINGS = [
    Setting("sync lr 0.1", 64, 0, 0.1),
    Setting("sync lr 0.2", 64, 0, 0.2),
    Setting("sync lr 0.4", 64, 0, 0.4),
    Setting("avg outer 0.7", 3000, 0.05, 0.7),
    Setting("avg outer 1.0", 3000, 0.05, 1.0),
    Setting("avg outer 1.0, int8 weights", 3000, 0.05, 1.0, "int8"),
    Setting("avg outer 0.7, 1,500-sample units", 1500, 0.05, 0.7),
]


def fashion() -> tuple[torch.Tensor, ...]:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    django.setup()  # the dataset loader lives in a Django app
    from projects.demo import fashion_npz

    data = np.load(io.BytesIO(fashion_npz()))
    return tuple(torch.from_numpy(data[key]) for key in ("x", "y", "x_test", "y_test"))


def rounds_to_target(
    setting: Setting, data: tuple[torch.Tensor, ...], target: float, limit: int
) -> list[float]:
    spec, weights = export_preset("mlp")
    graph = load_graph(json.dumps(spec).encode())
    inp, tgt = graph.inputs[0].name, graph.targets[0].name
    x, y, x_test, y_test = data
    update = volunteer_update(setting.local_lr, graph, inp, tgt)
    state: Tensors = {}
    cursor, curve = 0, list[float]()
    while len(curve) < limit and (not curve or curve[-1] < target):
        seen = codecs.decode(codecs.encode(weights, setting.weights_codec))[0]
        updates = []
        for _ in range(UNITS_PER_ROUND):
            rows = torch.arange(cursor, cursor + setting.unit) % len(x)
            cursor += setting.unit
            updates.append(update(seen, x[rows], y[rows]))
        mean = aggregate.weighted_mean(updates, [1.0] * len(updates))
        if setting.local_lr:
            weights, state = optim.outer_nesterov_step(
                weights, mean, state, lr=setting.server_lr, momentum=0.9
            )
        else:
            weights, state = optim.sgd_step(weights, mean, state, lr=setting.server_lr, momentum=0.9)
        curve.append(round(evaluate(graph, weights, {inp: x_test}, {tgt: y_test})["accuracy"], 4))
    return curve


def volunteer_update(local_lr: float, graph: Graph, inp: str, tgt: str) -> Callable[..., Tensors]:
    """Weights and a slice to a volunteer's update: a gradient (local_lr 0), else its local steps' delta."""

    def update(w: Tensors, x: torch.Tensor, y: torch.Tensor) -> Tensors:
        if not local_lr:
            return compute_gradients(graph, w, {inp: x}, {tgt: y}).grads
        return local_steps(
            graph, w, {inp: x}, {tgt: y}, batch_size=LOCAL_MINIBATCH, lr=local_lr, momentum=0.9
        ).delta

    return update


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", type=float, default=0.84)
    args = parser.parse_args(argv)
    data = fashion()
    out = {}
    for setting in SETTINGS:
        curve = rounds_to_target(setting, data, args.target, limit=400 if not setting.local_lr else 40)
        out[setting.name] = {"rounds": len(curve), "reached": curve[-1] >= args.target, "curve": curve}
        print(
            f"{setting.name:38s} {len(curve):4d} rounds to {args.target:.0%} (last {curve[-1]:.4f})",
            flush=True,
        )
    (RESULTS / "scaling-offline.json").write_text(
        json.dumps({"target": args.target, "settings": out}, indent=1)
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
