"""Pipeline partitioning (engine/partition.py) and stage work units (engine/pipeline.py).

Chaining the stages' forward and backward units must reproduce the unsplit graph run by the same
interpreter in one autograd pass: output, loss and every parameter gradient within 1e-6 (float32; the
interpreter has no float64 mode), and micro-batch gradients scaled by loss_scales must sum to the whole
batch's. The balance table is printed with ``-s``.
"""

from __future__ import annotations

import itertools
import math
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor
from torch.utils.flop_counter import FlopCounterMode

from engine import ops
from engine.export import export_module
from engine.flops import forward_flops_per_sample, train_flops_per_sample
from engine.graph import Graph, graph_to_json, load_graph
from engine.partition import (
    MAX_MICRO_BATCHES,
    MAX_STAGES,
    MemoryModel,
    Partition,
    PartitionError,
    Stage,
    cut_points,
    gpipe_makespan,
    partition,
    partition_at,
)
from engine.pipeline import StageUnitError, loss_scales, stage_backward, stage_forward, stage_weights
from engine.presets import GPT, PRESETS
from engine.runtime import GraphModule
from tests.engine.conftest import exported as preset_exported
from tests.engine.conftest import preset_batch
from tests.engine.corpus import CORPUS
from tests.engine.zoo import ZOO

TOL = 1e-6
CORPUS_MODELS = [
    "nanogpt",  # tied weights: the embedding table is also the head
    "unet",
    "lstm_classifier",  # class weights
    "gru_classifier",  # label smoothing
    "transformer_classifier",  # ignore_index
    "mobilenet_like",
    "tv_resnet18",
    "tv_mobilenet_v3_small",
]
MODELS = [*PRESETS, *CORPUS_MODELS]
RANDOM_OR_BATCHED = {"batch_norm", "dropout", "dropout2d", "drop_path"}
Batch = tuple[Tensor, Tensor]


@cache
def model(name: str) -> tuple[Graph, dict[str, Tensor]]:
    if name in PRESETS:
        graph, weights = preset_exported(name)
        return load_graph(graph), weights
    spec = {**CORPUS, **ZOO}[name]
    torch.manual_seed(0)
    graph, weights = export_module(
        spec.build(), spec.input_shape, spec.input_dtype, loss=spec.loss(), name=name
    )
    return load_graph(graph), weights


def batch(name: str, size: int, seed: int = 7) -> Batch:
    if name in PRESETS:
        return preset_batch(name, size, seed)
    spec, graph = {**CORPUS, **ZOO}[name], model(name)[0]
    g = torch.Generator().manual_seed(seed)
    if spec.input_dtype == "int64":
        x = torch.randint(0, spec.vocab, (size, *spec.input_shape), generator=g)
    else:
        x = torch.randn((size, *spec.input_shape), generator=g)
    if spec.classes:
        return x, torch.randint(0, spec.classes, (size,), generator=g)
    return x, torch.randn((size, *graph.targets[0].shape[1:]), generator=g)


@cache
def stage_counts(name: str) -> list[int]:
    return [s for s in (2, 3, 4) if s <= len(cut_points(model(name)[0])) + 1]


# The three largest models (20-60 s a case on this machine) are chained at one stage count; every count is
# covered by the others, and the micro-batch sum, a property of loss scaling, by the lighter models.
HEAVY = {"resnet18", "tv_resnet18", "tv_mobilenet_v3_small"}
CASES = [(name, s) for name in MODELS for s in ((3,) if name in HEAVY else (2, 3, 4))]
LIGHT = [name for name in MODELS if name not in HEAVY]


def _skip_unless_cuttable(name: str, stages: int) -> None:
    if stages not in stage_counts(name):
        pytest.skip(f"{name} has only {len(cut_points(model(name)[0]))} cut points")


# ---------------------------------------------------------------- the unsplit reference and the chain


@contextmanager
def reseeded(starts: Mapping[int, int]) -> Iterator[None]:
    """Reseed torch's RNG before the given nodes of an unsplit run, as each stage's unit seeds its own:
    the whole graph then draws the dropout masks the stages drew."""
    calls, original = itertools.count(), ops.run_op

    def run_op(*args: Any) -> Tensor:
        seed = starts.get(next(calls))
        if seed is not None:
            torch.manual_seed(seed)
        return original(*args)

    ops.run_op = run_op  # type: ignore[assignment]
    try:
        yield
    finally:
        ops.run_op = original


def whole(
    graph: Graph,
    weights: Mapping[str, Tensor],
    x: Tensor,
    y: Tensor,
    starts: Mapping[int, int],
    training: bool,
) -> tuple[Tensor, float, dict[str, Tensor]]:
    """(output, loss, grads) of the unsplit graph: one forward, one autograd backward."""
    module = GraphModule(graph)
    module.load_state(weights)
    module.train(training)
    with reseeded(starts):
        out = module({"x": x, "y": y})
    loss = module.loss(out, {"y": y})
    loss.backward()
    return out.detach(), float(loss.detach()), module.grads()


def seeds_of(p: Partition, base: int = 100) -> list[int]:
    return [base + k for k in range(len(p.stages))]


def starts_of(p: Partition, seeds: Sequence[int]) -> dict[int, int]:
    return {stage.nodes[0]: seed for stage, seed in zip(p.stages, seeds, strict=True)}


def chain(
    p: Partition,
    weights: Mapping[str, Tensor],
    x: Tensor,
    y: Tensor,
    seeds: Sequence[int],
    training: bool = True,
    scale: float = 1.0,
) -> tuple[Tensor, float, dict[str, Tensor]]:
    """Forward units stage by stage, the last stage's unit, then backward units in reverse; gradients of a
    param in several stages (tied weights) are summed."""
    acts: list[Tensor] = [x]
    for stage, seed in zip(p.stages[:-1], seeds, strict=False):
        acts.append(stage_forward(stage, weights, acts[-1], seed=seed, training=training).output)
    last = p.stages[-1]
    out = stage_forward(last, weights, acts[-1], seed=seeds[-1], training=training).output
    result = stage_backward(
        last, weights, acts[-1], targets={"y": y}, seed=seeds[-1], training=training, loss_scale=scale
    )
    assert result.loss is not None
    grads, grad = dict(result.grads), result.input_grad
    for stage, act, seed in reversed(list(zip(p.stages[:-1], acts[:-1], seeds, strict=False))):
        if grad is None:  # nothing before this point trains: its backward units are never issued
            assert not stage.graph.params
            continue
        unit = stage_backward(stage, weights, act, grad, seed=seed, training=training)
        for name, g in unit.grads.items():
            grads[name] = grads[name] + g if name in grads else g
        grad = unit.input_grad
    return out, result.loss, grads


def max_error(ours: Tensor, ref: Tensor) -> float:
    """Largest absolute difference, relative to the reference's magnitude when that exceeds 1."""
    return float((ours - ref).abs().max()) / max(1.0, float(ref.abs().max())) if ref.numel() else 0.0


def check_same(
    got: tuple[Tensor, float, dict[str, Tensor]], ref: tuple[Tensor, float, dict[str, Tensor]]
) -> float:
    assert set(got[2]) == set(ref[2])
    errors = [max_error(got[0], ref[0]), abs(got[1] - ref[1]) / max(1.0, abs(ref[1]))]
    errors += [max_error(got[2][name], g) for name, g in ref[2].items()]
    assert max(errors) <= TOL, errors
    return max(errors)


# ---------------------------------------------------------------- equality with the unsplit graph


@pytest.mark.parametrize(("name", "stages"), CASES)
def test_chained_stages_reproduce_the_whole_graph(name: str, stages: int) -> None:
    _skip_unless_cuttable(name, stages)
    graph, weights = model(name)
    p = partition(graph, stages, MemoryModel(micro_batch=4), micro_batches=4)
    assert len(p.stages) == stages
    x, y = batch(name, 4)
    seeds = seeds_of(p)
    ref = whole(graph, weights, x, y, starts_of(p, seeds), training=True)
    error = check_same(chain(p, weights, x, y, seeds), ref)
    print(f"{name} S={stages}: max error {error:.1e}, balance {p.balance:.3f}")


@pytest.mark.parametrize("name", LIGHT)
def test_micro_batch_gradients_sum_to_the_batch_gradient(name: str) -> None:
    graph, weights = model(name)
    p = partition(graph, max(stage_counts(name)[:2] or [1]), MemoryModel(micro_batch=3))
    # Batch statistics and dropout masks depend on how the batch is split (as in GPipe): eval mode there.
    training = not RANDOM_OR_BATCHED & {n.op for n in graph.nodes}
    x, y = batch(name, 7)
    sizes = [3, 2, 2]
    parts = list(zip(x.split(sizes), y.split(sizes), strict=True))
    scales = loss_scales(graph, weights, [{"y": part_y} for _, part_y in parts])
    ref = whole(graph, weights, x, y, {}, training)
    total: dict[str, Tensor] = {}
    loss, outs = 0.0, list[Tensor]()
    for (part_x, part_y), scale in zip(parts, scales, strict=True):
        out, part_loss, grads = chain(p, weights, part_x, part_y, seeds_of(p), training, scale)
        loss, outs = loss + scale * part_loss, [*outs, out]
        total = {k: total.get(k, 0) + g for k, g in grads.items()}
    assert math.isclose(sum(scales), 1.0, rel_tol=1e-12)
    error = check_same((torch.cat(outs), loss, total), ref)
    print(f"{name}: {len(p.stages)} stages, 3 micro-batches, max error {error:.1e}")


def test_dropout_in_a_middle_stage_is_recomputed_with_the_forward_masks() -> None:
    graph, weights = model("cnn")
    p = partition_at(graph, ["dropout"])  # dropout ends the first stage, so its backward unit recomputes it
    assert p.stages[0].graph.nodes[-1].op == "dropout"
    x, y = batch("cnn", 4)
    first, again, other = (stage_forward(p.stages[0], weights, x, seed=s).output for s in (5, 5, 6))
    assert torch.equal(first, again) and not torch.equal(first, other)
    ref = whole(graph, weights, x, y, starts_of(p, [5, 9]), training=True)
    check_same(chain(p, weights, x, y, [5, 9]), ref)
    with pytest.raises(AssertionError):  # a backward unit with another seed draws other masks
        check_same(chain(p, weights, x, y, [6, 9]), ref)


def test_backward_units_report_the_trained_buffers_of_their_recomputed_forward() -> None:
    """The server applies a backward result's batch-norm statistics: a backward unit reports exactly the
    forward unit's (same input, same seed), moved off the weights it was given, in every stage with any."""
    graph, weights = model("mobilenet_like")
    p = partition(graph, 3, MemoryModel(micro_batch=4))
    x, y = batch("mobilenet_like", 4)
    act: Tensor | dict[str, Tensor] = {"x": x}
    normed = 0
    for stage in p.stages:
        forward = stage_forward(stage, weights, act, seed=3)
        grad = None if stage.last else torch.ones_like(forward.output)
        targets = {"y": y} if stage.last else None
        unit = stage_backward(stage, weights, act, grad, targets=targets, seed=3)
        assert list(unit.buffers) == stage.graph.trained_buffers() == list(forward.buffers)
        for name, value in unit.buffers.items():
            assert torch.equal(value, forward.buffers[name]), name
            assert not torch.equal(value, weights[name]), name  # the micro-batch's statistics went in
        normed += bool(unit.buffers)
        act = forward.output
    assert normed >= 2  # batch norms in more than one stage, the last included
    assert p.stages[-1].graph.trained_buffers()


# ---------------------------------------------------------------- what the partition contains


def test_balance_table(capsys: pytest.CaptureFixture[str]) -> None:
    rows = []
    for name in MODELS:
        graph = model(name)[0]
        for stages in stage_counts(name):
            p = partition(graph, stages, MemoryModel(micro_batch=8))
            assert p.balance >= 1.0
            work = [s.step_flops for s in p.stages]
            rows.append((name, stages, p.balance, work, [s.memory.total / 2**20 for s in p.stages], p.cuts))
    with capsys.disabled():
        print(
            "\nmodel                   S  max/mean  step MFLOPs/sample per stage  MiB per stage (mb 8)  cuts"
        )
        for name, stages, balance, work, mem, cuts in rows:
            flops, mib = "/".join(f"{w / 1e6:.2f}" for w in work), "/".join(f"{m:.1f}" for m in mem)
            print(f"{name:22s} {stages:2d} {balance:8.3f}  {flops:28s} {mib:21s} {cuts}")


@pytest.mark.parametrize("name", MODELS)
def test_stages_cover_the_graph_and_its_flops(name: str) -> None:
    graph = model(name)[0]
    p = partition(graph, max(stage_counts(name) or [1]))
    assert [i for s in p.stages for i in s.nodes] == list(range(len(graph.nodes)))
    assert sum(s.forward_flops for s in p.stages) == forward_flops_per_sample(graph)
    assert sum(s.forward_flops + s.backward_flops for s in p.stages) == train_flops_per_sample(graph)
    first = p.stages[0].graph  # nothing before it: flops.py counts its graph exactly as we do
    assert forward_flops_per_sample(first) == p.stages[0].forward_flops
    assert train_flops_per_sample(first) == p.stages[0].backward_unit_flops
    params = {q.name for s in p.stages for q in s.graph.params}
    assert params == {q.name for q in graph.params}


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_backward_units_cost_what_the_graph_says(stages: int) -> None:
    """FLOPs of each unit from the graph equal what torch's FlopCounterMode counts when it runs."""
    graph, weights = model("resnet18")
    p = partition(graph, stages)
    x, y = batch("resnet18", 2)
    acts, grads = [x], []
    for stage in p.stages[:-1]:
        with FlopCounterMode(display=False) as counter:
            acts.append(stage_forward(stage, weights, acts[-1]).output)
        assert counter.get_total_flops() == 2 * stage.forward_unit_flops > 0
        grads.append(torch.randn_like(acts[-1]))
    for stage, act, grad in zip(p.stages, acts, [*grads, None], strict=True):
        with FlopCounterMode(display=False) as counter:
            extra = {"targets": {"y": y}} if stage.last else {}
            stage_backward(stage, weights, act, grad, **extra)  # type: ignore[arg-type]
        assert counter.get_total_flops() == 2 * stage.backward_unit_flops


def test_stage_graphs_are_ordinary_graphs() -> None:
    graph, weights = model("gpt")
    p = partition(graph, 3)
    for stage in p.stages:
        again = load_graph(graph_to_json(stage.graph))
        assert again == stage.graph
        module = GraphModule(again)  # the plain interpreter runs it
        module.load_state(stage_weights(stage, weights))
    middle = p.stages[1].graph
    assert [s.name for s in middle.inputs] == [p.cuts[0]] and middle.output == p.cuts[1]
    assert middle.loss.op == "mse" and middle.targets[0].shape == middle.inputs[0].shape
    assert p.stages[-1].graph.loss == graph.loss and p.stages[0].graph.inputs == graph.inputs


def ancestors(graph: Graph) -> dict[str, set[str]]:
    seen: dict[str, set[str]] = {}
    for node in graph.nodes:
        seen[node.name] = {node.name}.union(*(seen.get(n, set()) for n in node.inputs if n is not None))
    return seen


@pytest.mark.parametrize("name", ["resnet18", "tv_resnet18", "mobilenet_like", "gpt"])
def test_residual_blocks_stay_whole(name: str) -> None:
    """No cut between a residual block's input (the last node both of a sum's operands descend from) and
    the sum; a cut right after each sum exists."""
    graph, up = model(name)[0], ancestors(model(name)[0])
    at = {n.name: i for i, n in enumerate(graph.nodes)}
    cuts = cut_points(graph)
    sums = [n for n in graph.nodes if n.op == "add" and all(i in at for i in n.inputs)]
    assert sums
    for node in sums:
        a, b = (up[n] for n in node.inputs if n is not None)
        if not a & b:  # not a residual sum (GPT's token + position embeddings)
            continue
        start = max(at[n] for n in a & b)
        assert not [c.value for c in cuts if start < c.after < at[node.name]], node.name
    assert {c.value for c in cuts} & {n.name for n in sums}


def test_tied_weights_are_in_both_stages_and_their_gradients_add_up() -> None:
    graph = model("nanogpt")[0]
    p = partition(graph, 2)
    assert p.shared_params == ("transformer.wte.weight",)
    assert all("transformer.wte.weight" in {q.name for q in s.graph.params} for s in p.stages)


def crossing_bytes(p: Partition) -> int:
    return sum(crossing_sizes(p.stages))


def crossing_sizes(stages: Sequence[Stage]) -> list[int]:
    """Bytes per sample entering each stage after the first."""
    return [math.prod(s.graph.inputs[0].shape[1:]) * 4 for s in stages[1:]]


Costs = list[tuple[int, int]]  # per stage: forward and backward FLOPs per sample


def splits_of_units(graph: Graph, stages: int) -> Iterator[tuple[Costs, int]]:
    """Every choice of cuts: its stages' costs, summed from the units between cut points (not from the
    code under test's dynamic programme), and the bytes crossing its boundaries."""
    units = partition_at(graph, [c.value for c in cut_points(graph)]).stages
    crossing = crossing_sizes(units)
    for chosen in itertools.combinations(range(1, len(units)), stages - 1):
        bounds = zip((0, *chosen), (*chosen, len(units)), strict=True)
        costs = [
            (sum(u.forward_flops for u in units[i:j]), sum(u.backward_flops for u in units[i:j]))
            for i, j in bounds
        ]
        yield costs, sum(crossing[k - 1] for k in chosen)


def step_flops(costs: Costs) -> list[int]:
    """Per stage: forward unit, then the backward unit recomputing it; the last stage's one unit."""
    return [f + f + b for f, b in costs[:-1]] + [sum(costs[-1])]


def makespan(costs: Costs, micro_batches: int) -> float:
    *first, (forward, backward) = costs
    return gpipe_makespan([f for f, _ in first], [f + b for f, b in first], forward + backward, micro_batches)


@pytest.mark.parametrize(("name", "stages"), [("cnn", 3), ("gpt", 3), ("resnet18", 2), ("unet", 3)])
def test_the_chosen_cuts_have_the_smallest_bottleneck_then_the_fewest_bytes(name: str, stages: int) -> None:
    graph = model(name)[0]
    best = partition(graph, stages)
    bottleneck = max(s.step_flops for s in best.stages)
    for split, sent in splits_of_units(graph, stages):
        worst = max(step_flops(split))
        assert worst >= bottleneck
        assert worst > bottleneck or sent >= crossing_bytes(best)


@pytest.mark.parametrize(
    ("name", "stages", "micro_batches"),
    [("gpt", 3, 16), ("gpt", 4, 4), ("cnn", 3, 2), ("resnet18", 3, 8), ("unet", 3, 16), ("nanogpt", 4, 1)],
)
def test_the_chosen_cuts_make_the_shortest_gpipe_step_then_the_fewest_bytes(
    name: str, stages: int, micro_batches: int
) -> None:
    graph = model(name)[0]
    best = partition(graph, stages, micro_batches=micro_batches)
    fastest = best.makespan(micro_batches)
    costs = [(s.forward_flops, s.backward_flops) for s in best.stages]
    assert fastest == pytest.approx(makespan(costs, micro_batches), rel=1e-12)
    ties = 0
    for split, sent in splits_of_units(graph, stages):
        time = makespan(split, micro_batches)
        assert time >= fastest * (1 - 1e-12), split
        if time <= fastest * (1 + 1e-12):
            ties += 1
            assert sent >= sum(crossing_sizes(best.stages))
    assert ties >= 1


def test_a_heavy_stage_goes_first_when_that_shortens_the_step() -> None:
    """An 8-block GPT in 4 stages: half blocks cannot balance non-last stages (forward + backward with
    recomputation) against the last (forward and backward once). Of the splits with the smallest
    bottleneck, the one with the light stage last fills and drains least: its step is shorter, and its
    idle share is near GPipe's (S-1)/(M+S-1), where the light stage first is 22% over it."""
    torch.manual_seed(0)
    graph = load_graph(export_module(GPT(dim=64, heads=1, layers=8), (64,), "int64", name="gpt8")[0])
    by_bottleneck, by_step = partition(graph, 4), partition(graph, 4, micro_batches=16)
    work = [s.step_flops for s in by_step.stages]
    assert max(work) == max(s.step_flops for s in by_bottleneck.stages)
    assert work[-1] < min(work[:-1])
    assert by_step.makespan(16) < 0.97 * by_bottleneck.makespan(16)
    gpipe = 3 / (16 + 3)
    assert by_bottleneck.bubble(16) > 1.2 * gpipe and by_step.bubble(16) < 1.1 * gpipe


def test_bad_micro_batch_counts_are_refused() -> None:
    for bad in (0, -1, 1.5, True, MAX_MICRO_BATCHES + 1):
        with pytest.raises(PartitionError, match="micro_batches must be an integer"):
            partition(model("gpt")[0], 2, micro_batches=bad)  # type: ignore[arg-type]


# ---------------------------------------------------------------- memory


def test_memory_counts_weights_gradients_optimizer_state_and_activations() -> None:
    graph = model("resnet18")[0]
    small, large = (partition(graph, 3, MemoryModel(micro_batch=m, optimizer_slots=2)) for m in (2, 4))
    for stage, bigger in zip(small.stages, large.stages, strict=True):
        params = sum(math.prod(q.shape) for q in stage.graph.params) * 4
        buffers = sum(math.prod(b.shape) for b in stage.graph.buffers) * 4
        assert stage.memory.weights == params + buffers
        assert stage.memory.gradients == params and stage.memory.optimizer == 2 * params
        assert bigger.memory.activations == 2 * stage.memory.activations  # linear in the micro-batch


def test_a_model_over_the_budget_is_refused_whole_and_fits_in_stages() -> None:
    graph = model("resnet18")[0]
    memory = partition(graph, 1, MemoryModel(micro_batch=8)).stages[0].memory.total
    budget = MemoryModel(budget_bytes=int(memory * 0.7), micro_batch=8)
    with pytest.raises(PartitionError, match=r"memory budget of \d+\.\d\d MiB.*more stages or a smaller"):
        partition(graph, 1, budget)
    p = partition(graph, 2, budget)
    assert all(s.memory.total <= budget.budget_bytes for s in p.stages)  # type: ignore[operator]
    with pytest.raises(PartitionError, match="exceeds the per-device memory budget"):
        partition_at(graph, [p.cuts[0]], MemoryModel(budget_bytes=2**20, micro_batch=8))


def test_an_impossible_budget_names_the_budget_and_the_largest_piece() -> None:
    graph = model("gpt")[0]
    with pytest.raises(PartitionError) as refused:
        partition(graph, 4, MemoryModel(budget_bytes=100_000, micro_batch=8))
    message = str(refused.value)
    assert "memory budget of 0.10 MiB" in message and "largest piece that cannot be cut" in message
    assert "no number of stages can fit it" in message


# ---------------------------------------------------------------- hostile input


@pytest.mark.parametrize("stages", [0, -1, True, 1.5, "2", MAX_STAGES + 1])
def test_bad_stage_counts_are_refused(stages: Any) -> None:
    with pytest.raises(PartitionError, match="stages must be an integer"):
        partition(model("mlp")[0], stages)


def test_more_stages_than_cut_points_are_refused() -> None:
    with pytest.raises(PartitionError, match=r"only 3 place\(s\).*at most 4 stage\(s\), not 5"):
        partition(model("mlp")[0], 5)


@pytest.mark.parametrize(
    "kwargs", [{"micro_batch": 0}, {"budget_bytes": 0}, {"optimizer_slots": -1}, {"micro_batch": 2.5}]
)
def test_bad_memory_models_are_refused(kwargs: dict[str, Any]) -> None:
    with pytest.raises(PartitionError, match="must be an integer"):
        MemoryModel(**kwargs)


def test_bad_fixed_cuts_are_refused() -> None:
    graph = model("cnn")[0]
    with pytest.raises(PartitionError, match="not cut points"):
        partition_at(graph, ["conv2_weight_nowhere"])
    with pytest.raises(PartitionError, match="graph order"):
        partition_at(graph, ["fc1", "conv1"])


def test_stage_units_refuse_what_does_not_fit() -> None:
    graph, weights = model("gpt")
    p = partition(graph, 2)
    first, last = p.stages
    x, y = batch("gpt", 2)
    act = stage_forward(first, weights, x).output
    with pytest.raises(ValueError, match="has shape"):
        stage_forward(last, weights, act[:, :3])
    with pytest.raises(StageUnitError, match="output gradient has shape"):
        stage_backward(first, weights, x, act[:1])
    with pytest.raises(StageUnitError, match="takes the gradient of its output"):
        stage_backward(first, weights, x, targets={"y": y})
    with pytest.raises(StageUnitError, match="takes targets"):
        stage_backward(last, weights, act, act)
    with pytest.raises(StageUnitError, match="loss_scale"):
        stage_backward(last, weights, act, targets={"y": y}, loss_scale=float("nan"))
    with pytest.raises(StageUnitError, match="seed"):
        stage_forward(first, weights, x, seed=-1)
    with pytest.raises(StageUnitError, match="missing weights"):
        stage_forward(first, {}, x)


def test_pipeline_modules_never_import_django() -> None:
    code = (
        "import sys, engine.partition, engine.pipeline\n"
        "assert not [m for m in sys.modules if m.split('.')[0] in ('django', 'projects', 'workers')]\n"
    )
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], cwd=root, check=True, timeout=120)
