"""Pipeline mode in the browser: stage work units (frontend/static/engine/pipeline.js) against the server's
(engine/pipeline.py), on WebGL and on the CPU backend, and activation blobs (activations.js) against
engine/activations.py.

Each unit gets the server's own inputs (the stage's input activation, its output gradient or the targets),
as a spot check would, and is judged as test_parity judges whole graphs: against float64, within 1e-4 or
twice float32 PyTorch's own error where the unit is ill-conditioned. Dropout is set to p=0 there: TF.js and
torch draw different masks from a seed (docs/pipeline.md); the browser's own recomputation of its masks is
tested separately.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import Tensor

from engine import activations
from engine.graph import Graph, graph_to_json, load_graph
from engine.partition import MemoryModel, Partition, Stage, partition, partition_at
from engine.pipeline import stage_backward, stage_forward, stage_weights
from engine.runtime import GraphModule
from tests.browser.parity import (
    _float64_inputs,
    b64,
    buffer_floor,
    gradient_floor,
    max_errors,
    record,
    rel_error,
    tensors_from_b64,
)
from tests.engine.test_activations import hostile_blobs, samples
from tests.engine.test_partition import batch, model

pytestmark = pytest.mark.browser

TOLERANCE = 1e-4  # test_parity's
BACKENDS = ["webgl", "cpu"]
MICRO_BATCH = 4
LOSS_SCALE = 0.25  # the last stage's share of the batch's loss denominator (loss_scales)
CASES = [
    ("mlp", 2),
    ("cnn", 3),
    ("gpt", 2),  # token ids into the first stage
    ("nanogpt", 3),  # tied weights: the embedding table is read in the first and the last stage
    ("mobilenet_like", 3),  # batch norm: forward units report running statistics
    ("transformer_classifier", 2),  # ignore_index
    ("lstm_classifier", 2),  # class weights
]
Tensors = dict[str, Tensor]


def without_dropout(graph: Graph) -> Graph:
    g = graph.to_dict()
    for node in g["nodes"]:
        if node["op"] in ("dropout", "dropout2d", "drop_path"):
            node["attrs"]["p"] = 0.0
    return load_graph(g)


# ---------------------------------------------------------------- the server's units of one micro-batch


@dataclass
class Micro:
    """One micro-batch through the server's units: each stage's input feed and output gradient."""

    feeds: list[Tensors]  # stage 0: the graph's inputs by name; then {input name: activation}
    output_grads: list[Tensor | None]  # None for the last stage, and where no gradient flows back
    targets: Tensors


def server_micro(p: Partition, weights: Tensors, x: Tensor, y: Tensor) -> Micro:
    feeds: list[Tensors] = [{"x": x}]
    for stage, following in zip(p.stages[:-1], p.stages[1:], strict=True):
        out = stage_forward(stage, weights, feeds[-1]).output
        feeds.append({following.graph.inputs[0].name: out})
    grads: list[Tensor | None] = [None] * len(p.stages)
    last = stage_backward(p.stages[-1], weights, feeds[-1], targets={"y": y}, loss_scale=LOSS_SCALE)
    grad = last.input_grad
    for k in range(len(p.stages) - 2, -1, -1):
        if grad is None:
            break
        grads[k] = grad
        grad = stage_backward(p.stages[k], weights, feeds[k], grad).input_grad
    return Micro(feeds, grads, {"y": y})


def float64_unit(
    stage: Stage, weights: Tensors, feed: Tensors, output_grad: Tensor | None, targets: Tensors
) -> dict[str, Any]:
    """The unit in float64: output, trained buffers, param and input gradients, loss (no backward pass
    for a stage that is not the last when ``output_grad`` is None: a forward unit)."""
    module = GraphModule(stage.graph).double()
    module.load_state({k: v.double() for k, v in stage_weights(stage, weights).items()})
    module.train()
    feed = {k: v.double() if v.is_floating_point() else v for k, v in feed.items()}
    name = stage.graph.inputs[0].name
    if stage.needs_input_grad:
        feed[name] = feed[name].clone().requires_grad_(True)
    loss = None
    with _float64_inputs():
        out = module({**targets, **feed})
        if stage.last:
            loss = module.loss(out, targets)
            (loss * LOSS_SCALE).backward()
        elif out.requires_grad and output_grad is not None:
            out.backward(output_grad.double())
    state = module.state()
    grad = feed[name].grad if stage.needs_input_grad else None
    return {
        "output": out.detach().float(),
        "buffers": {b: state[b].float() for b in stage.graph.trained_buffers()},
        "grads": {k: v.float() for k, v in module.grads().items()},
        "input": None if grad is None else grad.float(),
        "loss": None if loss is None else float(loss.detach()),
    }


# ---------------------------------------------------------------- the browser's units


def use_backend(page: Any, backend: str) -> None:
    assert page.evaluate("b => harness.useBackend(b)", backend) == backend


def browser_forward(
    page: Any, stage: Stage, weights: Tensors, feed: Tensors, seed: int | None
) -> dict[str, Any]:
    r = page.evaluate(
        "([g, w, x, s]) => pipelineHarness.stageForward(g, w, x, s, true)",
        [graph_to_json(stage.graph).decode(), b64(stage_weights(stage, weights)), b64(feed), seed],
    )
    return {**r, "output": tensors_from_b64(r["output"])["output"], "buffers": tensors_from_b64(r["buffers"])}


def browser_backward(
    page: Any,
    stage: Stage,
    weights: Tensors,
    feed: Tensors,
    output_grad: Tensor | None,
    targets: Tensors | None,
    seed: int | None = None,
) -> dict[str, Any]:
    grad = None if output_grad is None else b64({"grad": output_grad})
    r = page.evaluate(
        "([g, w, x, dy, y, c, s, i]) => pipelineHarness.stageBackward(g, w, x, dy, y, c, s, true, i)",
        [
            graph_to_json(stage.graph).decode(),
            b64(stage_weights(stage, weights)),
            b64(feed),
            grad,
            None if targets is None else b64(targets),
            LOSS_SCALE,
            seed,
            stage.needs_input_grad,
        ],
    )
    r["grads"] = tensors_from_b64(r["grads"]) if stage.graph.params else {}
    r["buffers"] = tensors_from_b64(r["buffers"])
    r["input"] = None if r["inputGrad"] is None else tensors_from_b64(r["inputGrad"])["input"]
    return r


# ---------------------------------------------------------------- judging


def off_float64(got: Tensors, want: Tensors, exact: Tensors, floor: float) -> tuple[float, float, list[str]]:
    """(worst error against float64, float32 PyTorch's own worst, the tensors over max(1e-4, twice it))."""
    if not exact:
        return 0.0, 0.0, []
    vs_exact, own = max_errors(got, exact, floor), max_errors(want, exact, floor)
    bound = max(TOLERANCE, 2 * max(own.values()))
    return max(vs_exact.values()), max(own.values()), [k for k, v in vs_exact.items() if not v <= bound]


def check_forward(name: str, backend: str, stage: Stage, weights: Tensors, feed: Tensors, page: Any) -> float:
    got = browser_forward(page, stage, weights, feed, seed=11)
    want = stage_forward(stage, weights, feed)
    exact = float64_unit(stage, weights, feed, None, {})
    assert got["leaked"] == 0 and got["moved"] == 0, (got["leaked"], got["moved"])
    assert set(got["buffers"]) == set(want.buffers)
    out = off_float64({"o": got["output"]}, {"o": want.output}, {"o": exact["output"]}, 1e-12)
    buffers = off_float64(got["buffers"], want.buffers, exact["buffers"], buffer_floor(exact["buffers"]))
    where = {"graph": name, "stage": stage.index, "backend": backend}
    record("pipeline_forward", {**where, "output": out[0], "buffers": buffers[0], "torch32": out[1]})
    assert not out[2] and not buffers[2], f"forward unit {where}: {out[2]} {buffers[2]}"
    return max(out[0], buffers[0])


def check_backward(name: str, backend: str, stage: Stage, weights: Tensors, micro: Micro, page: Any) -> float:
    feed, grad = micro.feeds[stage.index], micro.output_grads[stage.index]
    targets = micro.targets if stage.last else None
    got = browser_backward(page, stage, weights, feed, grad, targets)
    scale = LOSS_SCALE if stage.last else 1.0
    want = stage_backward(stage, weights, feed, grad, targets=targets, loss_scale=scale)
    exact = float64_unit(stage, weights, feed, grad, targets or {})
    assert got["leaked"] == 0 and got["moved"] == 0, (got["leaked"], got["moved"])
    grads = off_float64(got["grads"], want.grads, exact["grads"], gradient_floor(exact["grads"]))
    # The trained buffers after the recomputed forward, which the server applies (all or none reported).
    assert set(got["buffers"]) == set(want.buffers) == set(stage.graph.trained_buffers())
    buffers = off_float64(got["buffers"], want.buffers, exact["buffers"], buffer_floor(exact["buffers"]))
    inputs: tuple[float, float, list[str]] = (0.0, 0.0, [])
    assert (got["input"] is None) == (want.input_grad is None) == (not stage.needs_input_grad)
    if want.input_grad is not None:
        inputs = off_float64({"in": got["input"]}, {"in": want.input_grad}, {"in": exact["input"]}, 1e-12)
    loss = 0.0 if want.loss is None else abs(got["loss"] - exact["loss"]) / abs(exact["loss"])
    where = {"graph": name, "stage": stage.index, "backend": backend}
    errors = {"grads": grads[0], "input": inputs[0], "buffers": buffers[0], "loss": loss}
    record("pipeline_backward", {**where, **errors, "torch32": max(grads[1], inputs[1], buffers[1])})
    assert loss <= TOLERANCE and not grads[2] + inputs[2] + buffers[2], (
        f"backward unit {where}: {grads[2]} {inputs[2]} {buffers[2]} {loss}"
    )
    return max(errors.values())


def check_units(page: Any, backend: str, name: str, stages: int) -> None:
    graph, weights = without_dropout(model(name)[0]), model(name)[1]
    p = partition(graph, stages, MemoryModel(micro_batch=MICRO_BATCH))
    x, y = batch(name, MICRO_BATCH)
    micro = server_micro(p, weights, x, y)
    use_backend(page, backend)
    worst = 0.0
    for stage in p.stages:
        if not stage.last:
            worst = max(worst, check_forward(name, backend, stage, weights, micro.feeds[stage.index], page))
        if stage.last or micro.output_grads[stage.index] is not None:
            worst = max(worst, check_backward(name, backend, stage, weights, micro, page))
    print(f"{name} S={stages} {backend}: worst unit error against float64 {worst:.1e}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("name", "stages"), CASES)
def test_stage_units_match_the_server(harness: Any, backend: str, name: str, stages: int) -> None:
    check_units(harness, backend, name, stages)


def test_units_refuse_what_their_stage_does_not_take(harness: Any) -> None:
    graph, weights = model("mlp")
    p = partition(graph, 2)
    first, last = p.stages
    x, y = batch("mlp", 2)
    out = stage_forward(first, weights, {"x": x}).output
    use_backend(harness, "cpu")
    cases: list[tuple[Stage, Tensors, Tensor | None, Tensors | None, str]] = [
        (first, {"x": x}, None, None, "one of them"),  # neither an output gradient nor targets
        (last, {last.graph.inputs[0].name: out}, torch.ones_like(out), {"y": y}, "one of them"),
        (first, {"x": x}, torch.ones(2, 3), None, "dy has shape"),
        (first, {"x": x[:, :, :5]}, torch.ones_like(out), None, "the stage expects"),
    ]
    for stage, feed, grad, targets, message in cases:
        with pytest.raises(Exception, match=message):
            browser_backward(harness, stage, weights, feed, grad, targets)
    assert harness.evaluate("() => tf.memory().numTensors") < 10_000  # nothing piles up after errors


# ---------------------------------------------------------------- dropout recomputed from the seed


def test_backward_unit_recomputes_the_forward_units_dropout_masks(harness: Any) -> None:
    """The CNN preset cut right after its dropout (p=0.25): the forward unit's output shows the mask it drew;
    the backward unit with the same seed must backpropagate through exactly that mask (checked against the
    server's unit on the same graph without dropout, fed the masked output gradient), on both backends."""
    graph, weights = model("cnn")
    p = partition_at(graph, ["dropout"])
    first = p.stages[0]
    dropout = first.graph.nodes[-1]
    rate = dropout.attrs["p"]
    assert dropout.op == "dropout" and 0 < rate < 1
    plain = partition_at(without_dropout(graph), ["dropout"]).stages[0]
    x, _ = batch("cnn", MICRO_BATCH)
    dy = torch.randn(
        stage_forward(plain, weights, x).output.shape, generator=torch.Generator().manual_seed(3)
    )
    masks = {}
    for backend in BACKENDS:
        use_backend(harness, backend)
        out = browser_forward(harness, first, weights, {"x": x}, seed=5)["output"]
        again = browser_forward(harness, first, weights, {"x": x}, seed=5)["output"]
        other = browser_forward(harness, first, weights, {"x": x}, seed=6)["output"]
        masks[backend] = out != 0
        assert torch.equal(masks[backend], again != 0) and not torch.equal(masks[backend], other != 0)
        keep = masks[backend].float() / (1 - rate)
        clean = stage_forward(plain, weights, x).output
        assert rel_error(out, clean * keep) <= TOLERANCE  # the output is the clean one, masked
        want = stage_backward(plain, weights, x, dy * keep).grads
        same = browser_backward(harness, first, weights, {"x": x}, dy, None, seed=5)["grads"]
        other_seed = browser_backward(harness, first, weights, {"x": x}, dy, None, seed=6)["grads"]
        floor = gradient_floor(want)
        assert max(max_errors(same, want, floor).values()) <= TOLERANCE, backend
        assert max(max_errors(other_seed, want, floor).values()) > 0.1, backend  # other masks
    # alea draws the masks on the CPU whatever the backend: the same seed, the same masks
    assert torch.equal(masks["webgl"], masks["cpu"])


# ---------------------------------------------------------------- a micro-batch through every stage


def whole_graph_grads(graph: Graph, weights: Tensors, x: Tensor, y: Tensor) -> tuple[float, Tensors]:
    module = GraphModule(graph)
    module.load_state(weights)
    module.train()
    loss = module.loss(module({"x": x, "y": y}), {"y": y})
    loss.backward()
    return float(loss.detach()), module.grads()


def check_blob(blob: bytes, recomputed: Tensor, codec: str, kind: str) -> activations.Agreement:
    """A blob the browser sent on, against the server's recomputation of the unit: the spot-check rule."""
    sent = activations.decode(blob, list(recomputed.shape), kind=kind, codec=codec)
    return activations.spot_check(sent, recomputed, codec, kind=kind, tolerance=TOLERANCE)


@dataclass
class Replay:
    loss: float
    grads: Tensors
    checks: list[activations.Agreement]  # one per blob the browser sent


def server_replay(
    p: Partition, weights: Tensors, x: Tensor, y: Tensor, sent: dict[str, list[bytes]], codec: str
) -> Replay:
    """The server re-runs every unit of the browser's chain from the blobs the browser sent, as spot checks
    do, and checks each blob a unit sent on against its own recomputation."""
    stages, checks = p.stages, []
    feeds: list[Tensors] = [{"x": x}]
    for k, (stage, following) in enumerate(zip(stages[:-1], stages[1:], strict=True)):
        out = stage_forward(stage, weights, feeds[k]).output
        checks.append(check_blob(sent["activation"][k], out, codec, "activation"))
        activation = activations.decode(sent["activation"][k], list(out.shape))
        feeds.append({following.graph.inputs[0].name: activation})
    grads: Tensors = {}
    blobs, output_grad, loss = iter(sent["gradient"]), None, 0.0
    for stage in reversed(stages):
        if stage.last:
            unit = stage_backward(stage, weights, feeds[stage.index], targets={"y": y})
            loss = float(unit.loss or 0.0)
        elif output_grad is None:
            break
        else:
            unit = stage_backward(stage, weights, feeds[stage.index], output_grad)
        for n, g in unit.grads.items():  # tied weights: each stage's share adds up
            grads[n] = grads[n] + g if n in grads else g
        if unit.input_grad is None:
            break
        blob = next(blobs)
        checks.append(check_blob(blob, unit.input_grad, codec, "gradient"))
        output_grad = activations.decode(blob, list(unit.input_grad.shape), kind="gradient")
    return Replay(loss, grads, checks)


def l2_error(got: Tensors, want: Tensors) -> float:
    """|got - want| / |want| over all the gradients together."""
    diff = sum(float((got[n].double() - w.double()).pow(2).sum()) for n, w in want.items())
    return (diff / sum(float(w.double().pow(2).sum()) for w in want.values())) ** 0.5


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("codec", activations.CODECS)
@pytest.mark.parametrize(("name", "stages"), [("cnn", 3), ("nanogpt", 3)])
def test_a_micro_batch_through_every_stage_with_compressed_activations(
    harness: Any, backend: str, codec: str, name: str, stages: int
) -> None:
    """Forward units, the last stage's unit and the backward units all in the page, activations and
    gradients sent through activations.js under ``codec``. The server replays every unit from the blobs
    the browser sent: each blob the browser sent on passes the spot check against the server's
    recomputation, and the summed gradients are the server's. With fp32 they are the unsplit graph's.
    Compression's cost against the unsplit graph is recorded: beyond the blobs' budgets where a perturbed
    activation flips a ReLU or a max-pool choice downstream (the CNN's first cut sits before both)."""
    graph, weights = without_dropout(model(name)[0]), model(name)[1]
    p = partition(graph, stages, MemoryModel(micro_batch=MICRO_BATCH))
    x, y = batch(name, MICRO_BATCH)
    use_backend(harness, backend)
    r = harness.evaluate(
        "([g, n, w, b, s, c]) => pipelineHarness.chain(g, n, w, b, s, c, 256)",
        [
            [graph_to_json(s.graph).decode() for s in p.stages],
            [s.needs_input_grad for s in p.stages],
            b64(weights),
            b64({"x": x, "y": y}),
            [100 + k for k in range(stages)],
            codec,
        ],
    )
    sent = {kind: [base64.b64decode(blob) for blob in blobs] for kind, blobs in r["sent"].items()}
    got, replay = tensors_from_b64(r["grads"]), server_replay(p, weights, x, y, sent, codec)
    loss, whole = whole_graph_grads(graph, weights, x, y)
    errors = {
        "vs_server": max(max_errors(got, replay.grads, gradient_floor(replay.grads)).values()),
        "vs_whole": max(max_errors(got, whole, gradient_floor(whole)).values()),
        "l2_vs_whole": l2_error(got, whole),
        "budget_used": max((c.worst for c in replay.checks if not c.outliers), default=0.0),
        "tie_outliers": max(c.share for c in replay.checks),
    }
    wire = {kind: sum(len(blob) for blob in blobs) for kind, blobs in sent.items()}
    where = {"graph": name, "stages": stages, "codec": codec, "backend": backend}
    record("pipeline_chain", {**where, **errors, **wire})
    print(f"{where}: {errors}, bytes {wire}")
    assert all(c.accepted for c in replay.checks), replay.checks
    assert backend != "cpu" or not any(c.outliers for c in replay.checks)  # ties broken as torch does
    assert errors["vs_server"] <= TOLERANCE and abs(r["loss"] - replay.loss) <= TOLERANCE * abs(replay.loss)
    if codec == "fp32":
        assert abs(r["loss"] - loss) <= TOLERANCE * abs(loss) and errors["vs_whole"] <= TOLERANCE
    assert len(sent["activation"]) == len(sent["gradient"]) == stages - 1


# ---------------------------------------------------------------- activation blobs across the boundary


def browser_encode(page: Any, t: Tensor, codec: str, kind: str, block: int) -> bytes:
    args = [b64({"x": t}), codec, kind, block]
    return base64.b64decode(
        page.evaluate("([t, c, k, b]) => pipelineHarness.activationsEncode(t, c, k, b)", args)
    )


def browser_decode(page: Any, data: bytes, shape: list[int], kind: str, codec: str | None = None) -> Any:
    args = [base64.b64encode(data).decode(), shape, kind, codec]
    r = page.evaluate("([d, s, k, c]) => pipelineHarness.activationsDecode(d, s, k, c)", args)
    return r["error"] if "error" in r else tensors_from_b64(r["tensor"])["x"]


@pytest.mark.parametrize(("codec", "block"), [("fp32", 256), ("fp16", 256), ("int8", 256), ("int8", 7)])
def test_browser_blobs_are_the_python_bytes(harness: Any, codec: str, block: int) -> None:
    for kind in activations.KINDS:
        for name, t in samples().items():
            data = browser_encode(harness, t, codec, kind, block)
            assert data == activations.encode(t, codec, kind=kind, block_size=block), (name, kind)
            decoded = browser_decode(harness, data, list(t.shape), kind, codec)
            want = activations.decode(data, list(t.shape), kind=kind, codec=codec)
            assert torch.equal(decoded.reshape(want.shape), want), (name, kind)  # bit for bit
            error = (want.double() - t.double()).abs()
            assert bool((error <= activations.error_bound(t, codec, block)).all()), (name, kind)


def test_hostile_blobs_are_refused_on_both_sides(harness: Any) -> None:
    for what, (data, shape, kind) in hostile_blobs().items():
        with pytest.raises(activations.ActivationError):
            activations.decode(data, shape, kind=kind)
            pytest.fail(f"python accepted {what}")
        refused = browser_decode(harness, data, shape, kind)
        assert isinstance(refused, str), f"the browser accepted {what}"
    data = activations.encode(torch.ones(2, 2), "fp16")
    assert isinstance(browser_decode(harness, data, [2, 2], "activation", "int8"), str)  # not the codec asked


def test_digest_is_the_content_address(harness: Any) -> None:
    data = activations.encode(torch.randn(3, 9), "int8")
    got = harness.evaluate("s => pipelineHarness.digest(s)", base64.b64encode(data).decode())
    assert got == activations.digest(data)
