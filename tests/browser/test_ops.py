"""Browser kernels whose results are random, checked by their structure rather than against PyTorch's draws:
dropout2d keeps or drops whole channels (one draw per sample and channel, both on NCHW values and on the
NHWC ones convolutions leave) and scales what it keeps by 1 / (1 - p); at p = 1 it drops everything.
drop_path (stochastic depth) does the same per sample. And expand (a ViT's class token), against PyTorch;
and the cpu backend's convolution, against float64; and what a Conv1d net transposes."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from engine.export import export_module
from tests.browser import graphs
from tests.browser.graphs import node, spec
from tests.browser.parity import b64
from tests.browser.test_parity import BACKENDS, browser_run, run_case
from tests.engine.corpus import CORPUS

pytestmark = pytest.mark.browser


def dropout2d_graph(p: float) -> graphs.Graph:
    """[dropout2d(conv(x)), dropout2d(x)] along the channels: the first reads NHWC, the second NCHW."""
    nodes = [
        node("dx", "dropout2d", ["x"], p=p),  # before the conv, which gives x an NHWC form too
        node("c", "conv2d", ["x", "w", None]),
        node("d", "dropout2d", ["c"], p=p),
        node("cat", "concat", ["d", "dx"], dim=1),
    ]
    inputs, targets = [spec("x", [-1, 8, 3, 3])], [spec("y", [-1, 16, 3, 3])]
    return graphs.graph("dropout2d", inputs, targets, [spec("w", [8, 8, 1, 1])], [], nodes, "cat", "mse")


def run(page: Any, backend: str, p: float) -> tuple[dict[str, Any], torch.Tensor]:
    """The browser's training-mode output and gradients, and the output if every channel were kept."""
    g = dropout2d_graph(p)
    gen = torch.Generator().manual_seed(2)
    weights = {"w": torch.randn(8, 8, 1, 1, generator=gen)}
    batch = {"x": torch.randn(16, 8, 3, 3, generator=gen), "y": torch.randn(16, 16, 3, 3, generator=gen)}
    kept_all = torch.cat([F.conv2d(batch["x"], weights["w"]), batch["x"]], 1) / (1 - p if p < 1 else 1)
    return browser_run(page, backend, g, weights, batch), kept_all


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout2d_keeps_or_drops_whole_channels(harness: Any, backend: str) -> None:
    got, kept_all = run(harness, backend, 0.5)
    planes = got["output"].flatten(2)  # [N, C, H*W]
    kept = planes.abs().amax(-1) > 0  # per sample and channel
    torch.testing.assert_close(planes, kept_all.flatten(2) * kept[..., None], rtol=1e-5, atol=1e-5)
    for half in (kept[:, :8], kept[:, 8:]):  # 128 draws each, p = 0.5: far from all or none
        assert 0.25 < half.float().mean() < 0.75
    assert got["grads"]["w"].abs().amax() > 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout2d_at_p_1_drops_everything(harness: Any, backend: str) -> None:
    got, _ = run(harness, backend, 1.0)
    assert not got["output"].any() and not got["grads"]["w"].any()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["blocks", "padding"])
def test_the_new_kernels_leak_no_tensor(harness: Any, backend: str, name: str) -> None:
    """Training steps through every new kernel (dropout2d's random path and embedding's custom gradient
    included) hold the same tensors after each step, and none once the model is gone."""
    g = graphs.HAND_MADE[name]()
    for n in g["nodes"]:
        if n["op"] == "dropout2d":
            n["attrs"]["p"] = 0.3
    assert harness.evaluate("b => harness.useBackend(b)", backend) == backend
    before = harness.evaluate("() => tf.memory().numTensors")
    r = harness.evaluate(
        "([g, w, b]) => harness.trainSteps(g, w, b, 4, 'SGD', {lr: 0.01, momentum: 0.9})",
        [json.dumps(g), b64(graphs.init_weights(g, 5)), b64(graphs.batch_for(g, 4, 6))],
    )
    assert len(set(r["counts"])) == 1, r["counts"]
    assert harness.evaluate("() => tf.memory().numTensors") == before


def drop_path_graph(p: float) -> graphs.Graph:
    """[drop_path(conv(x)), drop_path(x)] along the channels: the first reads NHWC, the second NCHW."""
    nodes = [
        node("dx", "drop_path", ["x"], p=p),
        node("c", "conv2d", ["x", "w", None]),
        node("d", "drop_path", ["c"], p=p),
        node("cat", "concat", ["d", "dx"], dim=1),
    ]
    inputs, targets = [spec("x", [-1, 8, 3, 3])], [spec("y", [-1, 16, 3, 3])]
    return graphs.graph("drop_path", inputs, targets, [spec("w", [8, 8, 1, 1])], [], nodes, "cat", "mse")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("p", [0.5, 1.0])
def test_drop_path_keeps_or_drops_whole_samples(harness: Any, backend: str, p: float) -> None:
    g = drop_path_graph(p)
    gen = torch.Generator().manual_seed(2)
    weights = {"w": torch.randn(8, 8, 1, 1, generator=gen)}
    batch = {"x": torch.randn(64, 8, 3, 3, generator=gen), "y": torch.randn(64, 16, 3, 3, generator=gen)}
    kept_all = torch.cat([F.conv2d(batch["x"], weights["w"]), batch["x"]], 1) / (1 - p if p < 1 else 1)
    got = browser_run(harness, backend, g, weights, batch)["output"]
    for half in (slice(0, 8), slice(8, 16)):  # each drop_path node: whole samples, scaled by 1 / (1 - p)
        kept = got[:, half].flatten(1).abs().amax(-1) > 0
        torch.testing.assert_close(
            got[:, half], kept_all[:, half] * kept[:, None, None, None], rtol=1e-5, atol=1e-5
        )
        assert (0.25 < kept.float().mean() < 0.75) if p < 1 else not kept.any()


def expand_graph() -> graphs.Graph:
    """A class token (a [1, 1, 4] parameter) expanded to the batch and put before the sequence."""
    nodes = [
        node("cls", "expand", ["token", "x"], shape=[-1, 1, 4]),
        node("seq", "concat", ["cls", "x"], dim=1),
        node("out", "linear", ["seq", "fc.weight", None]),
    ]
    params = [spec("token", [1, 1, 4]), spec("fc.weight", [3, 4])]
    return graphs.graph(
        "expand", [spec("x", [-1, 5, 4])], [spec("y", [-1, 6, 3])], params, [], nodes, "out", "mse"
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_expand_matches_pytorch(harness: Any, backend: str) -> None:
    """Forward and the gradient of the expanded parameter (summed over the batch) as PyTorch's."""
    g = expand_graph()
    run_case(harness, backend, "expand", g, graphs.init_weights(g, seed=3), n=4)


def long_sum_conv_graph() -> graphs.Graph:
    """One 3x3 convolution over 1024 channels: each output sums 9216 products."""
    nodes = [node("c", "conv2d", ["x", "w", None], padding=1)]
    inputs, targets = [spec("x", [-1, 1024, 4, 4])], [spec("y", [-1, 2, 4, 4])]
    return graphs.graph("long_sum", inputs, targets, [spec("w", [2, 1024, 3, 3])], [], nodes, "c", "mse")


@pytest.mark.parametrize("backend", BACKENDS)
def test_conv2d_over_a_long_sum_stays_near_float64(harness: Any, backend: str) -> None:
    """TF.js 4.22's cpu Conv2D rounds every product into its float32 output: positive terms put it 3.7e-6
    off float64 here, as WebGL (SwiftShader) is, against float32 PyTorch's 2.9e-7, well within what training
    tolerates (runtime.js, groupedConv). An accumulation gone wrong (half precision, a lost term) lands far
    beyond 1e-5."""
    g = long_sum_conv_graph()
    gen = torch.Generator().manual_seed(4)
    weights = {"w": torch.rand(2, 1024, 3, 3, generator=gen)}
    batch = {"x": torch.rand(2, 1024, 4, 4, generator=gen), "y": torch.zeros(2, 2, 4, 4)}
    got = browser_run(harness, backend, g, weights, batch)["output"]
    exact = F.conv2d(batch["x"].double(), weights["w"].double(), padding=1)
    error = float(((got.double() - exact).abs() / exact.abs()).max())
    torch_error = float(
        ((F.conv2d(batch["x"], weights["w"], padding=1).double() - exact).abs() / exact.abs()).max()
    )
    print(f"{backend}: conv over 9216 products {error:.1e} off float64 (PyTorch float32: {torch_error:.1e})")
    assert error < 1e-5


SECOND_STEP_KERNELS = """async ([g, w, b]) => {
  const ct = self.crowdtrain, decode = (s) => ct.codecs.decode(harnessB64.fromB64(s));
  const [weights, batch] = [decode(w), decode(b)];
  const model = ct.runtime.createModel(ct.graph.load(g), weights);
  const x = tf.tensor(batch.x.data, batch.x.shape, "float32");
  const y = tf.tensor(Int32Array.from(batch.y.data), batch.y.shape, "int32");
  const step = async () => {
    const r = ct.runtime.gradients(model, { x, y });
    await r.loss.data();
    tf.dispose([r.loss, ...Object.values(r.grads)]);
  };
  const engine = tf.engine(), runKernel = engine.runKernel, kernels = [];
  try {
    await step(); // on WebGL the audited one (runtime.js, packedSteps)
    engine.runKernel = function (name, inputs) {
      kernels.push([name, inputs.x ? inputs.x.size : 0]);
      return runKernel.apply(this, arguments);
    };
    await step();
  } finally {
    engine.runKernel = runKernel;
    tf.dispose([x, y]);
    model.dispose();
  }
  return kernels;
}"""


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_conv1d_net_transposes_no_activation(harness: Any, backend: str) -> None:
    """A Conv1d net (lowered to reshape, conv2d, reshape) with batch norm, pooling and a mean over time runs
    channels last from its first convolution on: a training step transposes the input and the filters
    (forward, and their gradients back), never an activation or its gradient. Its 5 classes are not padded
    to an even width (runtime.js, linearProduct) once WebGL knows its steps run unpacked (they pool)."""
    torch.manual_seed(0)
    model = CORPUS["timeseries_cnn"]
    g, weights = export_module(model.build(), model.input_shape, loss=model.loss())
    gen = torch.Generator().manual_seed(1)
    batch = {
        "x": torch.randn(8, *model.input_shape, generator=gen),
        "y": torch.randint(0, 5, (8,), generator=gen),
    }
    assert harness.evaluate("b => harness.useBackend(b)", backend) == backend
    kernels = harness.evaluate(SECOND_STEP_KERNELS, [json.dumps(g), b64(weights), b64(batch)])
    filters = [t.numel() for t in weights.values() if t.dim() == 3]
    transposed = [size for name, size in kernels if name == "Transpose"]
    assert sorted(transposed) == sorted([batch["x"].numel(), *filters, *filters])
    assert not [name for name, _ in kernels if name in ("PadV2", "Slice")]
