"""Models written the usual way (not in engine/presets.py's style) that the exporter must take as they are.

Each is a small version of a common design: nanoGPT (sdpa, and nn.MultiheadAttention with a causal-mask
buffer), GRU and LSTM text classifiers, a 1-D CNN over time series, a U-Net, a MobileNetV3-like CNN and a
TransformerEncoder classifier. Real torchvision and timm models are in tests/engine/zoo.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# ---------------------------------------------------------------- nanoGPT (Karpathy's model.py, trimmed)


@dataclass
class GPTConfig:
    block_size: int = 32
    vocab_size: int = 65
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0
    bias: bool = True
    attention: str = "sdpa"  # "sdpa" (nanoGPT's flash path) or "mha" (nn.MultiheadAttention + mask)


class LayerNorm(nn.Module):
    """LayerNorm with an optional bias (PyTorch's had none when nanoGPT was written)."""

    def __init__(self, ndim: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, input: Tensor) -> Tensor:
        return F.layer_norm(input, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=None, dropout_p=self.dropout if self.training else 0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MaskedSelfAttention(nn.Module):
    """The same attention through nn.MultiheadAttention and a registered causal mask."""

    mask: Tensor

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(
            config.n_embd, config.n_head, dropout=config.dropout, bias=config.bias, batch_first=True
        )
        mask = torch.triu(torch.ones(config.block_size, config.block_size, dtype=torch.bool), diagonal=1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        T = x.size(1)
        y, _ = self.attn(x, x, x, attn_mask=self.mask[:T, :T], need_weights=False)
        return y


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config) if config.attention == "sdpa" else MaskedSelfAttention(config)
        self.ln_2 = LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    """Predicts the token after the block: logits of the last position only (a generate-free forward)."""

    transformer: Any  # an nn.ModuleDict, read by key as nanoGPT does

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: Tensor) -> Tensor:
        device = idx.device
        b, t = idx.size()
        assert t <= self.config.block_size, f"Cannot forward sequence of length {t}"
        pos = torch.arange(0, t, dtype=torch.long, device=device)
        tok_emb = self.transformer.wte(idx)
        pos_emb = self.transformer.wpe(pos)
        x = self.transformer.drop(tok_emb + pos_emb)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        return self.lm_head(x[:, -1, :])


# ---------------------------------------------------------------- recurrent text classifiers


class GRUClassifier(nn.Module):
    def __init__(self, vocab: int = 100, embed: int = 32, hidden: int = 48, classes: int = 4) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, embed, padding_idx=0)
        self.rnn = nn.GRU(embed, hidden, batch_first=True, bidirectional=True)
        self.fc = nn.Linear(2 * hidden, classes)

    def forward(self, tokens: Tensor) -> Tensor:
        out, _ = self.rnn(self.embedding(tokens))
        return self.fc(out.mean(dim=1))


class LSTMClassifier(nn.Module):
    def __init__(self, vocab: int = 100, embed: int = 32, hidden: int = 48, classes: int = 4) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, embed, padding_idx=0)
        self.lstm = nn.LSTM(embed, hidden, num_layers=2)  # time-major, as in the PyTorch tutorials
        self.dropout = nn.Dropout(0.3)
        self.fc = nn.Linear(hidden, classes)

    def forward(self, tokens: Tensor) -> Tensor:
        embedded = self.embedding(tokens).permute(1, 0, 2)  # [T, N, E]
        _, (h_n, _) = self.lstm(embedded)
        return self.fc(self.dropout(h_n[-1]))


# ---------------------------------------------------------------- convolutional


class TimeSeriesCNN(nn.Module):
    """1-D CNN over [N, channels, length] with global average pooling."""

    def __init__(self, channels: int = 3, classes: int = 5) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv1d(channels, 16, kernel_size=5, padding=2),
            nn.BatchNorm1d(16),
            nn.ReLU(inplace=True),
            nn.MaxPool1d(2),
            nn.Conv1d(16, 32, kernel_size=3, padding="same"),
            nn.BatchNorm1d(32),
            nn.ReLU(inplace=True),
        )
        self.classifier = nn.Linear(32, classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.features(x)
        return self.classifier(x.mean(-1))


class DoubleConv(nn.Module):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.block = nn.Sequential(
            nn.Conv2d(cin, cout, 3, padding="same", bias=False),
            nn.GroupNorm(4, cout),
            nn.SiLU(),
            nn.Conv2d(cout, cout, 3, padding=1, bias=False),
            nn.GroupNorm(4, cout),
            nn.SiLU(),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.block(x)


class UNet(nn.Module):
    """Two levels down and up: a transposed convolution on one, bilinear upsampling on the other."""

    def __init__(self, cin: int = 3, cout: int = 1, width: int = 8) -> None:
        super().__init__()
        self.inc = DoubleConv(cin, width)
        self.down1 = nn.Sequential(nn.MaxPool2d(2), DoubleConv(width, 2 * width))
        self.down2 = nn.Sequential(nn.MaxPool2d(2), DoubleConv(2 * width, 4 * width))
        self.up1 = nn.ConvTranspose2d(4 * width, 2 * width, kernel_size=2, stride=2)
        self.conv1 = DoubleConv(4 * width, 2 * width)
        self.conv2 = DoubleConv(3 * width, width)
        self.outc = nn.Conv2d(width, cout, kernel_size=1)

    def forward(self, x: Tensor) -> Tensor:
        x1 = self.inc(x)
        x2 = self.down1(x1)
        x3 = self.down2(x2)
        x = self.conv1(torch.cat([x2, self.up1(x3)], dim=1))
        x = F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False)
        x = self.conv2(torch.cat([x1, x], dim=1))
        return self.outc(x)


class SqueezeExcite(nn.Module):
    def __init__(self, channels: int, squeeze: int) -> None:
        super().__init__()
        self.fc1 = nn.Conv2d(channels, squeeze, 1)
        self.relu = nn.ReLU()
        self.fc2 = nn.Conv2d(squeeze, channels, 1)
        self.gate = nn.Hardsigmoid()

    def forward(self, x: Tensor) -> Tensor:
        s = x.mean((2, 3), keepdim=True)
        return x * self.gate(self.fc2(self.relu(self.fc1(s))))


class InvertedResidual(nn.Module):
    def __init__(self, cin: int, expand: int, cout: int, stride: int, se: bool) -> None:
        super().__init__()
        self.use_res = stride == 1 and cin == cout
        layers: list[nn.Module] = [
            nn.Conv2d(cin, expand, 1, bias=False),
            nn.BatchNorm2d(expand),
            nn.Hardswish(),
            nn.Conv2d(expand, expand, 3, stride, 1, groups=expand, bias=False),  # depthwise
            nn.BatchNorm2d(expand),
            nn.Hardswish(),
        ]
        if se:
            layers.append(SqueezeExcite(expand, max(8, expand // 4)))
        layers += [nn.Conv2d(expand, cout, 1, bias=False), nn.BatchNorm2d(cout)]
        self.block = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.block(x)
        return x + out if self.use_res else out


class MobileNetLike(nn.Module):
    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16), nn.Hardswish())
        self.blocks = nn.Sequential(
            InvertedResidual(16, 32, 16, 1, se=True),
            InvertedResidual(16, 48, 24, 2, se=False),
            InvertedResidual(24, 72, 24, 1, se=True),
        )
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Sequential(nn.Linear(24, 64), nn.Hardswish(), nn.Dropout(0.2), nn.Linear(64, classes))

    def forward(self, x: Tensor) -> Tensor:
        x = self.pool(self.blocks(self.stem(x)))
        return self.head(torch.flatten(x, 1))


# ---------------------------------------------------------------- TransformerEncoder classifier


class TransformerClassifier(nn.Module):
    def __init__(self, vocab: int = 100, length: int = 16, dim: int = 64, classes: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(1, length, dim) * 0.02)
        layer = nn.TransformerEncoderLayer(
            dim,
            nhead=4,
            dim_feedforward=128,
            dropout=0.0,
            activation="gelu",
            batch_first=True,
            norm_first=True,
        )
        self.encoder = nn.TransformerEncoder(
            layer, num_layers=2, norm=nn.LayerNorm(dim), enable_nested_tensor=False
        )
        self.head = nn.Linear(dim, classes)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.encoder(self.embed(tokens) + self.pos)
        return self.head(x.mean(dim=1))


# ---------------------------------------------------------------- the corpus


@dataclass(frozen=True)
class CorpusModel:
    build: Callable[[], nn.Module]
    input_shape: tuple[int, ...]
    input_dtype: str  # "float32" | "int64" (token ids below ``vocab``)
    loss: Callable[[], nn.Module]  # a fresh loss module, passed to export_module as it is
    classes: int = 0  # class targets in [0, classes); 0: float targets of the output's shape
    vocab: int = 100


def _class_weights(classes: int) -> Tensor:
    return torch.linspace(0.5, 2.0, classes)


CORPUS: dict[str, CorpusModel] = {
    "nanogpt": CorpusModel(
        lambda: GPT(GPTConfig()), (32,), "int64", nn.CrossEntropyLoss, classes=65, vocab=65
    ),
    "nanogpt_mha": CorpusModel(
        lambda: GPT(GPTConfig(attention="mha")), (32,), "int64", nn.CrossEntropyLoss, classes=65, vocab=65
    ),
    "gru_classifier": CorpusModel(
        GRUClassifier, (20,), "int64", lambda: nn.CrossEntropyLoss(label_smoothing=0.1), classes=4
    ),
    "lstm_classifier": CorpusModel(
        LSTMClassifier, (20,), "int64", lambda: nn.CrossEntropyLoss(weight=_class_weights(4)), classes=4
    ),
    "timeseries_cnn": CorpusModel(TimeSeriesCNN, (3, 64), "float32", nn.CrossEntropyLoss, classes=5),
    "unet": CorpusModel(UNet, (3, 32, 32), "float32", nn.MSELoss),
    "mobilenet_like": CorpusModel(MobileNetLike, (3, 32, 32), "float32", nn.CrossEntropyLoss, classes=10),
    "transformer_classifier": CorpusModel(
        TransformerClassifier, (16,), "int64", lambda: nn.CrossEntropyLoss(ignore_index=3), classes=4
    ),
}
