"""Layers of our own shared by the presets and the exporter, which maps each to one graph op (a module of its
own so that neither imports the other)."""

from __future__ import annotations

import torch
from torch import Tensor, nn


class PositionalEmbedding(nn.Module):
    """Learned positions: returns weight[0:T] for ids of shape [B, T] (graph op arange_embedding).

    A module of its own so export maps it to one op instead of tracing torch.arange.
    """

    def __init__(self, block_size: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(block_size, dim) * 0.02)

    def forward(self, ids: Tensor) -> Tensor:
        return self.weight.narrow(0, 0, ids.shape[1])
