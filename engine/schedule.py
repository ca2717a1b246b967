"""The GPipe step of pipeline mode (issue 14 item 3; docs/pipeline.md "The GPipe step").

A step cuts the batch into M micro-batches and runs them through the S stages of a Partition: forward
units stage by stage, the last stage's unit (forward, loss, backward), then backward units in reverse.
Units run in the order of the GPipe timetable below, on the server interpreter (engine/pipeline.py),
and every activation and activation gradient crossing a stage boundary goes through an activation codec
(engine/activations.py), as it would between volunteers. Each stage's parameter gradients are summed over
micro-batches and stages (a tied param's gradients from several stages add up) and the project's
optimizer step, engine.optim.server_step, the same one the data-parallel modes apply, makes the next
version. With fp32 activations the step is single-device training on the whole batch.

The timetable is GPipe's: every stage runs all its forward units, micro-batch by micro-batch, then all its
backward units; a unit starts once its inputs exist and a worker of its stage is free. Non-last stages
have a forward and a backward unit per micro-batch; the last stage has one unit, taking its forward and
backward time. With equal stage times its idle share (the bubble) is GPipe's (S-1)/(M+S-1).
Plain module: no Django.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from engine import activations, aggregate, optim
from engine.partition import Partition, Stage
from engine.pipeline import loss_scales, stage_backward, stage_forward

FORWARD, BACKWARD = "forward", "backward"
SEED_LIMIT = 2**53  # seeds browsers receive intact as JSON numbers (docs/pipeline.md)
Tensors = dict[str, Tensor]


class ScheduleError(ValueError):
    """A step or timetable that cannot be run as asked; the message says why."""


# ---------------------------------------------------------------- the timetable


@dataclass(frozen=True, order=True)
class Unit:
    stage: int
    micro_batch: int
    kind: str  # FORWARD or BACKWARD; the last stage's one unit is its backward unit


@dataclass(frozen=True)
class StageTimes:
    """How long a stage's passes take for one micro-batch: a non-last stage's forward unit takes
    ``forward`` and its backward unit ``backward`` (recomputation included); the last stage's one unit
    takes both."""

    forward: float
    backward: float


@dataclass(frozen=True)
class Slot:
    unit: Unit
    worker: int  # index among the stage's workers
    start: float
    end: float


@dataclass(frozen=True)
class Timetable:
    stages: int
    micro_batches: int
    workers: tuple[int, ...]  # per stage
    slots: tuple[Slot, ...] = field(repr=False)

    @property
    def makespan(self) -> float:
        return max((s.end for s in self.slots), default=0.0)

    @property
    def busy(self) -> float:
        return sum(s.end - s.start for s in self.slots)

    @property
    def bubble(self) -> float:
        """The share of the workers' time within the step spent idle."""
        capacity = sum(self.workers) * self.makespan
        return 1.0 - self.busy / capacity if capacity > 0 else 0.0


def gpipe_bubble(stages: int, micro_batches: int) -> float:
    """GPipe's bubble for equal stages: (S-1)/(M+S-1)."""
    return (stages - 1) / (micro_batches + stages - 1)


def units(stages: int, micro_batches: int) -> list[Unit]:
    """Every unit of a step in GPipe order: forwards stage by stage, the last stage, backwards in reverse."""
    _check_shape(stages, micro_batches)
    last = stages - 1
    ms = range(micro_batches)
    forwards = [Unit(k, m, FORWARD) for k in range(last) for m in ms]
    backwards = [Unit(k, m, BACKWARD) for k in range(last, -1, -1) for m in ms]
    return forwards + backwards


def dependencies(unit: Unit, stages: int) -> tuple[Unit, ...]:
    """The units whose results ``unit`` reads (activation in, or gradient of its output)."""
    k, m = unit.stage, unit.micro_batch
    if unit.kind == FORWARD:
        return () if k == 0 else (Unit(k - 1, m, FORWARD),)
    if k == stages - 1:
        return () if k == 0 else (Unit(k - 1, m, FORWARD),)
    return (Unit(k, m, FORWARD), Unit(k + 1, m, BACKWARD))


def duration(unit: Unit, times: Sequence[StageTimes]) -> float:
    t = times[unit.stage]
    if unit.kind == FORWARD:
        return t.forward
    return t.forward + t.backward if unit.stage == len(times) - 1 else t.backward


def gpipe_timetable(
    times: Sequence[StageTimes],
    micro_batches: int,
    *,
    speeds: Sequence[Sequence[float]] | None = None,
    transfer: Sequence[float] | None = None,
) -> Timetable:
    """When each unit runs. ``speeds[k]`` are the relative speeds of stage k's workers (one worker of speed
    1 by default); a unit goes to the worker of its stage that finishes it first. ``transfer[k]`` is the
    time an activation (or its gradient) takes across the boundary after stage k (0 by default)."""
    stages = len(times)
    speeds = speeds if speeds is not None else [[1.0]] * stages
    links = transfer if transfer is not None else [0.0] * max(stages - 1, 0)
    _check_timetable(times, speeds, links)
    free = [[0.0] * len(s) for s in speeds]
    placed: dict[Unit, Slot] = {}
    for unit in units(stages, micro_batches):
        ready = max((_arrival(placed[d], unit, links) for d in dependencies(unit, stages)), default=0.0)
        placed[unit] = _place(unit, ready, duration(unit, times), speeds[unit.stage], free[unit.stage])
    slots = tuple(sorted(placed.values(), key=lambda s: (s.start, s.unit.stage, s.unit)))
    return Timetable(stages, micro_batches, tuple(len(s) for s in speeds), slots)


def gpipe_ticks(stages: int, micro_batches: int) -> Timetable:
    """The timetable in clock ticks: every forward and backward pass takes one tick (the last stage's unit
    two), one worker per stage."""
    return gpipe_timetable([StageTimes(1.0, 1.0)] * stages, micro_batches)


def _arrival(dep: Slot, unit: Unit, links: Sequence[float]) -> float:
    crossing = dep.unit.stage != unit.stage
    return dep.end + (links[min(dep.unit.stage, unit.stage)] if crossing else 0.0)


def _place(unit: Unit, ready: float, work: float, speeds: Sequence[float], free: list[float]) -> Slot:
    """On the worker that finishes first (ties: the lowest index), as the server routes a micro-batch."""
    finish = [max(ready, f) + work / s for f, s in zip(free, speeds, strict=True)]
    worker = min(range(len(finish)), key=finish.__getitem__)
    start = max(ready, free[worker])
    free[worker] = finish[worker]
    return Slot(unit, worker, start, finish[worker])


def _check_shape(stages: int, micro_batches: int) -> None:
    for name, value in (("stages", stages), ("micro_batches", micro_batches)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ScheduleError(f"{name} must be a positive integer, got {value!r}")


def _check_timetable(
    times: Sequence[StageTimes], speeds: Sequence[Sequence[float]], links: Sequence[float]
) -> None:
    if len(speeds) != len(times) or len(links) != max(len(times) - 1, 0):
        raise ScheduleError("need one list of worker speeds per stage and one transfer time per boundary")
    if any(not s or min(s) <= 0 for s in speeds):
        raise ScheduleError("every stage needs at least one worker, each of positive speed")
    if any(min(t.forward, t.backward) < 0 for t in times) or any(x < 0 for x in links):
        raise ScheduleError("durations and transfer times must be non-negative")


# ---------------------------------------------------------------- the step


@dataclass(frozen=True)
class Sgd:
    """The project's optimizer settings, as engine.optim.server_step reads them in the gradient modes."""

    lr: float
    momentum: float = 0.0
    weight_decay: float = 0.0


@dataclass(frozen=True)
class StepResult:
    weights: Tensors  # the next version: stepped params, and trained buffers averaged over micro-batches
    state: Tensors  # optimizer state (momentum buffers)
    loss: float  # the whole batch's loss
    wire_bytes: int  # encoded activations and activation gradients that crossed stage boundaries


def unit_seed(step: int, micro_batch: int, stage: int) -> int:
    """One seed per (step, micro-batch, stage); a backward unit reuses its forward unit's seed."""
    digest = hashlib.blake2b(f"{step}:{micro_batch}:{stage}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % SEED_LIMIT


def split_batch(tensors: Mapping[str, Tensor], micro_batches: int) -> list[Tensors]:
    """The batch cut into ``micro_batches`` consecutive parts of near-equal size."""
    sizes = {len(t) for t in tensors.values()}
    if len(sizes) != 1:
        raise ScheduleError(f"inputs and targets must have one batch size, got {sorted(sizes)}")
    (size,) = sizes
    _check_shape(1, micro_batches)
    if micro_batches > size:
        raise ScheduleError(f"cannot cut a batch of {size} into {micro_batches} micro-batches")
    parts = {name: torch.tensor_split(t, micro_batches) for name, t in tensors.items()}
    return [{name: p[m] for name, p in parts.items()} for m in range(micro_batches)]


@dataclass
class _Run:
    """What a step's units produce, by (stage, micro-batch): the stages' inputs as received and the
    gradients of their outputs as received."""

    partition: Partition
    weights: Mapping[str, Tensor]
    step: int
    codec: str
    training: bool
    inputs: dict[tuple[int, int], Tensor | Tensors] = field(default_factory=dict)
    output_grads: dict[tuple[int, int], Tensor | None] = field(default_factory=dict)
    grads: Tensors = field(default_factory=dict)
    buffers: dict[int, list[Tensors]] = field(default_factory=dict)
    losses: list[float] = field(default_factory=list)
    wire_bytes: int = 0

    def send(self, x: Tensor, kind: str) -> Tensor:
        """``x`` as the next stage (or the previous one) decodes it."""
        blob = activations.encode(x, self.codec, kind=kind)
        self.wire_bytes += len(blob)
        return activations.decode(blob, list(x.shape), kind=kind, codec=self.codec)

    def add_grads(self, grads: Mapping[str, Tensor]) -> None:
        for name, g in grads.items():
            self.grads[name] = self.grads[name] + g if name in self.grads else g


def gpipe_step(
    partition: Partition,
    weights: Mapping[str, Tensor],
    state: Mapping[str, Tensor],
    inputs: Mapping[str, Tensor],
    targets: Mapping[str, Tensor],
    *,
    micro_batches: int,
    optimizer: Sgd,
    codec: str = "fp32",
    step: int = 0,
    training: bool = True,
) -> StepResult:
    """One training step of the whole batch (``inputs``, ``targets``) in ``micro_batches`` micro-batches."""
    if codec not in activations.CODECS:
        raise ScheduleError(f"unknown activation codec {codec!r} (one of {list(activations.CODECS)})")
    feeds, labels = split_batch(inputs, micro_batches), split_batch(targets, micro_batches)
    scales = loss_scales(partition.graph, weights, labels)
    run = _Run(partition, weights, step, codec, training)
    for m, feed in enumerate(feeds):
        run.inputs[(0, m)] = feed
    for slot in gpipe_ticks(len(partition.stages), micro_batches).slots:
        _run_unit(run, slot.unit, labels, scales)
    params, new_state = optim.server_step(
        weights,
        run.grads,
        state,
        averaging=False,
        lr=optimizer.lr,
        momentum=optimizer.momentum,
        weight_decay=optimizer.weight_decay,
    )
    sizes = [float(len(next(iter(f.values())))) for f in feeds]
    return StepResult({**params, **_mean_buffers(run, sizes)}, new_state, sum(run.losses), run.wire_bytes)


def _run_unit(run: _Run, unit: Unit, labels: Sequence[Tensors], scales: Sequence[float]) -> None:
    stage = run.partition.stages[unit.stage]
    if unit.kind == FORWARD:
        _forward(run, stage, unit.micro_batch)
    elif stage.last:
        _last(run, stage, unit.micro_batch, labels[unit.micro_batch], scales[unit.micro_batch])
    else:
        _backward(run, stage, unit.micro_batch)


def _forward(run: _Run, stage: Stage, m: int) -> None:
    seed = unit_seed(run.step, m, stage.index)
    result = stage_forward(stage, run.weights, run.inputs[(stage.index, m)], seed=seed, training=run.training)
    run.inputs[(stage.index + 1, m)] = run.send(result.output, "activation")
    if result.buffers:
        run.buffers.setdefault(stage.index, []).append(result.buffers)


def _last(run: _Run, stage: Stage, m: int, targets: Tensors, scale: float) -> None:
    seed, received = unit_seed(run.step, m, stage.index), run.inputs[(stage.index, m)]
    if stage.graph.trained_buffers():  # the unit's forward updates them; report them as forward units do
        forward = stage_forward(stage, run.weights, received, seed=seed, training=run.training)
        run.buffers.setdefault(stage.index, []).append(forward.buffers)
    result = stage_backward(
        stage, run.weights, received, targets=targets, loss_scale=scale, seed=seed, training=run.training
    )
    run.add_grads(result.grads)
    run.losses.append((result.loss or 0.0) * scale)
    _send_back(run, stage, m, result.input_grad)


def _backward(run: _Run, stage: Stage, m: int) -> None:
    grad = run.output_grads.get((stage.index, m))
    if grad is None:  # nothing up to here trains (needs_input_grad): the unit is never issued
        return
    seed = unit_seed(run.step, m, stage.index)
    result = stage_backward(
        stage, run.weights, run.inputs[(stage.index, m)], grad, seed=seed, training=run.training
    )
    run.add_grads(result.grads)
    _send_back(run, stage, m, result.input_grad)


def _send_back(run: _Run, stage: Stage, m: int, input_grad: Tensor | None) -> None:
    if stage.index > 0:
        sent = None if input_grad is None else run.send(input_grad, "gradient")
        run.output_grads[(stage.index - 1, m)] = sent


def _mean_buffers(run: _Run, sizes: Sequence[float]) -> Tensors:
    """Trained buffers (batch-norm statistics) averaged over micro-batches weighted by samples, as the
    data-parallel modes average them over work units."""
    merged: Tensors = {}
    for per_micro in run.buffers.values():
        merged.update(aggregate.weighted_mean(per_micro, sizes))
    return merged
