"""A researcher's own model, as it would sit in their package: a small CNN with BatchNorm, which no preset
has (running statistics are buffers; num_batches_tracked is an integer buffer the graph never uses)."""

from __future__ import annotations

import torch
from torch import nn


class DigitNet(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1),
            nn.BatchNorm2d(2 * width),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Linear(2 * width * 7 * 7, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.features(x), 1))


class NeedsArgument(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.layer = nn.Linear(4, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)
