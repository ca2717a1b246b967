"""train.js localSteps (task `local_steps`, docs/protocol.md "Tasks") against engine.runtime.local_steps,
the PyTorch reference the server's spot checks recompute: the delta, the loss and the buffers."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest

from tests.browser import graphs
from tests.browser.parity import b64, float64_local_steps, max_errors, record, split_batch
from tests.browser.test_parity import preset

pytestmark = pytest.mark.browser
codecs = pytest.importorskip("engine.codecs")
runtime = pytest.importorskip("engine.runtime")

TOLERANCE = 1e-4
BACKENDS = ["webgl", "cpu"]
SAMPLES, BATCH, LR, MOMENTUM = 28, 8, 0.05, 0.9  # batches of 8, 8, 8, 4: the ragged last one counts too


def case(name: str) -> tuple[graphs.Graph, graphs.Tensors]:
    if name == "hand:cnn":  # batch norm: buffers travel with the delta
        g = graphs.cnn()
        return g, graphs.init_weights(g, 5)
    if name == "hand:odd":  # odd widths: WebGL's packed textures (graphs.odd)
        g = graphs.odd()
        return g, graphs.init_weights(g, 5)
    if name == "hand:head":  # an odd class count after even widths (graphs.head)
        g = graphs.head()
        return g, graphs.init_weights(g, 5)
    if name == "hand:conv_odd":  # a convolution's input gradient over 3 channels (graphs.conv_odd)
        g = graphs.conv_odd()
        return g, graphs.init_weights(g, 5)
    if name == "hand:conv1":  # a 3x3 convolution of 1 channel (graphs.conv_one_channel)
        g = graphs.conv_one_channel()
        return g, graphs.init_weights(g, 5)
    return preset(name)  # dropout off: its masks are random on both sides


# Whether a case's steps run WebGL's packed elementwise kernels (runtime.js "packed textures": every lane
# sum over an even dimension, and no pooling). hand:odd's fc2 sums its width 5, hand:cnn's adaptive pooling
# a width of 11, the input gradient of hand:conv_odd's c2 its 3 channels; the cnn preset max-pools.
# hand:conv1's convolution sums 9 lanes, but as an im2col product with exact zeros in both operands'
# padding lanes; hand:head's 5 classes are padded to 6.
PACKED = {
    "mlp": True,
    "cnn": False,
    "hand:cnn": False,
    "hand:odd": False,
    "hand:head": True,
    "hand:conv_odd": False,
    "hand:conv1": True,
}


def delta_errors(got: graphs.Tensors, want: graphs.Tensors, exact: graphs.Tensors) -> dict[str, Any]:
    """Per param: within 1e-4 of float32 PyTorch, or (tests/browser/parity.py's rule) within 1e-4 of the
    float64 delta or twice float32 PyTorch's own error, whichever is larger."""
    floor = 1e-6 * max(float(t.abs().max()) for t in exact.values())
    vs_torch, vs_exact = max_errors(got, want, floor), max_errors(got, exact, floor)
    torch_own = max_errors(want, exact, floor)
    bad = {
        k: vs_torch[k]
        for k in want
        if vs_torch[k] > TOLERANCE and vs_exact[k] > max(TOLERANCE, 2 * torch_own[k])
    }
    return {
        "vs_torch32": max(vs_torch.values()),
        "vs_float64": max(vs_exact.values()),
        "torch32_vs_float64": max(torch_own.values()),
        "bad": bad,
    }


def run_local_steps(harness: Any, backend: str, name: str, samples: int) -> dict[str, Any]:
    """localSteps in the browser against torch; returns the browser's answer."""
    g, weights = case(name)
    batch = graphs.batch_for(g, samples, seed=9)
    inputs, targets = split_batch(g, batch)
    want = runtime.local_steps(g, weights, inputs, targets, batch_size=BATCH, lr=LR, momentum=MOMENTUM)
    exact = float64_local_steps(g, weights, batch, BATCH, LR, MOMENTUM)

    assert harness.evaluate("b => harness.useBackend(b)", backend) == backend
    r = harness.evaluate(
        "([g, w, b, n, lr, m]) => harness.localSteps(g, w, b, n, lr, m, 'fp32')",
        [json.dumps(g), b64(weights), b64(batch), BATCH, LR, MOMENTUM],
    )
    update, meta = codecs.decode(base64.b64decode(r["delta"]))
    params = {p["name"] for p in g["params"]}
    errors = delta_errors({k: v for k, v in update.items() if k in params}, want.delta, exact)
    buffers = max_errors({k: v for k, v in update.items() if k not in params}, want.buffers)
    loss = abs(r["loss"] - want.loss) / abs(want.loss)
    record(
        "local_steps",
        {
            "graph": name,
            "backend": backend,
            "loss": loss,
            "buffer_max": max(buffers.values(), default=0.0),
            **{k: v for k, v in errors.items() if k != "bad"},
        },
    )

    assert meta["codec"] == "fp32" and r["samples"] == samples
    assert not errors["bad"], f"{name} on {backend}: {errors}"
    assert loss <= TOLERANCE and max(buffers.values(), default=0.0) <= TOLERANCE, (loss, buffers)
    assert r["moved"] == 0 and r["leaked"] == 0, r  # the model is left as found, no tensor leaks
    return r


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(PACKED))
def test_local_steps_match_torch(harness: Any, backend: str, name: str) -> None:
    r = run_local_steps(harness, backend, name, SAMPLES)
    # The first step of each batch size runs unpacked (audited), the next two of 8 packed where that is safe:
    # the third reads what the second left in the weights' padding lanes. Off WebGL nothing is decided.
    steps = {"packed": 2, "unpacked": 2} if PACKED[name] else {"packed": 0, "unpacked": 4}
    assert r["packing"] == (steps if backend == "webgl" else {"packed": 0, "unpacked": 0}), r["packing"]


def test_odd_last_batch_runs_unpacked_after_packed_steps(harness: Any) -> None:
    """Batches of 8, 8, 8, 5: the products summing the batch (weight gradients) sum 5 lanes in the last step,
    which runs unpacked after packed steps (its weights scrubbed first: runtime.js packedSteps)."""
    r = run_local_steps(harness, "webgl", "mlp", 29)
    assert r["packing"] == {"packed": 2, "unpacked": 2}, r["packing"]
