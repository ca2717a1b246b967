"""train.js slice gradients (mini-batches + codecs), optim.js against torch.optim, and tensor leaks."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
import torch

from tests.browser import graphs
from tests.browser.parity import b64, max_errors, record, split_batch, tensors_from_b64

pytestmark = pytest.mark.browser
codecs = pytest.importorskip("engine.codecs")
runtime = pytest.importorskip("engine.runtime")

BACKENDS = ["webgl", "cpu", "webgpu"]  # webgpu: SwiftShader via --enable-unsafe-webgpu


def use(page: Any, backend: str) -> None:
    assert page.evaluate("b => harness.useBackend(b)", backend) == backend


@pytest.mark.parametrize("backend", BACKENDS)
def test_slice_gradients_equal_full_batch(harness: Any, backend: str) -> None:
    """20 samples in mini-batches of 7 weighted by size == one batch of 20 (no batch_norm here)."""
    g = graphs.mlp()
    weights, batch = graphs.init_weights(g, 11), graphs.batch_for(g, 20, 12)
    inputs, targets = split_batch(g, batch)
    want = runtime.compute_gradients(g, weights, inputs, targets)
    use(harness, backend)
    args = [json.dumps(g), b64(weights), b64(batch), 7]
    for codec, tolerance in (("fp32", 1e-4), ("fp16", 1e-3), ("int8", 1.5e-2)):
        r = harness.evaluate("([g, w, b, n, c]) => harness.sliceGradients(g, w, b, n, c)", [*args, codec])
        got, meta = codecs.decode(base64.b64decode(r["grads"]))
        errors = max_errors(got, want.grads)
        record("slice", {"backend": backend, "codec": codec, "grad_max": max(errors.values())})
        assert meta["codec"] == codec and r["samples"] == 20
        assert abs(r["loss"] - want.loss) <= 1e-4 * abs(want.loss)
        assert max(errors.values()) <= tolerance, (codec, errors)


def torch_train(
    g: graphs.Graph, weights: graphs.Tensors, batch: graphs.Tensors, steps: int, make_opt: Any
) -> graphs.Tensors:
    module = runtime.GraphModule(g)
    module.load_state(weights)
    module.train()
    opt = make_opt(module.parameters())
    inputs, targets = split_batch(g, batch)
    for _ in range(steps):
        opt.zero_grad()
        module.loss(module({**targets, **inputs}), targets).backward()
        opt.step()
    state = module.state()
    return {p["name"]: state[p["name"]] for p in g["params"]}


OPTIMIZERS = {
    "sgd": (
        "SGD",
        {"lr": 0.1, "momentum": 0.9, "dampening": 0.1, "weight_decay": 1e-3, "nesterov": False},
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, dampening=0.1, weight_decay=1e-3),
    ),
    "nesterov": (
        "SGD",
        {"lr": 0.05, "momentum": 0.8, "nesterov": True},
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.8, nesterov=True),
    ),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizer_matches_torch(harness: Any, backend: str, name: str) -> None:
    g = graphs.regression()
    weights, batch = graphs.init_weights(g, 21), graphs.batch_for(g, 16, 22)
    js_name, options, make_opt = OPTIMIZERS[name]
    use(harness, backend)
    r = harness.evaluate(
        "([g, w, b, n, o, opts]) => harness.trainSteps(g, w, b, n, o, opts)",
        [json.dumps(g), b64(weights), b64(batch), 10, js_name, options],
    )
    errors = max_errors(tensors_from_b64(r["params"]), torch_train(g, weights, batch, 10, make_opt))
    record("optim", {"backend": backend, "optimizer": name, "param_max": max(errors.values())})
    assert max(errors.values()) <= 1e-4, errors


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_tensor_count_flat_over_200_steps(harness: Any, backend: str) -> None:
    """Gradients + batch-norm updates + SGD with momentum for 200 steps: no tensor may leak per step, and
    the bytes held on the device (GPU textures or buffers on webgl and webgpu, all tensor bytes on cpu) must
    stay flat too."""
    g = graphs.cnn()
    use(harness, backend)
    before = harness.evaluate("() => tf.memory().numTensors")
    has_gpu = harness.evaluate("() => typeof tf.memory().numBytesInGPU === 'number'")
    r = harness.evaluate(
        "([g, w, b]) => harness.trainSteps(g, w, b, 200, 'SGD', {lr: 0.01, momentum: 0.9})",
        [json.dumps(g), b64(graphs.init_weights(g, 31)), b64(graphs.batch_for(g, 4, 32))],
    )
    after = harness.evaluate("() => tf.memory().numTensors")
    counts, device_bytes = r["counts"], r["deviceBytes"]
    record(
        "memory",
        {
            "backend": backend,
            "first": counts[0],
            "last": counts[-1],
            "before": before,
            "after": after,
            "loss_first": r["losses"][0],
            "loss_last": r["losses"][-1],
            "device_bytes_first": device_bytes[0],
            "device_bytes_last": device_bytes[-1],
        },
    )
    assert has_gpu == (backend != "cpu")  # so webgl and webgpu really are measured in GPU bytes
    assert len(set(counts)) == 1, counts  # momentum buffers exist from step 1, so flat from the start
    # No texture/buffer grows either. The first step is warm-up: on webgl its momentum buffers start as
    # textures of the first gradients' packing (148 bytes fewer here), replaced by their own from step 2.
    assert len(set(device_bytes[1:])) == 1, sorted(set(device_bytes))
    assert after == before  # model and optimizer disposed completely
    assert r["losses"][-1] < r["losses"][0]  # and it really trained
