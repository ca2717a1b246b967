"""THE RULE (docs/graph-format.md, "The exporter"): every argument and attribute of a captured call is
either represented in the graph and honoured by the interpreter, or the export is refused with an
ExportError that names it. Nothing is silently dropped.

For every supported nn.Module class and function/method, and for each of its PyTorch arguments (from
inspect.signature of the module's __init__ and forward, or the signature the exporter binds a call with),
the tables below give non-default values and what must happen: "ok" values export and match the module
(outputs, loss, every gradient and the updated buffers, in train mode unless the value makes training
random), "refused" values raise an ExportError naming the argument, "either" values must do one of the
two. A handler without a table entry, or an argument without a value or a reason to skip it, fails.
"""

from __future__ import annotations

import importlib
import inspect
import operator
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.export import CALL_HANDLERS, MODULE_HANDLERS, ExportError, export_module
from engine.graph import load_graph
from engine.layers import PositionalEmbedding
from engine.runtime import GraphModule

ATOL = RTOL = 1e-5


@dataclass(frozen=True)
class With:
    """A value for the argument under test plus other arguments it needs (e.g. ceil_mode with a kernel)."""

    value: Any
    others: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Refuse:
    """A refused value whose message names ``word`` rather than the argument (e.g. an index's step)."""

    value: Any
    word: str


@dataclass(frozen=True)
class Made:
    """A forward argument built inside forward from the layer and its input (e.g. an initial state)."""

    make: Callable[[Any, Tensor], Any]


@dataclass(frozen=True)
class Case:
    shape: tuple[int, ...]
    base: dict[str, Any] = field(default_factory=dict)
    ok: dict[str, list[Any]] = field(default_factory=dict)
    refused: dict[str, list[Any]] = field(default_factory=dict)
    either: dict[str, list[Any]] = field(default_factory=dict)
    exempt: dict[str, str] = field(default_factory=dict)  # argument -> why no value is tried
    random: frozenset[str] = frozenset()  # arguments whose values make train mode random: compare in eval
    call: Callable[..., Tensor] | None = None  # (layer or target, model, x, kwargs) -> output
    params: dict[str, tuple[int, ...]] = field(default_factory=dict)  # tensors a function case uses
    buffers: dict[str, tuple[int, ...]] = field(default_factory=dict)  # positive values (running stats)
    dtype: str = "float32"
    eval_random: bool = False  # the module stays random in eval mode (F.dropout's training=True)

    def values(self) -> Iterator[tuple[str, str, Any]]:
        for outcome in ("ok", "refused", "either"):
            for arg, values in getattr(self, outcome).items():
                for value in values:
                    yield outcome, arg, value


def causal_float(size: int) -> Tensor:
    return nn.Transformer.generate_square_subsequent_mask(size)


def causal_bool(size: int) -> Tensor:
    """MultiheadAttention's convention: True is masked."""
    return torch.ones(size, size, dtype=torch.bool).triu(1)


def random_mask(size: int) -> Tensor:
    return torch.randn(size, size, generator=torch.Generator().manual_seed(3))


# ---------------------------------------------------------------- modules


class Wrap(nn.Module):
    """Calls the layer under test the way models do; forward arguments under test come in ``kwargs``."""

    def __init__(self, layer: nn.Module, call: Callable[..., Tensor] | None, kwargs: dict[str, Any]) -> None:
        super().__init__()
        self.layer, self.call, self.kwargs = layer, call, kwargs

    def forward(self, x: Tensor) -> Tensor:
        kw = {k: v.make(self.layer, x) if isinstance(v, Made) else v for k, v in self.kwargs.items()}
        if self.call is None:
            return self.layer(x, **kw)
        return self.call(self.layer, x, kw)


def seq_call(m: nn.Module, x: Tensor, kw: dict[str, Any], first: bool) -> Tensor:
    """Feeds [N, L, E] to a layer in its own layout and returns [N, L, E]."""
    xs = x if first else x.transpose(0, 1)
    out: Tensor = m(xs, **kw)
    return out if first else out.transpose(0, 1)


def mha_call(m: nn.MultiheadAttention, x: Tensor, kw: dict[str, Any]) -> Tensor:
    xs = x if m.batch_first else x.transpose(0, 1)
    out = m(xs, xs[..., : m.kdim], xs[..., : m.vdim], **kw)[0]
    return out if m.batch_first else out.transpose(0, 1)


def rnn_call(m: nn.RNNBase, x: Tensor, kw: dict[str, Any]) -> Tensor:
    """The usual readouts: the last output, the last layer's final state (and cell)."""
    xs = x if m.batch_first else x.transpose(0, 1)
    out, state = m(xs, **kw)
    last = out[:, -1] if m.batch_first else out[-1]
    if m.mode == "LSTM":
        return torch.cat([last, state[0][-1], state[1][-1]], dim=-1)
    return torch.cat([last, state[-1]], dim=-1)


class Positions(nn.Module):
    """PositionalEmbedding as GPTs use it: added to token embeddings."""

    def __init__(self, block_size: int, dim: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(10, dim)
        self.pos = PositionalEmbedding(block_size, dim)

    def forward(self, ids: Tensor) -> Tensor:
        return self.tok(ids) + self.pos(ids)


def encoder(
    encoder_layer: nn.TransformerEncoderLayer | None = None, num_layers: int = 2, **kw: Any
) -> nn.TransformerEncoder:
    layer = encoder_layer or nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, num_layers, **kw)


FACTORY = {"device": ["cpu"]}
FLOAT64 = {"dtype": [torch.float64]}
SHAPE = "a size: the base case exercises it"
CONV_REFUSED = {"padding_mode": ["reflect", "replicate", "circular"]}

MODULE_CASES: dict[type, Case] = {
    nn.Linear: Case(
        (6,),
        {"in_features": 6, "out_features": 4},
        ok={"bias": [False], **FACTORY},
        refused=FLOAT64,
        exempt={"in_features": SHAPE, "out_features": SHAPE},
    ),
    nn.Conv1d: Case(
        (2, 9),
        {"in_channels": 2, "out_channels": 4, "kernel_size": 3},
        ok={
            "kernel_size": [4],
            "stride": [2],
            "padding": [1, "same", "valid"],
            "dilation": [2],
            "groups": [2],
            "bias": [False],
            **FACTORY,
        },
        refused={**CONV_REFUSED, "padding": [With("same", {"kernel_size": 4})], **FLOAT64},
        exempt={"in_channels": SHAPE, "out_channels": SHAPE},
    ),
    nn.Conv2d: Case(
        (2, 9, 9),
        {"in_channels": 2, "out_channels": 4, "kernel_size": 3},
        ok={
            "kernel_size": [(3, 1)],
            "stride": [(2, 1)],
            "padding": [(1, 0), "same", "valid", With("same", {"kernel_size": (3, 5), "dilation": 2})],
            "dilation": [2],
            "groups": [2],
            "bias": [False],
            **FACTORY,
        },
        refused={**CONV_REFUSED, "padding": [With("same", {"kernel_size": (3, 2)})], **FLOAT64},
        exempt={"in_channels": SHAPE, "out_channels": SHAPE},
    ),
    nn.ConvTranspose2d: Case(
        (4, 5, 5),
        {"in_channels": 4, "out_channels": 2, "kernel_size": 3},
        ok={
            "kernel_size": [2],
            "stride": [2],
            "padding": [1],
            "output_padding": [With(1, {"stride": 2})],
            "bias": [False],
            "output_size": [With([12, 12], {"stride": 2}), With([11, 11], {"stride": 2})],
            **FACTORY,
        },
        refused={"groups": [2], "dilation": [2], **FLOAT64},
        exempt={
            "in_channels": SHAPE,
            "out_channels": SHAPE,
            "padding_mode": "torch itself accepts only 'zeros' for transposed convolutions",
        },
    ),
    nn.BatchNorm1d: Case(
        (4, 6),
        {"num_features": 4},
        ok={"eps": [1e-3], "momentum": [0.5], **FACTORY},
        refused={
            "momentum": [None],
            "affine": [False],
            "track_running_stats": [False],
            "bias": [False],
            **FLOAT64,
        },
        exempt={"num_features": SHAPE},
    ),
    nn.BatchNorm2d: Case(
        (4, 3, 3),
        {"num_features": 4},
        ok={"eps": [1e-3], "momentum": [0.5], **FACTORY},
        refused={
            "momentum": [None],
            "affine": [False],
            "track_running_stats": [False],
            "bias": [False],
            **FLOAT64,
        },
        exempt={"num_features": SHAPE},
    ),
    nn.LayerNorm: Case(
        (3, 6),
        {"normalized_shape": 6},
        ok={
            "normalized_shape": [(3, 6)],
            "eps": [1e-3],
            "elementwise_affine": [False],
            "bias": [False],
            **FACTORY,
        },
        refused=FLOAT64,
    ),
    nn.GroupNorm: Case(
        (4, 3, 3),
        {"num_groups": 2, "num_channels": 4},
        ok={"num_groups": [4, 1], "eps": [1e-3], "affine": [False], "bias": [False], **FACTORY},
        refused=FLOAT64,
        exempt={"num_channels": SHAPE},
    ),
    nn.InstanceNorm1d: Case(
        (4, 6),
        {"num_features": 4},
        ok={
            "eps": [1e-3],
            "momentum": [0.5],
            "affine": [True],
            "bias": [With(False, {"affine": True})],
            **FACTORY,
        },
        refused={"track_running_stats": [True]},
        either={"dtype": [torch.float64]},  # without affine params dtype changes nothing
        exempt={"num_features": SHAPE},
    ),
    nn.InstanceNorm2d: Case(
        (4, 3, 3),
        {"num_features": 4},
        ok={"eps": [1e-3], "momentum": [0.5], "affine": [True], "bias": [False], **FACTORY},
        refused={"track_running_stats": [True], "dtype": [With(torch.float64, {"affine": True})]},
        exempt={"num_features": SHAPE},
    ),
    nn.Embedding: Case(
        (5,),
        {"num_embeddings": 10, "embedding_dim": 4},
        ok={
            "padding_idx": [0, -1, 7],
            "norm_type": [1.0],
            "_weight": [torch.randn(10, 4, generator=torch.Generator().manual_seed(1))],
            "_freeze": [True],
            **FACTORY,
        },
        refused={"max_norm": [1.0], "scale_grad_by_freq": [True], "sparse": [True], **FLOAT64},
        exempt={"num_embeddings": SHAPE, "embedding_dim": SHAPE},
        dtype="int64",
    ),
    nn.ReLU: Case((5,), ok={"inplace": [True]}),
    nn.Tanh: Case((5,), exempt={"args": "ignored by torch", "kwargs": "ignored by torch"}),
    nn.Sigmoid: Case((5,), exempt={"args": "ignored by torch", "kwargs": "ignored by torch"}),
    nn.GELU: Case((5,), ok={"approximate": ["tanh"]}),
    nn.SiLU: Case((5,), ok={"inplace": [True]}),
    nn.Hardswish: Case((5,), ok={"inplace": [True]}),
    nn.Hardsigmoid: Case((5,), ok={"inplace": [True]}),
    nn.LeakyReLU: Case((5,), ok={"negative_slope": [0.2], "inplace": [True]}),
    nn.ELU: Case((5,), ok={"alpha": [0.5], "inplace": [True]}),
    nn.Softmax: Case((3, 4), {"dim": -1}, ok={"dim": [1, 2]}, refused={"dim": [None]}),
    nn.LogSoftmax: Case((3, 4), {"dim": -1}, ok={"dim": [1, 2]}, refused={"dim": [None]}),
    nn.Dropout: Case((5,), ok={"p": [0.3, 0.0], "inplace": [True]}),
    nn.Dropout1d: Case((4, 6), ok={"p": [0.3, 0.0], "inplace": [True]}),
    nn.Dropout2d: Case((4, 3, 3), ok={"p": [0.3, 0.0], "inplace": [True]}),
    nn.MaxPool1d: Case(
        (3, 8),
        {"kernel_size": 2},
        ok={"kernel_size": [3], "stride": [1], "padding": [1], "ceil_mode": [True]},
        refused={"dilation": [2], "return_indices": [True], "ceil_mode": [With(True, {"kernel_size": 3})]},
    ),
    nn.MaxPool2d: Case(
        (3, 8, 8),
        {"kernel_size": 2},
        ok={"kernel_size": [(3, 2)], "stride": [1], "padding": [1], "ceil_mode": [True]},
        refused={"dilation": [2], "return_indices": [True], "ceil_mode": [With(True, {"kernel_size": 3})]},
    ),
    nn.AvgPool1d: Case(
        (3, 8),
        {"kernel_size": 2},
        ok={
            "kernel_size": [3],
            "stride": [1],
            "padding": [1],
            "ceil_mode": [True],
            "count_include_pad": [False],
        },
        refused={
            "ceil_mode": [With(True, {"kernel_size": 3})],
            "count_include_pad": [With(False, {"padding": 1})],
        },
    ),
    nn.AvgPool2d: Case(
        (3, 8, 8),
        {"kernel_size": 2},
        ok={
            "kernel_size": [(3, 2)],
            "stride": [1],
            "padding": [1],
            "ceil_mode": [True],
            "count_include_pad": [False],
            "divisor_override": [3, With(3, {"padding": 1})],
        },
        refused={
            "ceil_mode": [With(True, {"kernel_size": 3})],
            "count_include_pad": [With(False, {"padding": 1})],
        },
    ),
    nn.AdaptiveAvgPool1d: Case((3, 8), {"output_size": 4}, ok={"output_size": [1, 3]}),
    nn.AdaptiveAvgPool2d: Case((3, 8, 8), {"output_size": 4}, ok={"output_size": [(2, None), (1, 3)]}),
    nn.Flatten: Case((2, 3, 4), ok={"start_dim": [2], "end_dim": [2]}),
    nn.Unflatten: Case(
        (12,), {"dim": 1, "unflattened_size": (2, 6)}, ok={"dim": [-1], "unflattened_size": [(3, 4)]}
    ),
    nn.Identity: Case((5,), exempt={"args": "ignored by torch", "kwargs": "ignored by torch"}),
    nn.Upsample: Case(
        (2, 4, 4),
        {"scale_factor": 2},
        ok={
            "size": [With((6, 7), {"scale_factor": None}), With(5, {"scale_factor": None})],
            "scale_factor": [3, (2, 1.5), 0.5],
            "mode": ["bilinear"],
            "align_corners": [With(True, {"mode": "bilinear", "scale_factor": 1.3})],
            "recompute_scale_factor": [With(True, {"scale_factor": 1.3})],
        },
        refused={
            "scale_factor": [1.3, With(1.3, {"mode": "bilinear"})],
            "mode": ["bicubic", "nearest-exact"],
        },
    ),
    PositionalEmbedding: Case(
        (5,), {"block_size": 8, "dim": 4}, ok={"block_size": [5]}, exempt={"dim": SHAPE}, dtype="int64"
    ),
    nn.MultiheadAttention: Case(
        (5, 8),
        {"embed_dim": 8, "num_heads": 2, "batch_first": True},
        ok={
            "num_heads": [4, 1],
            "dropout": [0.2],
            "bias": [False],
            "kdim": [6, With(6, {"vdim": 6})],
            "vdim": [4],
            "batch_first": [False],
            "need_weights": [False],
            "average_attn_weights": [False],
            "attn_mask": [causal_float(5), causal_bool(5), With(causal_bool(5), {"need_weights": False})],
            "is_causal": [With(True, {"attn_mask": causal_float(5), "need_weights": False})],
            **FACTORY,
        },
        refused={
            "attn_mask": [random_mask(5), With(random_mask(5), {"need_weights": False})],
            "key_padding_mask": [torch.zeros(3, 5, dtype=torch.bool)],
            "add_bias_kv": [True],
            "add_zero_attn": [True],
            **FLOAT64,
        },
        exempt={"embed_dim": SHAPE, "query": "the input", "key": "the input", "value": "the input"},
        random=frozenset({"dropout"}),
        call=mha_call,
    ),
    nn.TransformerEncoderLayer: Case(
        (5, 8),
        {"d_model": 8, "nhead": 2, "dim_feedforward": 16, "dropout": 0.0, "batch_first": True},
        ok={
            "nhead": [4],
            "dim_feedforward": [12],
            "dropout": [0.2],
            "activation": ["gelu", F.gelu, nn.GELU(approximate="tanh"), nn.ReLU()],
            "layer_norm_eps": [1e-3],
            "batch_first": [False],
            "norm_first": [True],
            "bias": [False],
            "src_mask": [causal_float(5), causal_bool(5)],
            "is_causal": [With(True, {"src_mask": causal_float(5)})],
            **FACTORY,
        },
        refused={
            "activation": [F.silu, nn.Tanh()],
            "src_mask": [random_mask(5)],
            "src_key_padding_mask": [torch.zeros(3, 5, dtype=torch.bool)],
            **FLOAT64,
        },
        exempt={"d_model": SHAPE, "src": "the input"},
        random=frozenset({"dropout"}),
        call=lambda m, x, kw: seq_call(m, x, kw, m.self_attn.batch_first),
    ),
    nn.TransformerEncoder: Case(
        (5, 8),
        {"enable_nested_tensor": False},
        ok={
            "encoder_layer": [
                nn.TransformerEncoderLayer(8, 4, 12, dropout=0.0, batch_first=True, norm_first=True)
            ],
            "num_layers": [1, 3],
            "norm": [nn.LayerNorm(8)],
            "enable_nested_tensor": [True],
            "mask_check": [False],
            "mask": [causal_float(5), causal_bool(5)],
            "is_causal": [With(True, {"mask": causal_float(5)}), With(False, {"mask": causal_float(5)})],
        },
        refused={
            "encoder_layer": [
                Refuse(
                    nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True, activation=F.silu),
                    "activation",
                )
            ],
            "norm": [nn.BatchNorm1d(5)],
            "mask": [random_mask(5)],
            "src_key_padding_mask": [torch.zeros(3, 5, dtype=torch.bool)],
        },
        exempt={"src": "the input"},
        call=lambda m, x, kw: m(x, **kw),
    ),
}

RNN_COMMON: dict[str, Any] = {
    "ok": {
        "hidden_size": [3],
        "num_layers": [2],
        "bias": [False],
        "batch_first": [False],
        "dropout": [With(0.3, {"num_layers": 2})],
        "bidirectional": [True, With(True, {"num_layers": 2, "batch_first": False})],
        **FACTORY,
    },
    "exempt": {"input_size": SHAPE, "input": "the input"},
    "random": frozenset({"dropout"}),
    "call": rnn_call,
}
HX = Made(lambda m, x: torch.zeros(m.num_layers, x.size(0), m.hidden_size))
MODULE_CASES[nn.LSTM] = Case(
    (6, 4),
    {"input_size": 4, "hidden_size": 5, "batch_first": True},
    refused={"proj_size": [2], "hx": [Made(lambda m, x: (HX.make(m, x), HX.make(m, x)))], **FLOAT64},
    **RNN_COMMON,
)
MODULE_CASES[nn.GRU] = Case(
    (6, 4),
    {"input_size": 4, "hidden_size": 5, "batch_first": True},
    refused={"hx": [HX], **FLOAT64},
    **{**RNN_COMMON, "exempt": {**RNN_COMMON["exempt"], "proj_size": "torch allows it for LSTM only"}},
)
MODULE_CASES[nn.RNN] = Case(
    (6, 4),
    {"input_size": 4, "hidden_size": 5, "batch_first": True},
    refused={"hx": [HX], **FLOAT64},
    **{
        **RNN_COMMON,
        "ok": {**RNN_COMMON["ok"], "nonlinearity": ["relu"]},
        "exempt": {**RNN_COMMON["exempt"], "proj_size": "torch allows it for LSTM only"},
    },
)
MAKERS: dict[type, Callable[..., nn.Module]] = {
    PositionalEmbedding: Positions,
    nn.TransformerEncoder: encoder,
}


def init_params(cls: type) -> list[str]:
    if issubclass(cls, nn.RNNBase):  # LSTM/GRU/RNN take RNNBase's arguments (minus mode) as *args
        names = [p for p in _names(nn.RNNBase.__init__) if p != "mode"]
        return [*names, "nonlinearity"] if cls is nn.RNN else names
    return _names(cls.__init__)


def forward_params(cls: type) -> list[str]:
    return _names(getattr(cls, "forward"))  # noqa: B009 - type has no forward, nn.Module classes do


def _names(fn: Callable[..., Any]) -> list[str]:
    return [p for p in inspect.signature(fn).parameters if p != "self"]


def _split(cls: type, kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    forward = set(forward_params(cls))
    return {k: v for k, v in kwargs.items() if k not in forward}, {
        k: v for k, v in kwargs.items() if k in forward
    }


def module_model(cls: type, case: Case, arg: str, value: Any) -> nn.Module:
    given = value.others if isinstance(value, With) else {}
    kwargs = {**case.base, **given, arg: value.value if isinstance(value, With) else value}
    init, forward = _split(cls, kwargs)
    torch.manual_seed(0)
    return Wrap(MAKERS.get(cls, cls)(**init), case.call, forward)


# ---------------------------------------------------------------- functions and methods


class Fn(nn.Module):
    """Calls the function under test on the input (and on parameters of ``params``' shapes)."""

    def __init__(self, target: Any, case: Case, kwargs: dict[str, Any]) -> None:
        super().__init__()
        self.p = nn.ParameterDict({k: nn.Parameter(torch.randn(s) * 0.5) for k, s in case.params.items()})
        for k, s in case.buffers.items():
            self.register_buffer(k, torch.rand(s) + 0.5)
        self.target, self.call, self.kwargs = target, case.call, kwargs

    def forward(self, x: Tensor) -> Tensor:
        assert self.call is not None
        return self.call(self.target, self, x, dict(self.kwargs))


def method(name: str, t: Tensor, *args: Any, **kwargs: Any) -> Any:
    return getattr(t, name)(*args, **kwargs)


def target_of(key: Any) -> Any:
    if isinstance(key, tuple) and key[0] == "function":  # by qualified name: a package's fx-wrapped function
        import tests.engine.zoo  # noqa: F401 - makes torchvision importable (see there)

        module, name = key[1].rsplit(".", 1)
        # Looked up when called: while tracing, fx.wrap has replaced the module's global with a leaf call.
        return lambda *args, **kwargs: getattr(importlib.import_module(module), name)(*args, **kwargs)
    return partial(method, key[1]) if isinstance(key, tuple) else key


def _operand(s: Fn, x: Tensor, v: Any) -> Any:
    named = {"x": x, "w": s.p["w"]} if "w" in s.p else {"x": x}
    return named.get(v, v) if isinstance(v, str) else v


def _binary(f: Any, s: Fn, x: Tensor, kw: dict[str, Any]) -> Tensor:
    a, b = _operand(s, x, kw.pop("input", "x")), _operand(s, x, kw.pop("other", "w"))
    return f(a, b, **kw)


def _split_call(f: Any, s: Fn, x: Tensor, kw: dict[str, Any]) -> Tensor:
    size = kw.pop("split_size_or_sections", kw.pop("chunks", 2))
    pieces = f(x, size, **kw)
    return torch.cat([pieces[-1], pieces[0]], dim=kw.get("dim", 0))


def _sliced_weight(s: Fn, kw: dict[str, Any]) -> Tensor:
    """The weight for the groups under test: [O, C/groups, ...] from a parameter of C input channels."""
    w = s.p["w"]
    return w[:, : w.shape[1] // kw.get("groups", 1)]


def _pooled(f: Any, s: Fn, x: Tensor, kw: dict[str, Any]) -> Tensor:
    out = f(x, **kw)
    return out[0] if kw.get("return_indices") else out


def _batch_norm_call(f: Any, s: Any, x: Tensor, kw: dict[str, Any]) -> Tensor:
    """As nn.BatchNorm2d (and timm's BatchNormAct2d) call it: training=self.training."""
    given = {"running_mean": s.rm, "running_var": s.rv, "weight": s.p["w"], "bias": s.p["b"]}
    out: Tensor = f(x, **{**given, "training": s.training, **kw})
    return out


TENSOR = "a tensor input"
UNARY: list[Any] = [torch.relu, ("method", "relu"), torch.tanh, F.tanh, ("method", "tanh"), torch.sigmoid]
UNARY += [F.sigmoid, ("method", "sigmoid"), operator.neg, torch.neg, ("method", "neg")]
CAUSAL_KEEP = torch.ones(5, 5, dtype=torch.bool).tril()  # sdpa's convention: True takes part

CALL_CASES: list[tuple[list[Any], Case]] = [
    (UNARY, Case((4,), exempt={"input": TENSOR}, call=lambda f, s, x, kw: f(x, **kw))),
    ([("method", "t")], Case((4,), exempt={"input": TENSOR}, call=lambda f, s, x, kw: f(f(x)))),
    (
        [("method", "contiguous")],
        Case(
            (2, 3, 4),
            ok={"memory_format": [torch.channels_last]},
            exempt={"input": TENSOR},
            call=lambda f, s, x, kw: f(x * 2.0, **kw),
        ),
    ),
    (
        [F.relu, F.silu, F.hardswish, F.hardsigmoid],
        Case(
            (4,), ok={"inplace": [True]}, exempt={"input": TENSOR}, call=lambda f, s, x, kw: f(x * 2.0, **kw)
        ),
    ),
    (
        [F.leaky_relu],
        Case(
            (4,),
            ok={"negative_slope": [0.2], "inplace": [True]},
            exempt={"input": TENSOR},
            call=lambda f, s, x, kw: f(x * 2.0, **kw),
        ),
    ),
    (
        [F.elu],
        Case(
            (4,),
            ok={"alpha": [0.5], "inplace": [True]},
            exempt={"input": TENSOR},
            call=lambda f, s, x, kw: f(x * 2.0, **kw),
        ),
    ),
    (
        [F.gelu],
        Case(
            (4,), ok={"approximate": ["tanh"]}, exempt={"input": TENSOR}, call=lambda f, s, x, kw: f(x, **kw)
        ),
    ),
    (
        [F.softmax, F.log_softmax],
        Case(
            (3, 4),
            {"dim": -1},
            ok={"dim": [1, With(None, {"_x2d": True})], "_stacklevel": [5]},
            refused={"dim": [None], "dtype": [torch.float64]},
            exempt={"input": TENSOR},
            call=lambda f, s, x, kw: f(x[:, 0] if kw.pop("_x2d", False) else x, **kw),
        ),
    ),
    (
        [torch.softmax, ("method", "softmax"), torch.log_softmax, ("method", "log_softmax")],
        Case(
            (3, 4),
            {"dim": -1},
            ok={"dim": [1]},
            refused={"dtype": [torch.float64]},
            exempt={"input": TENSOR},
            call=lambda f, s, x, kw: f(x, **kw),
        ),
    ),
    *[
        (
            [fn],
            Case(
                shape,
                ok={"p": [0.3, 0.0], "training": [False], "inplace": [True]},
                exempt={"input": TENSOR},
                call=lambda f, s, x, kw: f(x * 2.0, **kw),
                eval_random=True,
            ),
        )
        for fn, shape in ((F.dropout, (5,)), (F.dropout1d, (4, 6)), (F.dropout2d, (4, 3, 3)))
    ],
    (
        [torch.flatten, ("method", "flatten")],
        Case(
            (2, 3, 4),
            {"start_dim": 1},
            ok={"start_dim": [2, -2], "end_dim": [2]},
            refused={"start_dim": [0, With(-4, {"end_dim": 2})]},
            exempt={"input": TENSOR},
            call=lambda f, s, x, kw: f(x, **kw),
        ),
    ),
    (
        [torch.reshape, ("method", "reshape")],
        Case(
            (2, 6),
            ok={"sizes": [(-1, 3, 4), (6, -1)]},
            exempt={"input": TENSOR},
            call=lambda f, s, x, kw: f(x, *_sizes(f, x, kw.get("sizes", (12,)))),
        ),
    ),
    (
        [("method", "view")],
        Case(
            (2, 6),
            ok={"sizes": [(-1, 3, 4), (6, -1)]},
            refused={"sizes": [Refuse((torch.int32,), "dtype")]},
            exempt={"input": TENSOR},
            call=lambda f, s, x, kw: f(x, *_sizes(f, x, kw.get("sizes", (12,)))),
        ),
    ),
    (
        [torch.squeeze, ("method", "squeeze")],
        Case((1, 4), ok={"dim": [1, (1,)]}, exempt={"input": TENSOR}, call=lambda f, s, x, kw: f(x, **kw)),
    ),
    (
        [torch.unsqueeze, ("method", "unsqueeze")],
        Case(
            (4,),
            {"dim": 1},
            ok={"dim": [2, -1]},
            exempt={"input": TENSOR},
            call=lambda f, s, x, kw: f(x, **kw),
        ),
    ),
    (
        [torch.permute, ("method", "permute")],
        Case(
            (2, 3, 4),
            ok={"sizes": [(0, 3, 1, 2), (0, 1, 2, 3)]},
            exempt={"input": TENSOR},
            call=lambda f, s, x, kw: f(x, kw.get("sizes", (0, 2, 1, 3))),
        ),
    ),
    (
        [torch.transpose, ("method", "transpose")],
        Case(
            (2, 3, 4),
            {"dim0": 1, "dim1": 2},
            ok={"dim0": [3, -1], "dim1": [3]},
            exempt={"input": TENSOR},
            call=lambda f, s, x, kw: f(x, **kw),
        ),
    ),
    (
        [operator.add, operator.sub, operator.mul],
        Case(
            (4,),
            ok={"input": [With(1.5, {"other": "x"}), With("w", {"other": "x"})], "other": [2.5, 3, "x"]},
            params={"w": (4,)},
            call=_binary,
        ),
    ),
    (
        [operator.truediv],
        Case(
            (4,),
            ok={"input": [With("w", {"other": "x"})], "other": [2.5, "x"]},
            refused={"input": [Refuse(With(1.5, {"other": "x"}), "dividing")]},
            params={"w": (4,)},
            call=_binary,
        ),
    ),
    (
        [torch.add, ("method", "add"), torch.sub, ("method", "sub")],
        Case(
            (4,),
            ok={"other": [2.5, "x"], "alpha": [2, With(0.5, {"other": 3.0})]},
            exempt={"input": TENSOR},
            params={"w": (4,)},
            call=_binary,
        ),
    ),
    (
        [torch.mul, ("method", "mul")],
        Case((4,), ok={"other": [2.5, "x"]}, exempt={"input": TENSOR}, params={"w": (4,)}, call=_binary),
    ),
    (
        [torch.div, ("method", "div")],
        Case(
            (4,),
            ok={"other": [2.5, "x"]},
            refused={"rounding_mode": ["floor", "trunc"]},
            exempt={"input": TENSOR},
            params={"w": (4,)},
            call=_binary,
        ),
    ),
    (
        [operator.matmul, torch.matmul, torch.bmm, ("method", "matmul"), ("method", "bmm")],
        Case(
            (3, 4),
            exempt={"input": TENSOR, "other": TENSOR},
            call=lambda f, s, x, kw: f(x, x.transpose(1, 2)),
        ),
    ),
    (
        [torch.cat, torch.concat],
        Case(
            (3, 4),
            {"dim": 1},
            ok={"dim": [2, -1]},
            refused={"dim": [0]},
            exempt={"tensors": TENSOR},
            call=lambda f, s, x, kw: f([x, x * 2.0], **kw),
        ),
    ),
    (
        [F.linear],
        Case(
            (4,),
            ok={"bias": [None]},
            exempt={"input": TENSOR, "weight": TENSOR},
            params={"w": (5, 4), "b": (5,)},
            call=lambda f, s, x, kw: f(x, s.p["w"], **{"bias": s.p["b"], **kw}),
        ),
    ),
    (
        [F.scaled_dot_product_attention],
        Case(
            (2, 5, 4),
            ok={
                "attn_mask": [CAUSAL_KEEP, causal_float(5)],
                "is_causal": [True],
                "scale": [0.3],
                "enable_gqa": [True],
            },
            refused={"attn_mask": [random_mask(5), ~CAUSAL_KEEP], "dropout_p": [0.1]},
            exempt={"query": TENSOR, "key": TENSOR, "value": TENSOR},
            call=lambda f, s, x, kw: f(x, x * 0.5, x * 2.0, **kw),
        ),
    ),
    (
        [torch.split, ("method", "split")],
        Case(
            (5, 3),
            {"dim": 1},
            ok={"split_size_or_sections": [3, [1, 4]], "dim": [With(-1, {"split_size_or_sections": 2})]},
            refused={"dim": [0]},
            exempt={"input": TENSOR},
            call=_split_call,
        ),
    ),
    (
        [torch.unbind, ("method", "unbind")],
        Case(
            (3, 4),
            {"dim": 1},
            ok={"dim": [2, -1, -2]},
            refused={"dim": [0]},
            exempt={"input": TENSOR},
            call=lambda f, s, x, kw: torch.cat([f(x, **kw)[-1], f(x, **kw)[0]], dim=-1),
        ),
    ),
    (
        [("method", "expand")],
        Case(
            (1, 4),
            # A parameter expanded to the batch (a ViT's class token), times the input expanded.
            ok={"sizes": [(-1, 3, 4), (-1, -1, 4)]},
            exempt={"input": TENSOR},
            params={"w": (1, 3, 4)},
            call=lambda f, s, x, kw: (
                f(x, *kw.get("sizes", (x.size(0), 3, 4))) * f(s.p["w"], x.size(0), -1, -1)
            ),
        ),
    ),
    (
        [("function", "torchvision.ops.stochastic_depth.stochastic_depth")],
        Case(
            (4,),
            {"p": 0.3, "mode": "row"},
            ok={"p": [0.0, 1.0], "training": [False]},
            refused={"mode": ["batch"], "training": [Refuse(True, "training")]},
            exempt={"input": TENSOR},
            call=lambda f, s, x, kw: f(x * 2.0, **{"training": s.training, **kw}),
        ),
    ),
    (
        [F.batch_norm],
        Case(
            (3, 4, 4),
            ok={"momentum": [0.3], "eps": [1e-3]},
            refused={
                "running_mean": [None],
                "running_var": [None],
                "weight": [None],
                "bias": [None],
                "training": [True, False],
                "momentum": [None],
            },
            exempt={"input": TENSOR},
            params={"w": (3,), "b": (3,)},
            buffers={"rm": (3,), "rv": (3,)},
            call=_batch_norm_call,
        ),
    ),
    (
        [torch.chunk, ("method", "chunk")],
        Case(
            (5, 3),
            {"dim": 1},
            ok={"chunks": [3], "dim": [2]},
            refused={"dim": [0]},
            exempt={"input": TENSOR},
            call=_split_call,
        ),
    ),
    (
        [operator.getitem],
        Case(
            (4, 6),
            ok={
                "other": [
                    (slice(None), 0),
                    (slice(None), -1),
                    (slice(None), slice(1, 3)),
                    (Ellipsis, slice(None, 2)),
                    (slice(None), None, slice(2, 5)),
                    (slice(None), slice(1, 3), 2),
                    (slice(None), slice(None), slice(-3, None)),
                ]
            },
            refused={
                "other": [
                    Refuse((slice(None), slice(None, None, 2)), "step"),
                    Refuse(0, "index"),
                    Refuse((slice(1, 3),), "index"),
                    Refuse((slice(None), [0, 2]), "index"),
                ]
            },
            exempt={"input": TENSOR},
            call=lambda f, s, x, kw: f(x, kw.get("other", (slice(None), 1))),
        ),
    ),
    (
        [F.conv1d],
        Case(
            (2, 9),
            ok={
                "stride": [2],
                "padding": [1, "same", "valid"],
                "dilation": [2],
                "groups": [2],
                "bias": [None],
            },
            exempt={"input": TENSOR, "weight": TENSOR},
            params={"w": (4, 2, 3), "b": (4,)},
            call=lambda f, s, x, kw: f(x, _sliced_weight(s, kw), **{"bias": s.p["b"], **kw}),
        ),
    ),
    (
        [F.conv2d],
        Case(
            (2, 9, 9),
            ok={
                "stride": [2],
                "padding": [(1, 0), "same", "valid"],
                "dilation": [2],
                "groups": [2],
                "bias": [None],
            },
            refused={"padding": [With("same", {"_weight": (4, 2, 2, 2)})]},
            exempt={"input": TENSOR, "weight": TENSOR},
            params={"w": (4, 2, 3, 3), "b": (4,), "w_even": (4, 2, 2, 2)},
            call=lambda f, s, x, kw: f(
                x,
                s.p["w_even"] if kw.pop("_weight", None) else _sliced_weight(s, kw),
                **{"bias": s.p["b"], **kw},
            ),
        ),
    ),
    (
        [F.conv_transpose2d],
        Case(
            (2, 5, 5),
            ok={"stride": [2], "padding": [1], "output_padding": [With(1, {"stride": 2})], "bias": [None]},
            refused={"groups": [With(2, {"bias": None})], "dilation": [2]},
            exempt={"input": TENSOR, "weight": TENSOR},
            params={"w": (2, 3, 3, 3), "b": (3,)},
            call=lambda f, s, x, kw: f(x, s.p["w"], **{"bias": s.p["b"], **kw}),
        ),
    ),
    (
        [F.max_pool2d],
        Case(
            (2, 8, 8),
            {"kernel_size": 2},
            ok={"kernel_size": [3], "stride": [1], "padding": [1], "ceil_mode": [True]},
            # return_indices=True makes torch call max_pool2d_with_indices, which is refused by name.
            refused={
                "dilation": [2],
                "return_indices": [Refuse(True, "with_indices")],
                "ceil_mode": [With(True, {"kernel_size": 3})],
            },
            exempt={"input": TENSOR},
            call=_pooled,
        ),
    ),
    (
        [F.avg_pool2d],
        Case(
            (2, 8, 8),
            {"kernel_size": 2},
            ok={
                "kernel_size": [3],
                "stride": [1],
                "padding": [1],
                "ceil_mode": [True],
                "count_include_pad": [False],
                "divisor_override": [3],
            },
            refused={
                "ceil_mode": [With(True, {"kernel_size": 3})],
                "count_include_pad": [With(False, {"padding": 1})],
            },
            exempt={"input": TENSOR},
            call=_pooled,
        ),
    ),
    (
        [F.adaptive_avg_pool2d],
        Case(
            (2, 8, 8),
            {"output_size": 2},
            ok={"output_size": [(3, None), 1]},
            exempt={"input": TENSOR},
            call=lambda f, s, x, kw: f(x, **kw),
        ),
    ),
    (
        [F.layer_norm],
        Case(
            (3, 6),
            {"normalized_shape": (6,)},
            ok={
                "normalized_shape": [With((3, 6), {"weight": None, "bias": None})],
                "weight": [None],
                "bias": [None],
                "eps": [1e-3],
            },
            exempt={"input": TENSOR},
            params={"w": (6,), "b": (6,)},
            call=lambda f, s, x, kw: f(x, **{"weight": s.p["w"], "bias": s.p["b"], **kw}),
        ),
    ),
    (
        [F.group_norm],
        Case(
            (4, 3, 3),
            {"num_groups": 2},
            # weight=None with a bias fails in torch's own backward ("tensor does not have a device").
            ok={"num_groups": [4], "weight": [With(None, {"bias": None})], "bias": [None], "eps": [1e-3]},
            exempt={"input": TENSOR},
            params={"w": (4,), "b": (4,)},
            call=lambda f, s, x, kw: f(x, **{"weight": s.p["w"], "bias": s.p["b"], **kw}),
        ),
    ),
    (
        [F.embedding],
        Case(
            (5,),
            ok={"padding_idx": [0, -1], "norm_type": [1.0]},
            refused={"max_norm": [1.0], "scale_grad_by_freq": [True], "sparse": [True]},
            exempt={"input": TENSOR, "weight": TENSOR},
            params={"w": (10, 4)},
            call=lambda f, s, x, kw: f(x, s.p["w"], **kw),
            dtype="int64",
        ),
    ),
    (
        [F.interpolate],
        Case(
            (2, 4, 4),
            {"scale_factor": 2},
            ok={
                "size": [With((6, 5), {"scale_factor": None}), With(3, {"scale_factor": None})],
                "scale_factor": [(2, 1.5), 0.5],
                "mode": ["bilinear"],
                "align_corners": [With(True, {"mode": "bilinear"})],
                "recompute_scale_factor": [With(True, {"scale_factor": 1.3})],
            },
            refused={
                "scale_factor": [1.3],
                "mode": ["bicubic", "area"],
                "antialias": [With(True, {"mode": "bilinear"})],
            },
            exempt={"input": TENSOR},
            call=lambda f, s, x, kw: f(x, **kw),
        ),
    ),
    (
        [torch.mean, ("method", "mean"), torch.sum, ("method", "sum")],
        Case(
            (3, 4, 5),
            {"dim": -1},
            ok={"dim": [(1, 2), 1, [-2, -1]], "keepdim": [True]},
            refused={"dim": [0, None, (0, 1)], "dtype": [torch.float64]},
            exempt={"input": TENSOR},
            call=lambda f, s, x, kw: f(x, **kw),
        ),
    ),
]


def _sizes(f: Any, x: Tensor, sizes: tuple[Any, ...]) -> tuple[Any, ...]:
    """torch.reshape takes one shape argument; view/reshape methods take the sizes spread out."""
    full = (x.size(0), *sizes) if not isinstance(sizes[0], torch.dtype) else sizes
    return (full,) if f is torch.reshape else full


def call_model(key: Any, case: Case, arg: str, value: Any) -> nn.Module:
    given = value.others if isinstance(value, With) else {}
    kwargs = {**case.base, **given, arg: value.value if isinstance(value, With) else value}
    torch.manual_seed(0)
    return Fn(target_of(key), case, kwargs)


CALL_TABLE: dict[Any, Case] = {key: case for keys, case in CALL_CASES for key in keys}


# ---------------------------------------------------------------- the checks


def example(case: Case, batch: int, seed: int) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    if case.dtype == "int64":
        return torch.randint(0, 10, (batch, *case.shape), generator=g)
    return torch.randn((batch, *case.shape), generator=g)


def assert_parity(model: nn.Module, case: Case, train: bool) -> None:
    """Outputs, loss, gradients and updated buffers of one step; then eval-mode outputs."""
    graph, weights = export_module(model, case.shape, case.dtype, loss="mse")
    ours = GraphModule(load_graph(graph))
    ours.load_state(weights)
    x = example(case, 3, seed=11)
    model.train(train)
    ours.train(train)
    torch.manual_seed(0)
    ref = model(x.clone())
    torch.manual_seed(0)
    out = ours({"x": x.clone()})
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL)
    y = torch.randn(ref.shape, generator=torch.Generator().manual_seed(2))
    loss_ref, loss = F.mse_loss(ref, y), ours.loss(out, {"y": y})
    torch.testing.assert_close(loss, loss_ref, atol=ATOL, rtol=RTOL)
    if loss_ref.requires_grad:  # else the module has no parameters to train
        loss_ref.backward()
        loss.backward()
    _assert_grads_and_state(model, ours, graph)
    if case.eval_random:
        return
    # With gradients enabled, as in training: torch's no-grad fast paths (e.g. TransformerEncoderLayer's)
    # are other kernels, and one of them ignores GELU(approximate="tanh").
    model.eval()
    ours.eval()
    torch.testing.assert_close(ours({"x": x}), model(x), atol=ATOL, rtol=RTOL)


def _assert_grads_and_state(model: nn.Module, ours: GraphModule, graph: dict[str, Any]) -> None:
    grads = ours.grads()
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert set(grads) <= set(trained), set(grads) - set(trained)
    for name, p in trained.items():
        if name in grads:
            expected = torch.zeros_like(p) if p.grad is None else p.grad
            torch.testing.assert_close(grads[name], expected, atol=ATOL, rtol=RTOL, msg=name)
        else:  # a parameter the graph does not use must not influence the module's output either
            assert p.grad is None or not p.grad.any(), name
    state, module_state = ours.state(), dict(model.named_parameters()) | dict(model.named_buffers())
    for spec in graph["buffers"]:
        torch.testing.assert_close(
            state[spec["name"]], module_state[spec["name"]].float(), atol=ATOL, rtol=RTOL
        )


def run_value(model: Callable[[], nn.Module], case: Case, outcome: str, arg: str, value: Any) -> None:
    word = value.word if isinstance(value, Refuse) else arg
    train = arg not in case.random
    try:
        module = model()
    except Exception as exc:  # a table bug: the value must be one torch itself accepts
        raise AssertionError(f"torch refuses {arg}={value!r}: {exc}") from exc
    try:
        assert_parity(module, case, train)
    except ExportError as exc:
        assert outcome in ("refused", "either"), f"{arg}={value!r} must export, but: {exc}"
        assert word in str(exc), f"the refusal of {arg}={value!r} does not name {word!r}: {exc}"
        return
    assert outcome in ("ok", "either"), f"{arg}={value!r} exported, but the graph cannot honour it"


def _module_params() -> Iterator[Any]:
    for cls, case in MODULE_CASES.items():
        for outcome, arg, value in case.values():
            yield pytest.param(cls, outcome, arg, value, id=f"{cls.__name__}-{arg}-{_short(value)}")


def _call_params() -> Iterator[Any]:
    for keys, case in CALL_CASES:
        for key in keys:
            for outcome, arg, value in case.values():
                yield pytest.param(key, outcome, arg, value, id=f"{_name(key)}-{arg}-{_short(value)}")


def _name(key: Any) -> str:
    if isinstance(key, tuple):
        return key[1] if key[0] == "function" else f"Tensor.{key[1]}"
    return f"{key.__module__}.{key.__name__}"


def _short(value: Any) -> str:
    v = value.value if isinstance(value, (With, Refuse)) else value
    if callable(v) and hasattr(v, "__name__"):  # a function's repr has its address: the same in every worker
        return v.__name__
    return type(v).__name__ if isinstance(v, (Tensor, nn.Module)) else repr(v)[:30]


@pytest.mark.parametrize(("cls", "outcome", "arg", "value"), list(_module_params()))
def test_module_argument(cls: type, outcome: str, arg: str, value: Any) -> None:
    case = MODULE_CASES[cls]
    plain = value.value if isinstance(value, Refuse) else value
    run_value(lambda: module_model(cls, case, arg, plain), case, outcome, arg, value)


@pytest.mark.parametrize(("key", "outcome", "arg", "value"), list(_call_params()))
def test_call_argument(key: Any, outcome: str, arg: str, value: Any) -> None:
    case = CALL_TABLE[key]
    plain = value.value if isinstance(value, Refuse) else value
    run_value(lambda: call_model(key, case, arg, plain), case, outcome, arg, value)


@pytest.mark.parametrize("cls", list(MODULE_CASES), ids=lambda c: c.__name__)
def test_module_base_case_matches(cls: type) -> None:
    case = MODULE_CASES[cls]
    init, forward = _split(cls, case.base)
    torch.manual_seed(0)
    assert_parity(Wrap(MAKERS.get(cls, cls)(**init), case.call, forward), case, True)


@pytest.mark.parametrize("key", list(CALL_TABLE), ids=_name)
def test_call_base_case_matches(key: Any) -> None:
    case = CALL_TABLE[key]
    torch.manual_seed(0)
    assert_parity(Fn(target_of(key), case, dict(case.base)), case, True)


# ---------------------------------------------------------------- the tables cover every handler and argument


def test_every_module_handler_has_a_case() -> None:
    assert set(MODULE_HANDLERS) == set(MODULE_CASES)


def test_every_call_handler_has_a_case() -> None:
    assert set(CALL_HANDLERS) == set(CALL_TABLE), set(CALL_HANDLERS) ^ set(CALL_TABLE)


def _covered(case: Case) -> set[str]:
    return {*case.ok, *case.refused, *case.either, *case.exempt}


@pytest.mark.parametrize("cls", list(MODULE_CASES), ids=lambda c: c.__name__)
def test_every_module_argument_is_tried(cls: type) -> None:
    args = [*init_params(cls), *forward_params(cls)[1:]]  # forward's first argument is the input
    missing = [a for a in args if a not in _covered(MODULE_CASES[cls])]
    assert not missing, f"{cls.__name__}: no value tried for {missing}"


@pytest.mark.parametrize("key", list(CALL_TABLE), ids=_name)
def test_every_call_argument_is_tried(key: Any) -> None:
    signature = CALL_HANDLERS[key][0]
    missing = [a for a in _names(signature) if a not in _covered(CALL_TABLE[key])]
    assert not missing, f"{_name(key)}: no value tried for {missing}"


def _torch_params(fn: Any) -> list[str] | None:
    """torch's own parameter names for a torch.nn.functional function (Python or ATen builtin)."""
    try:
        names = _names(fn)
    except ValueError:  # a builtin: read its ATen schema
        schemas = torch._C._jit_get_schemas_for_operator(f"aten::{fn.__name__}")
        plain = [s for s in schemas if s.overload_name == ""]
        if not plain:
            return None
        return ["input" if a.name == "self" else a.name for a in plain[0].arguments]
    return None if "args" in names else names


@pytest.mark.parametrize(
    "key", [k for k in CALL_HANDLERS if getattr(k, "__module__", "") == F.__name__], ids=_name
)
def test_functional_signatures_are_torchs(key: Any) -> None:
    """The signature the exporter binds F.* calls with has exactly torch's parameters (so none is unknown)."""
    theirs = _torch_params(key)
    if theirs is None:
        pytest.skip(f"no inspectable signature for {_name(key)}")
    assert _names(CALL_HANDLERS[key][0]) == theirs
