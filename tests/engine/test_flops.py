"""FLOP counts from the graph must equal torch's FlopCounterMode on the real modules.

FlopCounterMode runs on the meta device here: on CPU tensors torch dispatches attention to a fused
kernel the counter does not know (it would report 0), on meta it uses the math path.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

from engine.export import export_module
from engine.flops import forward_flops_per_sample, train_flops_per_sample
from engine.graph import load_graph
from engine.presets import PRESETS
from tests.engine.conftest import exported, preset_module


def torch_flops(module: nn.Module, shape: tuple[int, ...], dtype: str, batch: int = 2) -> tuple[int, int]:
    """(forward, forward+backward) FLOPs of a batch as FlopCounterMode counts them."""
    module = module.to("meta").train()
    if dtype == "int64":
        x = torch.zeros((batch, *shape), dtype=torch.int64, device="meta")
    else:
        x = torch.randn((batch, *shape), device="meta")
    with FlopCounterMode(display=False) as counter:
        module(x)
    forward = counter.get_total_flops()
    with FlopCounterMode(display=False) as counter:
        out = module(x)
        y = torch.zeros(out.shape[:-1], dtype=torch.int64, device="meta")
        F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1)).backward()
    return forward, counter.get_total_flops()


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_agree_with_flop_counter_mode(name: str) -> None:
    spec = PRESETS[name]
    graph = load_graph(exported(name)[0])
    forward, train = torch_flops(preset_module(name), spec.input_shape, spec.input_dtype)
    assert forward > 0
    assert forward_flops_per_sample(graph) * 2 == forward
    assert train_flops_per_sample(graph) * 2 == train


def test_mlp_by_hand() -> None:
    graph = load_graph(exported("mlp")[0])
    forward = 2 * 784 * 128 + 2 * 128 * 10
    assert forward_flops_per_sample(graph) == forward
    # weight grads of both layers, input grad only for fc2 (nothing needs d loss / d x).
    assert train_flops_per_sample(graph) == forward + forward + 2 * 128 * 10


class _Odd(nn.Module):
    """Grouped/strided conv, broadcast matmul, attention and a dead branch."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 6, 3, stride=2, padding=1, groups=2)
        self.proj = nn.Linear(6, 8)
        self.unused = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        h = self.conv(x).flatten(2).transpose(1, 2)  # [B, 16, 6]
        q = self.proj(h).view(-1, 16, 2, 4).transpose(1, 2)  # [B, 2, 16, 4]
        att = F.scaled_dot_product_attention(q, q, q)
        mixed = att @ q.transpose(-2, -1)  # [B, 2, 16, 16]
        self.unused(att.transpose(1, 2).reshape(-1, 16, 8))  # forward cost only: no gradient flows
        out: Tensor = mixed.flatten(1)
        return out


def test_grouped_conv_attention_and_dead_branches_agree() -> None:
    torch.manual_seed(0)
    module = _Odd()
    graph = load_graph(export_module(module, (4, 8, 8))[0])
    forward, train = torch_flops(module, (4, 8, 8), "float32", batch=3)
    assert forward_flops_per_sample(graph) * 3 == forward
    assert train_flops_per_sample(graph) * 3 == train


class _Decoder(nn.Module):
    """Two transposed convs: the first's input needs no gradient, the second's does."""

    def __init__(self) -> None:
        super().__init__()
        self.up1 = nn.ConvTranspose2d(4, 3, 3, stride=2, padding=1, output_padding=1)
        self.up2 = nn.ConvTranspose2d(3, 2, (2, 3), stride=(1, 2), padding=(0, 1), bias=False)
        self.head = nn.Linear(2 * 11 * 27, 5, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.head(self.up2(self.up1(x)).flatten(1))
        return out


def _transposed(name: str, x: str, bias: str | None, **attrs: Any) -> dict[str, Any]:
    return {"name": name, "op": "conv_transpose2d", "inputs": [x, f"{name}.weight", bias], "attrs": attrs}


DECODER: dict[str, Any] = {
    "format": "crowdtrain.graph",
    "version": 1,
    "inputs": [{"name": "x", "shape": [-1, 4, 5, 7]}],
    "targets": [{"name": "y", "shape": [-1], "dtype": "int64"}],
    "params": [
        {"name": "up1.weight", "shape": [4, 3, 3, 3]},
        {"name": "up1.bias", "shape": [3]},
        {"name": "up2.weight", "shape": [3, 2, 2, 3]},
        {"name": "head.weight", "shape": [5, 594]},
    ],
    "nodes": [
        _transposed("up1", "x", "up1.bias", stride=2, padding=1, output_padding=1),  # [N, 3, 10, 14]
        _transposed("up2", "up1", None, stride=[1, 2], padding=[0, 1]),  # [N, 2, 11, 27]
        {"name": "flat", "op": "flatten", "inputs": ["up2"]},
        {"name": "head", "op": "linear", "inputs": ["flat", "head.weight", None]},
    ],
    "output": "head",
    "loss": {"op": "cross_entropy", "inputs": ["head", "y"]},
}


def test_conv_transpose2d_agrees_with_flop_counter_mode() -> None:
    graph = load_graph(DECODER)
    forward, train = torch_flops(_Decoder(), (4, 5, 7), "float32", batch=3)
    up1 = 2 * 5 * 7 * 4 * 3 * 3 * 3  # every input pixel times the whole kernel
    assert forward_flops_per_sample(graph) == up1 + 2 * 10 * 14 * 3 * 2 * 2 * 3 + 2 * 594 * 5
    assert forward_flops_per_sample(graph) * 3 == forward
    assert train_flops_per_sample(graph) * 3 == train
