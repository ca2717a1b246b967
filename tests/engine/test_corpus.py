"""Models written the usual way (tests/engine/corpus.py) export, and the server interpreter trains them
exactly as torch does: outputs, loss, every gradient and the buffers a training step updates, within 1e-5.
FLOPs per sample come from the graph (engine/flops.py); the table is printed with ``-s``."""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

from engine.export import export_module
from engine.flops import forward_flops_per_sample, train_flops_per_sample
from engine.graph import load_graph
from engine.runtime import GraphModule
from tests.engine.corpus import CORPUS, CorpusModel
from tests.engine.zoo import ZOO

ATOL = RTOL = 1e-5
MODELS = {**CORPUS, **ZOO}  # hand-written, then torchvision's and timm's
# vit_b_16 has 86M parameters: building, exporting and one step take ~10 s on a quiet machine.
NAMES = [pytest.param(n, marks=pytest.mark.slow) if n == "tv_vit_b_16" else n for n in MODELS]


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name].build()


@cache
def exported(name: str) -> tuple[dict[str, Any], dict[str, Tensor]]:
    spec = MODELS[name]
    return export_module(build(name), spec.input_shape, spec.input_dtype, loss=spec.loss(), name=name)


def batch(spec: CorpusModel, size: int, out_shape: list[int]) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(7)
    if spec.input_dtype == "int64":
        x = torch.randint(0, spec.vocab, (size, *spec.input_shape), generator=g)
    else:
        x = torch.randn((size, *spec.input_shape), generator=g)
    if spec.classes:
        y = torch.randint(0, spec.classes, (size,), generator=g)
    else:
        y = torch.randn((size, *out_shape[1:]), generator=g)
    return x, y


@pytest.mark.parametrize("name", NAMES)
def test_corpus_model_trains_like_torch(name: str) -> None:
    spec = MODELS[name]
    graph, weights = exported(name)
    model, ours = build(name), GraphModule(load_graph(graph))
    ours.load_state(weights)
    model.train()
    ours.train()
    x, y = batch(spec, 4, graph["targets"][0]["shape"])
    torch.manual_seed(1)  # dropout draws the same masks in both (same ops, same order)
    ref = model(x)
    torch.manual_seed(1)
    out = ours({"x": x})
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL)
    loss_ref, loss = spec.loss()(ref, y), ours.loss(out, {"y": y})
    torch.testing.assert_close(loss, loss_ref, atol=ATOL, rtol=RTOL)
    loss_ref.backward()
    loss.backward()
    grads, params = ours.grads(), dict(model.named_parameters())
    assert set(grads) == set(params)  # every parameter is trained (tied weights are one parameter)
    for pname, p in params.items():
        assert p.grad is not None, pname
        torch.testing.assert_close(grads[pname], p.grad, atol=ATOL, rtol=RTOL, msg=pname)
    state, buffers = ours.state(), dict(model.named_buffers())
    for spec_ in graph["buffers"]:
        if spec_["name"] in buffers:
            torch.testing.assert_close(
                state[spec_["name"]], buffers[spec_["name"]], atol=ATOL, rtol=RTOL, msg=spec_["name"]
            )


@pytest.mark.parametrize("name", NAMES)
def test_corpus_model_evaluates_like_torch(name: str) -> None:
    spec = MODELS[name]
    graph, weights = exported(name)
    model, ours = build(name), GraphModule(load_graph(graph))
    ours.load_state(weights)
    model.eval()
    ours.eval()
    x, _ = batch(spec, 3, graph["targets"][0]["shape"])
    torch.testing.assert_close(ours({"x": x}), model(x), atol=ATOL, rtol=RTOL)


def torch_forward_flops(name: str) -> int:
    """What torch's FlopCounterMode counts for one sample's forward pass."""
    spec = MODELS[name]
    x, _ = batch(spec, 1, [1])
    model = build(name).eval()
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(x)
    return int(counter.get_total_flops())


def test_corpus_flops_per_sample(capsys: pytest.CaptureFixture[str]) -> None:
    rows = []
    for name in MODELS:
        graph = load_graph(exported(name)[0])
        forward, train = forward_flops_per_sample(graph), train_flops_per_sample(graph)
        assert 0 < forward < train
        rows.append((name, graph.param_count(), forward, train, torch_forward_flops(name), len(graph.nodes)))
    with capsys.disabled():
        print("\nmodel                    params   fwd FLOPs/sample  train FLOPs/sample  torch fwd   nodes")
        for name, params, forward, train, theirs, nodes in rows:
            print(f"{name:22s} {params:8,d} {forward:17,d} {train:19,d} {theirs:10,d} {nodes:7d}")
