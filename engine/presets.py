"""Built-in models, as ordinary torch modules that export to graphs (see engine/export/)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.export import export_module
from engine.layers import PositionalEmbedding


class MLP(nn.Module):
    """784-128-10 with ReLU on 1x28x28 images, flattened first (images keep their shape in datasets, so
    the same dataset trains this and the CNN); past the flatten, the example graph of docs/graph-format.md."""

    def __init__(self, inputs: int = 784, hidden: int = 128, classes: int = 10) -> None:
        super().__init__()
        self.flatten = nn.Flatten()
        self.fc1 = nn.Linear(inputs, hidden)
        self.relu1 = nn.ReLU()
        self.fc2 = nn.Linear(hidden, classes)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.fc2(self.relu1(self.fc1(self.flatten(x))))
        return out


class SmallCNN(nn.Module):
    """Two conv blocks + two linears for 1x28x28 images (~0.2M params)."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.fc1 = nn.Linear(32 * 7 * 7, 128)
        self.dropout = nn.Dropout(0.25)
        self.fc2 = nn.Linear(128, classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = torch.flatten(x, 1)
        out: Tensor = self.fc2(self.dropout(F.relu(self.fc1(x))))
        return out


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet18(nn.Module):
    """CIFAR ResNet-18: 3x3 stem, no max-pool, stages of 64/128/256/512 (~11.2M params)."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        blocks: list[nn.Module] = []
        cin = 64
        for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            blocks += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
            cin = cout
        self.layers = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512, classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.layers(F.relu(self.bn1(self.conv1(x))))
        out: Tensor = self.fc(torch.flatten(self.pool(x), 1))
        return out


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int, block_size: int) -> None:
        super().__init__()
        self.heads, self.head_dim, self.block_size = heads, dim // heads, block_size
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.proj = nn.Linear(dim, dim)

    def _split_heads(self, x: Tensor) -> Tensor:
        # The sequence length is fixed by the preset, so view needs no traced sizes.
        return x.view(-1, self.block_size, self.heads, self.head_dim).transpose(1, 2)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self._split_heads(self.q(x)), self._split_heads(self.k(x)), self._split_heads(self.v(x))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).reshape(-1, self.block_size, self.heads * self.head_dim)
        out: Tensor = self.proj(y)
        return out


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, block_size: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads, block_size)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        out: Tensor = x + self.mlp(self.ln2(x))
        return out


class GPT(nn.Module):
    """Character-level GPT: token + learned positional embeddings, pre-LN causal blocks."""

    def __init__(
        self, vocab: int = 65, block_size: int = 64, dim: int = 128, heads: int = 4, layers: int = 4
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = PositionalEmbedding(block_size, dim)
        self.blocks = nn.Sequential(*[Block(dim, heads, block_size) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)
        self.apply(_gpt_init)

    def forward(self, ids: Tensor) -> Tensor:
        x = self.tok(ids) + self.pos(ids)
        out: Tensor = self.head(self.ln_f(self.blocks(x)))
        return out


def _gpt_init(m: nn.Module) -> None:
    # GPT-2 style small init keeps the initial loss near ln(vocab).
    if isinstance(m, (nn.Linear, nn.Embedding)):
        nn.init.normal_(m.weight, 0.0, 0.02)
    if isinstance(m, nn.Linear) and m.bias is not None:
        nn.init.zeros_(m.bias)


@dataclass(frozen=True)
class PresetSpec:
    builder: Callable[[], nn.Module]
    input_shape: tuple[int, ...]  # per sample, without the batch dimension
    input_dtype: str  # "float32" | "int64"
    target: str  # "class" (one label per sample) | "sequence" (one label per position)
    description: str
    loss: str = "cross_entropy"
    classes: int = 10


PRESETS: dict[str, PresetSpec] = {
    "mlp": PresetSpec(
        MLP, (1, 28, 28), "float32", "class", "MLP 784-128-10 for 1x28x28 images, flattened (MNIST)"
    ),
    "cnn": PresetSpec(
        SmallCNN,
        (1, 28, 28),
        "float32",
        "class",
        "Small CNN (2 conv + 2 linear) for 1x28x28 images (Fashion-MNIST)",
    ),
    "resnet18": PresetSpec(
        ResNet18,
        (3, 32, 32),
        "float32",
        "class",
        "ResNet-18 (CIFAR variant, batchnorm, ~11.2M params) for 3x32x32",
    ),
    "gpt": PresetSpec(
        GPT,
        (64,),
        "int64",
        "sequence",
        "Char-level GPT (4 layers, 4 heads, dim 128, vocab 65, block 64)",
        classes=65,
    ),
}


def build_preset(name: str, seed: int = 0) -> nn.Module:
    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; known: {sorted(PRESETS)}")
    torch.manual_seed(seed)
    return PRESETS[name].builder()


def export_preset(name: str, seed: int = 0) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """Graph dict and initial weights of a preset (deterministic for a given seed)."""
    spec = PRESETS.get(name)
    module = build_preset(name, seed)
    assert spec is not None
    return export_module(module, spec.input_shape, spec.input_dtype, loss=spec.loss, name=name)
