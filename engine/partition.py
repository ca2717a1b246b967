"""Cutting a model graph into pipeline stages (issue 14's pipeline mode; docs/pipeline.md).

A stage boundary may fall between two consecutive nodes only where exactly one tensor is live across it:
one batched float32 activation, and no graph input or other activation (so residual blocks, whose skip is
live beside the branch, stay whole). The graph format has one output per graph, which is why a boundary
carries exactly one tensor. Among those cut points the partition whose GPipe step of M micro-batches is
shortest (gpipe_makespan: the bottleneck stage, plus the fill and drain of the stages before it), or
without M the smallest bottleneck (most FLOPs per sample of one stage's units), is chosen by dynamic
programming, subject to every stage fitting a per-device memory budget. Each stage is an ordinary graph
that load_graph accepts and both interpreters run; engine/pipeline.py executes its forward and backward
work units on the server.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from engine.flops import feeds_output, node_flops  # the one FLOP formula per op, shared with flops.py
from engine.graph import (
    TRAIN_MEMORY_FACTOR,
    Graph,
    Loss,
    Node,
    TensorSpec,
    infer_shapes,
    load_graph,
    meta_values,  # shapes and dtypes of every value, as load_graph infers them
)

MAX_STAGES = 64
MAX_MICRO_BATCH = 1 << 20
MAX_MICRO_BATCHES = 1 << 12  # per step (GPipe's M)
MAX_OPTIMIZER_SLOTS = 4
VALUE_BYTES = 4  # params, buffers, gradients and optimizer state are float32
OUTPUT_GRAD = "stage:output_grad"  # a non-last stage's target: the gradient of its output
_BATCHES = (2, 3)  # shapes are inferred at two batch sizes: the difference is what one sample adds

Matrix = npt.NDArray[np.float64]
Vector = npt.NDArray[np.float64]
Starts = npt.NDArray[np.intp]
Mask = npt.NDArray[np.bool_]
Combine = Callable[[Matrix, Matrix], Matrix]


class PartitionError(ValueError):
    """The graph cannot be partitioned as asked; the message says why and what would fit."""


@dataclass(frozen=True)
class MemoryModel:
    """What one device must hold while it runs a stage's backward unit (its peak).

    ``optimizer_slots`` is optimizer state in copies of the parameters: 1 for SGD with momentum (the
    default), 2 for Adam, 0 when the server applies the optimizer and volunteers keep none.
    ``budget_bytes`` None means no bound.
    """

    budget_bytes: int | None = None
    micro_batch: int = 1
    optimizer_slots: int = 1

    def __post_init__(self) -> None:
        _check_int("micro_batch", self.micro_batch, 1, MAX_MICRO_BATCH)
        _check_int("optimizer_slots", self.optimizer_slots, 0, MAX_OPTIMIZER_SLOTS)
        if self.budget_bytes is not None:
            _check_int("budget_bytes", self.budget_bytes, 1, 1 << 62)

    def describe(self) -> str:
        return f"micro-batch {self.micro_batch}, optimizer state {self.optimizer_slots}x parameters"


@dataclass(frozen=True)
class StageMemory:
    """Bytes one device holds for a stage: weights (params and buffers), a gradient per param, optimizer
    state, and the activations of one micro-batch in the backward unit (every node's output of the
    recomputed forward and a gradient for each, the stage input, and the output gradient or targets)."""

    weights: int
    gradients: int
    optimizer: int
    activations: int

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations

    def describe(self) -> str:
        return (
            f"{mib(self.total)}: weights {mib(self.weights)}, gradients {mib(self.gradients)}, "
            f"optimizer state {mib(self.optimizer)}, activations {mib(self.activations)}"
        )


@dataclass(frozen=True)
class Cut:
    after: int  # index of the last node before the cut
    value: str  # the one tensor that crosses it (a node's output)


@dataclass(frozen=True)
class Stage:
    index: int
    graph: Graph
    nodes: range  # indices of its nodes in the whole graph
    forward_flops: int  # per sample, the forward pass
    backward_flops: int  # per sample, the backward pass alone
    needs_input_grad: bool  # something before this stage has parameters: send d(loss)/d(input) back
    last: bool
    memory: StageMemory

    @property
    def input(self) -> str | None:
        """The activation this stage receives (None for the first stage, which reads the graph inputs)."""
        return None if self.index == 0 else self.graph.inputs[0].name

    @property
    def forward_unit_flops(self) -> int:
        """Per sample. The last stage has no forward unit: its one unit runs forward, loss and backward."""
        return 0 if self.last else self.forward_flops

    @property
    def backward_unit_flops(self) -> int:
        """Per sample: the forward recomputed, then the backward pass."""
        return self.forward_flops + self.backward_flops

    @property
    def step_flops(self) -> int:
        """Per sample of one training step: what balancing equalises and credit pays."""
        return self.forward_unit_flops + self.backward_unit_flops


@dataclass(frozen=True)
class Partition:
    graph: Graph
    stages: tuple[Stage, ...]
    memory_model: MemoryModel

    @property
    def cuts(self) -> tuple[str, ...]:
        """The tensor crossing each boundary, in order."""
        return tuple(s.graph.output for s in self.stages[:-1])

    @property
    def balance(self) -> float:
        """Largest stage's step FLOPs over the mean (1.0 is perfect balance)."""
        work = [s.step_flops for s in self.stages]
        return max(work) / max(sum(work) / len(work), 1e-300)

    def makespan(self, micro_batches: int) -> float:
        """FLOPs per sample on the critical path of a GPipe step (gpipe_makespan): the step's time with
        one worker per stage, all of one speed, and no link time."""
        *first, last = self.stages
        forward, backward = [s.forward_unit_flops for s in first], [s.backward_unit_flops for s in first]
        return gpipe_makespan(forward, backward, last.backward_unit_flops, micro_batches)

    def bubble(self, micro_batches: int) -> float:
        """The share of the workers' time idle in that step: GPipe's (S-1)/(M+S-1) for equal stages."""
        busy = micro_batches * sum(s.step_flops for s in self.stages)
        return 1.0 - busy / max(len(self.stages) * self.makespan(micro_batches), 1e-300)

    @property
    def shared_params(self) -> tuple[str, ...]:
        """Params in more than one stage (tied weights): their gradient is the sum of the stages'."""
        counts: dict[str, int] = {}
        for stage in self.stages:
            for p in stage.graph.params:
                counts[p.name] = counts.get(p.name, 0) + 1
        return tuple(name for name, n in counts.items() if n > 1)


def mib(size: float) -> str:
    return f"{size / 2**20:.2f} MiB"


def _check_int(name: str, value: object, low: int, high: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise PartitionError(f"{name} must be an integer from {low} to {high}, got {value!r}")


# ---------------------------------------------------------------- analysis of the whole graph


@dataclass(frozen=True)
class _Analysis:
    graph: Graph
    cuts: tuple[Cut, ...]
    values: dict[int, dict[str, torch.Tensor]]  # meta values at each of _BATCHES
    flops: tuple[tuple[int, int], ...]  # (forward, backward) per node, per sample
    needs_grad: dict[str, bool]
    uses: dict[str, list[int]]  # node indices reading each name (the loss reads at len(nodes))

    def bytes_at(self, name: str, batch: int) -> int:
        """Bytes of a value for ``batch`` samples (exact for values linear in the batch size)."""
        small, large = (_nbytes(self.values[b][name]) for b in _BATCHES)
        return small + (large - small) * (batch - _BATCHES[0])


def _nbytes(t: torch.Tensor) -> int:
    return math.prod(t.shape) * t.element_size()


def _uses(graph: Graph) -> dict[str, list[int]]:
    uses: dict[str, list[int]] = {}
    for i, node in enumerate(graph.nodes):
        for name in dict.fromkeys(n for n in node.inputs if n is not None):
            uses.setdefault(name, []).append(i)
    for name in graph.loss.inputs:
        uses.setdefault(name, []).append(len(graph.nodes))
    return uses


def _node_costs(
    graph: Graph, shapes: dict[str, tuple[int, ...]]
) -> tuple[list[tuple[int, int]], dict[str, bool]]:
    """Per node (forward, backward) FLOPs per sample, counted exactly as engine/flops.py counts them."""
    grad: dict[str, bool] = {p.name: True for p in graph.params}
    live = feeds_output(graph)
    costs = []
    for node in graph.nodes:
        needs = [n is not None and grad.get(n, False) for n in node.inputs]
        grad[node.name] = any(needs)
        forward, backward = node_flops(node, shapes, needs)
        costs.append((forward, backward if grad[node.name] and node.name in live else 0))
    return costs, grad


def _analyse(graph: Graph) -> _Analysis:
    values = {b: meta_values(graph, b) for b in _BATCHES}
    costs, grad = _node_costs(graph, infer_shapes(graph, batch=1))  # FLOPs are linear in the batch
    uses = _uses(graph)
    cuts = tuple(_cut_points(graph, uses, values))
    return _Analysis(graph, cuts, values, tuple(costs), grad, uses)


# ---------------------------------------------------------------- cut points


def _live_sets(graph: Graph, uses: Mapping[str, list[int]]) -> Iterable[tuple[int, frozenset[str]]]:
    """(c, activations live across the cut after node c): graph inputs and node outputs still to be read."""
    ends: dict[int, list[str]] = {}
    live = {s.name for s in graph.inputs if s.name in uses}
    for name in live:
        ends.setdefault(uses[name][-1], []).append(name)
    for c, node in enumerate(graph.nodes[:-1]):
        if node.name in uses and uses[node.name][-1] > c:
            live.add(node.name)
            ends.setdefault(uses[node.name][-1], []).append(node.name)
        live.difference_update(ends.get(c, ()))
        yield c, frozenset(live)


def _state_spans(graph: Graph, uses: Mapping[str, list[int]]) -> list[tuple[int, int]]:
    """Node spans that no cut may split: from a node reading targets to the end (targets reach the last
    stage only) and across each trained buffer's readers (one stage owns its updates)."""
    spans = [(uses[b][0], uses[b][-1]) for b in graph.trained_buffers() if b in uses]
    readers = [i for t in graph.targets for i in uses.get(t.name, []) if i < len(graph.nodes)]
    if readers:
        spans.append((min(readers), len(graph.nodes)))
    return spans


def _crossable(name: str, values: Mapping[int, Mapping[str, torch.Tensor]]) -> bool:
    """A float32 tensor whose first dimension is the batch: what a stage input and output may be."""
    small, large = (values[b][name] for b in _BATCHES)
    return (
        small.dtype == torch.float32
        and small.dim() > 0
        and (small.shape[0], large.shape[0]) == _BATCHES
        and small.shape[1:] == large.shape[1:]
    )


def _cut_points(
    graph: Graph, uses: Mapping[str, list[int]], values: Mapping[int, Mapping[str, torch.Tensor]]
) -> list[Cut]:
    nodes = {n.name for n in graph.nodes}
    spans = _state_spans(graph, uses)
    cuts: list[Cut] = []
    for c, live in _live_sets(graph, uses):
        if len(live) != 1 or any(lo <= c < hi for lo, hi in spans):
            continue
        (value,) = live
        # The same value live across two cuts: the nodes between feed nothing later; keep the first.
        repeated = bool(cuts) and cuts[-1].value == value
        if value in nodes and value != graph.output and _crossable(value, values) and not repeated:
            cuts.append(Cut(c, value))
    return cuts


def cut_points(graph: Graph) -> tuple[Cut, ...]:
    """Every place the graph may be cut: exactly one batched float32 activation crosses it."""
    return _analyse(graph).cuts


# ---------------------------------------------------------------- costs of unit ranges

# The nodes between two consecutive cut points form a unit; a stage is a run of units [i..j]. Every
# per-range quantity is an n x n matrix indexed [i, j] (meaningful for i <= j).


@dataclass(frozen=True)
class _Ranges:
    units: tuple[range, ...]
    forward: Matrix  # FLOPs per sample of the forward pass of units i..j (a non-last stage's forward unit)
    unit: Matrix  # the same plus the backward pass: a backward unit, or the last stage's one unit
    work: Matrix  # step FLOPs per sample of a stage made of units i..j (forward + unit; unit if last)
    params: Matrix  # bytes
    buffers: Matrix
    activations: Matrix  # bytes for one micro-batch
    crossing: npt.NDArray[np.float64]  # [i] = bytes of one sample's activation entering unit i (0 for i=0)

    def memory(self, i: int, j: int, slots: int) -> StageMemory:
        params = int(self.params[i, j])
        weights = params + int(self.buffers[i, j])
        return StageMemory(weights, params, slots * params, int(self.activations[i, j]))

    def total_memory(self, slots: int) -> Matrix:
        return self.params * (2 + slots) + self.buffers + self.activations


def _units(a: _Analysis) -> tuple[range, ...]:
    bounds = [-1, *(c.after for c in a.cuts), len(a.graph.nodes) - 1]
    return tuple(range(lo + 1, hi + 1) for lo, hi in zip(bounds, bounds[1:], strict=False))


def _span_sums(per_unit: Iterable[float]) -> Matrix:
    """[i, j] = sum of per_unit[i..j]."""
    prefix = np.concatenate([[0.0], np.cumsum(np.asarray(list(per_unit), dtype=np.float64))])
    sums: Matrix = prefix[None, 1:] - prefix[:-1, None]
    return sums


def _names_bytes(a: _Analysis, units: tuple[range, ...], names: Iterable[str]) -> Matrix:
    """[i, j] = bytes of the named tensors that some node of units i..j reads, each counted once."""
    n = len(units)
    unit_of = {node: u for u, r in enumerate(units) for node in r}
    unit_of[len(a.graph.nodes)] = n - 1  # the loss belongs to the last stage
    local, out = np.zeros(n), np.zeros((n, n))
    for name in names:
        size = a.bytes_at(name, 1)  # params and buffers do not grow with the batch
        touched = sorted({unit_of[i] for i in a.uses.get(name, [])})
        if len(touched) == 1:
            local[touched[0]] += size
        elif touched:  # tied weights: counted in a range if any of its units reads them
            latest = np.maximum.accumulate(np.isin(np.arange(n), touched) * (np.arange(n) + 1)) - 1
            out += size * (latest[None, :] >= np.arange(n)[:, None])
    return out + _span_sums(local)


def _passes(a: _Analysis, units: tuple[range, ...]) -> tuple[Matrix, Matrix, Matrix]:
    """(forward, unit, work) matrices: see _Ranges."""
    forward = _span_sums(sum(a.flops[k][0] for k in r) for r in units)
    unit = forward + _span_sums(sum(a.flops[k][1] for k in r) for r in units)
    work = forward + unit  # forward unit, then the backward unit recomputing the forward
    work[:, -1] = unit[:, -1]  # the last stage's one unit runs each pass once
    return forward, unit, work


def _activations(a: _Analysis, units: tuple[range, ...], batch: int) -> Matrix:
    nodes = _span_sums(sum(a.bytes_at(a.graph.nodes[k].name, batch) for k in r) for r in units)
    crossing = [a.bytes_at(c.value, batch) for c in a.cuts]
    inputs = sum(a.bytes_at(s.name, batch) for s in a.graph.inputs)
    targets = sum(a.bytes_at(s.name, batch) for s in a.graph.targets)
    into = np.asarray([inputs, *crossing], dtype=np.float64)  # what stage i receives
    out_of = np.asarray([*crossing, targets], dtype=np.float64)  # output gradient, or the targets
    return TRAIN_MEMORY_FACTOR * nodes + into[:, None] + out_of[None, :]


def _ranges(a: _Analysis, batch: int) -> _Ranges:
    units = _units(a)
    params = _names_bytes(a, units, (p.name for p in a.graph.params))
    buffers = _names_bytes(a, units, (b.name for b in a.graph.buffers))
    crossing = np.asarray([0, *(a.bytes_at(c.value, 1) for c in a.cuts)], dtype=np.float64)
    return _Ranges(units, *_passes(a, units), params, buffers, _activations(a, units, batch), crossing)


# ---------------------------------------------------------------- choosing the cuts


def _split(
    cost: Matrix, allowed: Mask, stages: int, combine: Combine = np.maximum
) -> tuple[Vector, list[Starts]]:
    """Split units 0..j into ``stages`` runs over allowed runs [i..j], minimising the runs' costs combined
    by ``combine`` (np.maximum: the bottleneck; np.add: a total), for every last unit j at once.

    Returns the optimum for each j (inf where no split is allowed) and what _backtrack reads.
    """
    n = cost.shape[0]
    valid = np.triu(allowed)
    best: Vector = np.where(valid[0], cost[0], np.inf)
    starts: list[Starts] = []
    for _ in range(1, stages):
        before = np.concatenate([[np.inf], best[:-1]])  # best split of units 0..i-1
        candidate = np.where(valid, combine(before[:, None], cost), np.inf)
        starts.append(np.argmin(candidate, axis=0))
        best = candidate[starts[-1], np.arange(n)]
    return best, starts


def _backtrack(starts: list[Starts], end: int) -> list[int]:
    """The first unit of each stage of the split of units 0..end that _split found."""
    firsts = [0]
    for chosen in reversed(starts):
        firsts.insert(1, int(chosen[end]))
        end = firsts[1] - 1
    return firsts


def _fewest_bytes(ranges: _Ranges, allowed: Mask, stages: int, end: int) -> list[int]:
    """Among the allowed splits of units 0..end, the one sending the fewest bytes across stage boundaries
    (volunteers' links are the scarce resource)."""
    crossing = np.broadcast_to(ranges.crossing[:, None], ranges.work.shape)
    return _backtrack(_split(crossing, allowed, stages, np.add)[1], end)


def _cheapest_split(ranges: _Ranges, allowed: Mask, stages: int) -> tuple[float, list[int]]:
    """The smallest bottleneck (the most step FLOPs of one stage); among the splits that reach it, the
    fewest bytes."""
    worst = float(_split(ranges.work, allowed, stages)[0][-1])
    if worst == math.inf:
        return worst, []
    return worst, _fewest_bytes(ranges, allowed & (ranges.work <= worst), stages, len(ranges.units) - 1)


def gpipe_makespan(
    forward: Sequence[float], backward: Sequence[float], last: float, micro_batches: int
) -> float:
    """How long a GPipe step of ``micro_batches`` takes with one worker per stage and no link time:
    non-last stage k's forward unit takes ``forward[k]`` and its backward unit ``backward[k]``, the last
    stage's one unit ``last``. The makespan of engine/schedule.py's timetable, as its longest path: with
    N the non-last stages' total, F and B their longest forward and backward unit,

        N + max(last + (M-1) max(F, B, last), (M-1)(F + B))

    (micro-batches queue on the slowest unit; or a non-last stage runs all its forwards before its first
    backward). Equal stages of step time T give (M+S-1) T, GPipe's; a heavy stage costs more the later
    it sits, since every stage before it fills and drains around it.
    """
    before, f, b = sum(forward) + sum(backward), max(forward, default=0.0), max(backward, default=0.0)
    m = micro_batches - 1
    return before + max(last + m * max(f, b, last), m * (f + b))


def _fastest_split(
    ranges: _Ranges, allowed: Mask, stages: int, micro_batches: int
) -> tuple[float, list[int]]:
    """The split whose GPipe step of ``micro_batches`` is shortest (gpipe_makespan); among those, the
    fewest bytes.

    The makespan depends on where the last stage starts (unit i) and, of the non-last stages before it,
    only on their longest forward and backward units. For each i, the units before it are split three
    ways (the smallest bottleneck of step FLOPs, of backward units, of forward units) and the best is kept.
    """
    n = len(ranges.units)
    last_ok = allowed[:, n - 1]
    if stages == 1:
        return (micro_batches * ranges.unit[0, n - 1] if last_ok[0] else math.inf), [0]
    options: dict[tuple[int, float, float], float] = {}  # (last start, F, B) -> makespan
    for cost in (ranges.work, ranges.unit, ranges.forward):
        best, starts = _split(cost, allowed, stages - 1)
        for i in range(stages - 1, n):
            if last_ok[i] and best[i - 1] < math.inf:
                spans = _spans(_backtrack(starts, i - 1), i)
                forward = [float(ranges.forward[s]) for s in spans]
                backward = [float(ranges.unit[s]) for s in spans]
                time = gpipe_makespan(forward, backward, float(ranges.unit[i, n - 1]), micro_batches)
                options[(i, max(forward), max(backward))] = time
    if not options:
        return math.inf, []
    fastest = min(options.values())
    ties = [key for key, t in options.items() if t <= fastest * (1 + 1e-12)]
    splits = [_fewest_bytes_before(ranges, allowed, stages, *key) for key in ties]
    return fastest, min(splits, key=lambda firsts: sum(ranges.crossing[firsts]))


def _spans(firsts: list[int], end: int) -> list[tuple[int, int]]:
    """[i, j] of each stage of a split of units 0..end - 1 starting at ``firsts``."""
    return [(i, j - 1) for i, j in zip(firsts, [*firsts[1:], end], strict=True)]


def _fewest_bytes_before(
    ranges: _Ranges, allowed: Mask, stages: int, last: int, f: float, b: float
) -> list[int]:
    """The last stage from unit ``last``; before it, the fewest bytes among splits whose forward and
    backward units take at most ``f`` and ``b`` (so the makespan is no longer)."""
    fits = allowed & (ranges.forward <= f) & (ranges.unit <= b)
    return [*_fewest_bytes(ranges, fits, stages - 1, last - 1), last]


def _refuse_memory(a: _Analysis, ranges: _Ranges, stages: int, model: MemoryModel) -> PartitionError:
    budget = model.budget_bytes or 0
    return PartitionError(
        f"graph '{a.graph.name}' does not fit {stages} stage(s) within the per-device memory budget of "
        f"{mib(budget)} ({model.describe()}): the best split's largest stage needs "
        f"{_leanest_split(ranges, stages, model.optimizer_slots).describe()}. "
        + _largest_piece(a, ranges, model.optimizer_slots, budget)
    )


def _leanest_split(ranges: _Ranges, stages: int, slots: int) -> StageMemory:
    """The memory of the largest stage of the split that needs the least memory per device."""
    total, n = ranges.total_memory(slots), len(ranges.units)
    firsts = _backtrack(_split(total, np.ones_like(total, dtype=bool), stages)[1], n - 1)
    return ranges.memory(*max(_spans(firsts, n), key=lambda s: total[s]), slots)


def _largest_piece(a: _Analysis, ranges: _Ranges, slots: int, budget: int) -> str:
    total = ranges.total_memory(slots)
    piece = max(range(len(ranges.units)), key=lambda u: total[u, u])
    nodes = ranges.units[piece]
    advice = (
        "no number of stages can fit it; a smaller micro-batch or less optimizer state may"
        if total[piece, piece] > budget
        else "more stages or a smaller micro-batch may fit"
    )
    return (
        f"The largest piece that cannot be cut (nodes '{a.graph.nodes[nodes[0]].name}' to "
        f"'{a.graph.nodes[nodes[-1]].name}') alone needs {mib(total[piece, piece])}; {advice}."
    )


def _check_stages(a: _Analysis, stages: int) -> None:
    _check_int("stages", stages, 1, MAX_STAGES)
    if stages > len(a.cuts) + 1:
        places = ", ".join(f"'{c.value}'" for c in a.cuts[:10]) + (", ..." if len(a.cuts) > 10 else "")
        raise PartitionError(
            f"graph '{a.graph.name}' can be cut in only {len(a.cuts)} place(s) where exactly one tensor "
            f"crosses ({places or 'none'}), so into at most {len(a.cuts) + 1} stage(s), not {stages}"
        )


def partition(
    graph: Graph, stages: int, memory: MemoryModel | None = None, *, micro_batches: int | None = None
) -> Partition:
    """Cut ``graph`` into ``stages`` stages that fit ``memory``'s budget: those whose GPipe step of
    ``micro_batches`` is shortest (gpipe_makespan), or without it the smallest bottleneck (the limit of
    many micro-batches); then the fewest bytes crossing."""
    model = memory or MemoryModel()
    a = _analyse(graph)
    _check_stages(a, stages)
    if micro_batches is not None:
        _check_int("micro_batches", micro_batches, 1, MAX_MICRO_BATCHES)
    ranges = _ranges(a, model.micro_batch)
    budget = math.inf if model.budget_bytes is None else model.budget_bytes
    allowed = ranges.total_memory(model.optimizer_slots) <= budget
    if micro_batches is None:
        worst, firsts = _cheapest_split(ranges, allowed, stages)
    else:
        worst, firsts = _fastest_split(ranges, allowed, stages, micro_batches)
    if worst == math.inf:
        raise _refuse_memory(a, ranges, stages, model)
    return _build(a, ranges, firsts, model)


def partition_at(graph: Graph, cuts: Sequence[str], memory: MemoryModel | None = None) -> Partition:
    """Cut ``graph`` where the named tensors cross (cut points, in graph order), within the budget."""
    model = memory or MemoryModel()
    a = _analyse(graph)
    _check_int("stages", len(cuts) + 1, 1, MAX_STAGES)
    index = {c.value: k for k, c in enumerate(a.cuts)}
    unknown = [c for c in cuts if c not in index]
    if unknown:
        raise PartitionError(f"{unknown[:5]} are not cut points of graph '{graph.name}' (see cut_points)")
    order = [index[c] for c in cuts]
    if order != sorted(set(order)):
        raise PartitionError(f"cuts must be distinct and in graph order, got {list(cuts)}")
    ranges = _ranges(a, model.micro_batch)
    built = _build(a, ranges, [0, *(k + 1 for k in order)], model)
    _check_budget(built)
    return built


def _check_budget(built: Partition) -> None:
    budget = built.memory_model.budget_bytes
    for stage in built.stages:
        if budget is not None and stage.memory.total > budget:
            raise PartitionError(
                f"stage {stage.index} of graph '{built.graph.name}' exceeds the per-device memory budget "
                f"of {mib(budget)} ({built.memory_model.describe()}): it needs {stage.memory.describe()}"
            )


def _build(a: _Analysis, ranges: _Ranges, firsts: list[int], model: MemoryModel) -> Partition:
    bounds = zip(firsts, [*firsts[1:], len(ranges.units)], strict=True)
    stages = tuple(_stage(a, ranges, k, i, j - 1, model) for k, (i, j) in enumerate(bounds))
    return Partition(a.graph, stages, model)


# ---------------------------------------------------------------- stage graphs


def _stage(a: _Analysis, ranges: _Ranges, k: int, i: int, j: int, model: MemoryModel) -> Stage:
    nodes = range(ranges.units[i][0], ranges.units[j][-1] + 1)
    last = j == len(ranges.units) - 1
    into = None if i == 0 else a.cuts[i - 1].value
    out = a.graph.output if last else a.cuts[j].value
    return Stage(
        index=k,
        graph=_stage_graph(a, nodes, into, out, k),
        nodes=nodes,
        forward_flops=sum(a.flops[n][0] for n in nodes),
        backward_flops=sum(a.flops[n][1] for n in nodes),
        needs_input_grad=into is not None and a.needs_grad[into],
        last=last,
        memory=ranges.memory(i, j, model.optimizer_slots),
    )


def _spec(a: _Analysis, name: str) -> TensorSpec:
    return TensorSpec(name, (-1, *a.values[_BATCHES[0]][name].shape[1:]), "float32")


def _read(nodes: Iterable[Node], loss: Loss | None) -> set[str]:
    names = {n for node in nodes for n in node.inputs if n is not None}
    return names | set(loss.inputs if loss else ())


def _unique(name: str, taken: set[str]) -> str:
    candidate, k = name, 0
    while candidate in taken:
        k += 1
        candidate = f"{name}_{k}"
    return candidate


def _stage_graph(a: _Analysis, nodes: range, into: str | None, out: str, k: int) -> Graph:
    """The nodes as a graph: its input (the graph's inputs for the first stage), the params and buffers
    they read, and either the whole graph's targets and loss (last stage) or, as target, the gradient of
    its output with an ``mse`` placeholder loss, which the format requires and no executor evaluates."""
    g, picked = a.graph, [a.graph.nodes[n] for n in nodes]
    last = out == g.output
    loss = g.loss if last else None
    read = _read(picked, loss)
    inputs = g.inputs if into is None else (_spec(a, into),)
    names = {s.name for s in (*g.inputs, *g.targets, *g.params, *g.buffers)}
    grad = _unique(OUTPUT_GRAD, names | {n.name for n in g.nodes})
    targets = g.targets if last else (TensorSpec(grad, _spec(a, out).shape),)
    suffix = f".stage{k}"
    staged = Graph(
        name=g.name[: 200 - len(suffix)] + suffix,
        inputs=tuple(inputs),
        targets=tuple(targets),
        params=tuple(p for p in g.params if p.name in read),
        buffers=tuple(b for b in g.buffers if b.name in read),
        nodes=tuple(picked),
        output=out,
        loss=loss or Loss("mse", (out, grad), {}),
    )
    return load_graph(staged.to_dict())  # every stage is validated like any uploaded graph
