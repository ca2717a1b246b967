"""FLOP counts from the graph must equal torch's FlopCounterMode on the real modules.

FlopCounterMode runs on the meta device here: on CPU tensors torch dispatches attention to a fused
kernel the counter does not know (it would report 0), on meta it uses the math path.
"""

from __future__ import annotations

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
