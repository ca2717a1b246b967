"""Bytes to accuracy: fp32 sync against averaging with 4-bit and top-k codecs, without the platform.

    .venv/bin/python -m benchmarks.scaling.bytes [--target 0.84] [--only NAME ...]

The offline benchmark's math (benchmarks/scaling/offline.py: engine.aggregate, engine.optim and
engine.runtime over the Fashion-MNIST MLP, the training split walked in order) with every byte counted as the
platform would send it: each of the UNITS_PER_ROUND volunteers of a round downloads the weights and uploads
its update, the actual encoded blobs (engine.codecs) measured. Volunteers keep an error-feedback residual
each (engine.codecs.ErrorFeedback, as worker.js does per project). Weights go down either whole every round
(`down="full:<codec>"`, as the platform does today: fp32, or the project's weights_codec) or as deltas
(`down="delta:<codec>"`: the first round the whole weights in `init`, then each round the difference between
the new version and the weights volunteers already hold, compressed; the server tracks what they hold, so
what a delta drops is in the next one: error feedback for the downlink). Prints a table and writes
benchmarks/results/bytes.json; the ratio is each setting's total bytes to the target over fp32 sync's, both
measured in this run.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from engine import aggregate, codecs, optim
from engine.graph import load_graph
from engine.presets import export_preset
from engine.runtime import evaluate

from .config import RESULTS, UNITS_PER_ROUND
from .offline import fashion, volunteer_update

Tensors = dict[str, torch.Tensor]
GOAL = 1 / 400


@dataclass(frozen=True)
class Setting:
    name: str
    unit: int  # samples per work unit
    local_lr: float  # 0: one gradient per work unit (sync_sgd)
    server_lr: float
    up: str  # the update codec
    down: str  # "full:<codec>" or "delta:<codec>"
    init: str = "fp32"  # delta: the first download's codec (the server starts from exactly those weights)
    up_block: int | None = None
    up_keep: int | None = None
    down_block: int | None = None
    down_keep: int | None = None
    server_momentum: float = 0.9  # 0 with server_lr 1: plain model averaging


SETTINGS = [
    Setting("fp32 sync (baseline)", 64, 0, 0.2, "fp32", "full:fp32"),
    Setting("int8 avg, int8 weights (today)", 3000, 0.05, 1.0, "int8", "full:int8"),
    # More local steps a round: 376 steps of 64 per work unit (a round is 6.4 epochs of compute).
    Setting("int4 avg 24k units, int4 deltas", 24000, 0.05, 1.0, "int4", "delta:int4", "int4"),
    Setting(
        "int4 avg 24k units, topk 1/16 deltas",
        24000,
        0.05,
        1.0,
        "int4",
        "delta:topk",
        "int4",
        down_keep=256,
    ),
    # 188 steps a work unit.
    Setting(
        "int4 avg 12k units, topk 1/16 deltas",
        12000,
        0.05,
        1.0,
        "int4",
        "delta:topk",
        "int4",
        down_keep=256,
    ),
    Setting("int4 avg 12k units, int4 deltas", 12000, 0.05, 1.0, "int4", "delta:int4", "int4"),
    Setting("int4 avg 3k units, int4 deltas", 3000, 0.05, 1.0, "int4", "delta:int4", "int4"),
    # Plain model averaging (no outer momentum, whose first step is 1.9x the mean delta).
    Setting(
        "int4 model averaging 24k units, int4 deltas",
        24000,
        0.05,
        1.0,
        "int4",
        "delta:int4",
        "int4",
        server_momentum=0.0,
    ),
    Setting(
        "topk 1/16 model averaging 24k units, int4 deltas",
        24000,
        0.05,
        1.0,
        "topk",
        "delta:int4",
        "int4",
        up_keep=256,
        server_momentum=0.0,
    ),
    Setting(
        "int4 model averaging 48k units, int4 deltas",
        48000,
        0.05,
        1.0,
        "int4",
        "delta:int4",
        "int4",
        server_momentum=0.0,
    ),
    Setting(
        "topk 1/16 avg 24k units, topk 1/16 deltas",
        24000,
        0.05,
        1.0,
        "topk",
        "delta:topk",
        "int4",
        up_keep=256,
        down_keep=256,
    ),
]


@dataclass
class Run:
    curve: list[float]
    up: int = 0
    down: int = 0
    distances: list[float] | None = None  # relative L2 distance of each sent update to the true one
    cosines: list[float] | None = None
    norm_ratios: list[float] | None = None  # |sent| / |true|


class Server:
    """The weights, and what the volunteers hold of them (the same unless deltas go down)."""

    def __init__(self, setting: Setting, weights: Tensors) -> None:
        self.kind, _, self.codec = setting.down.partition(":")
        self.setting, self.state, self.first = setting, dict[str, torch.Tensor](), True
        self.deltas = None
        if self.kind == "delta":
            self.deltas = codecs.WeightsDeltas(
                weights, self.codec, setting.init, setting.down_block, setting.down_keep
            )
            weights = {k: v.clone() for k, v in self.deltas.held.items()}  # the server starts from them
        self.weights = weights

    def download(self) -> tuple[Tensors, int]:
        """What each volunteer trains from this round, and the bytes one of them downloads."""
        if self.deltas is None:
            data = codecs.encode(self.weights, self.codec)
            return codecs.decode(data)[0], len(data)
        if self.first:
            self.first = False
            return self.deltas.held, len(self.deltas.first)
        size = len(self.deltas.delta(self.weights))
        return self.deltas.held, size

    def step(self, mean: Tensors) -> None:
        s = self.setting
        if s.local_lr:
            self.weights, self.state = optim.outer_nesterov_step(
                self.weights, mean, self.state, lr=s.server_lr, momentum=s.server_momentum
            )
        else:
            self.weights, self.state = optim.sgd_step(
                self.weights, mean, self.state, lr=s.server_lr, momentum=0.9
            )


def run(setting: Setting, data: tuple[torch.Tensor, ...], target: float, limit: int) -> Run:
    spec, weights = export_preset("mlp")
    graph = load_graph(json.dumps(spec).encode())
    inp, tgt = graph.inputs[0].name, graph.targets[0].name
    x, y, x_test, y_test = data
    compute = volunteer_update(setting.local_lr, graph, inp, tgt)
    server, result = Server(setting, weights), Run([], distances=[], cosines=[], norm_ratios=[])
    feedback = [_feedback(setting) for _ in range(UNITS_PER_ROUND)]
    cursor = 0
    while len(result.curve) < limit and (not result.curve or result.curve[-1] < target):
        seen, size = server.download()
        updates = []
        for volunteer in feedback:
            rows = torch.arange(cursor, cursor + setting.unit) % len(x)
            cursor += setting.unit
            true = compute(seen, x[rows], y[rows])
            blob = volunteer(true)
            sent = codecs.decode(blob)[0]
            _record_distance(result, true, sent)
            result.up, result.down = result.up + len(blob), result.down + size
            updates.append(sent)
        server.step(aggregate.weighted_mean(updates, [1.0] * len(updates)))
        accuracy = evaluate(graph, server.weights, {inp: x_test}, {tgt: y_test})["accuracy"]
        result.curve.append(round(accuracy, 4))
    return result


def _feedback(setting: Setting) -> Callable[[Tensors], bytes]:
    if setting.up in ("fp32", "fp16"):
        return lambda update: codecs.encode(update, setting.up)
    return codecs.ErrorFeedback(setting.up, setting.up_block, setting.up_keep).compress


def _record_distance(result: Run, true: Tensors, sent: Tensors) -> None:
    a = torch.cat([sent[k].flatten().double() for k in sorted(true)])
    b = torch.cat([true[k].flatten().double() for k in sorted(true)])
    assert result.distances is not None and result.cosines is not None and result.norm_ratios is not None
    result.norm_ratios.append(float(a.norm() / b.norm().clamp_min(1e-30)))
    result.distances.append(float((a - b).norm() / b.norm().clamp_min(1e-30)))
    result.cosines.append(float(a @ b / (a.norm() * b.norm()).clamp_min(1e-30)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", type=float, default=0.84)
    parser.add_argument("--output", default="bytes.json", help="file name in benchmarks/results/")
    parser.add_argument(
        "--only", nargs="*", help="settings whose name contains one of these (and the baseline)"
    )
    args = parser.parse_args(argv)
    data = fashion()
    chosen = [s for s in SETTINGS if s is SETTINGS[0] or not args.only or any(o in s.name for o in args.only)]
    rows: dict[str, dict[str, Any]] = {}
    print(
        f"{'setting':44s} {'rounds':>6s} {'last':>6s} {'up MB':>8s} {'down MB':>8s} {'ratio':>9s}", flush=True
    )
    for setting in chosen:
        result = run(
            setting,
            data,
            args.target,
            limit=400 if not setting.local_lr else max(4, 25 * 3000 // setting.unit),
        )
        rows[setting.name] = _row(setting, result, args.target, rows)
        r = rows[setting.name]
        print(
            f"{setting.name:44s} {len(result.curve):6d} {result.curve[-1]:6.4f} {result.up / 1e6:8.3f} "
            f"{result.down / 1e6:8.3f} {r['ratio_to_fp32_sync']:9.5f}",
            flush=True,
        )
        # After every setting: a run cut short keeps what it measured.
        (RESULTS / args.output).write_text(json.dumps(_report(args.target, rows), indent=1))
    return 0


def _row(setting: Setting, result: Run, target: float, rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    total = result.up + result.down
    baseline = rows[SETTINGS[0].name]["bytes_total"] if rows else total
    distances, cosines = result.distances or [0.0], result.cosines or [1.0]
    return {
        "setting": asdict(setting),
        "rounds": len(result.curve),
        "reached": result.curve[-1] >= target,
        "bytes_up": result.up,
        "bytes_down": result.down,
        "bytes_total": total,
        "ratio_to_fp32_sync": total / baseline,
        "sent_vs_true": {
            "distance_median": sorted(distances)[len(distances) // 2],
            "distance_max": max(distances),
            "cosine_min": min(cosines),
            "norm_ratio_min": min(result.norm_ratios or [1.0]),
            "norm_ratio_max": max(result.norm_ratios or [1.0]),
        },
        "curve": result.curve,
    }


def _report(target: float, rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    reached = {name: row["ratio_to_fp32_sync"] for name, row in rows.items() if row["reached"]}
    best = min(reached, key=reached.__getitem__) if reached else ""
    ratio = reached.get(best, math.nan)
    return {
        "target": target,
        "units_per_round": UNITS_PER_ROUND,
        "goal_ratio": GOAL,
        "best": {"setting": best or None, "ratio": ratio, "meets_goal": ratio <= GOAL},
        "settings": rows,
    }


if __name__ == "__main__":
    raise SystemExit(main())
