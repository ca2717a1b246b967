"""The graph operations as torch functions, shared by the runtime and by shape inference.

Shape inference runs these same functions on ``meta`` tensors, so the validator and the runtime can
never disagree about what a graph computes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from engine import spec

Args = Sequence[Tensor | None]
Attrs = Mapping[str, Any]
OpFn = Callable[[Args, Attrs, bool], Tensor]


def _t(args: Args, i: int) -> Tensor:
    value = args[i]
    if value is None:
        raise ValueError(f"input {i} is required")
    return value


def _linear(a: Args, at: Attrs, training: bool) -> Tensor:
    return F.linear(_t(a, 0), _t(a, 1), a[2])


def _conv2d(a: Args, at: Attrs, training: bool) -> Tensor:
    return F.conv2d(_t(a, 0), _t(a, 1), a[2], at["stride"], at["padding"], at["dilation"], at["groups"])


def _batch_norm(a: Args, at: Attrs, training: bool) -> Tensor:
    # F.batch_norm updates the running stats in place in training mode (unbiased variance).
    return F.batch_norm(_t(a, 0), _t(a, 3), _t(a, 4), a[1], a[2], training, at["momentum"], at["eps"])


def _layer_norm(a: Args, at: Attrs, training: bool) -> Tensor:
    return F.layer_norm(_t(a, 0), list(at["normalized_shape"]), a[1], a[2], at["eps"])


def _embedding(a: Args, at: Attrs, training: bool) -> Tensor:
    return F.embedding(_t(a, 0), _t(a, 1))


def _gelu(a: Args, at: Attrs, training: bool) -> Tensor:
    return F.gelu(_t(a, 0), approximate=at["approximate"])


def _dropout(a: Args, at: Attrs, training: bool) -> Tensor:
    return F.dropout(_t(a, 0), at["p"], training)


def _max_pool2d(a: Args, at: Attrs, training: bool) -> Tensor:
    return F.max_pool2d(_t(a, 0), at["kernel_size"], at["stride"], at["padding"])


def _avg_pool2d(a: Args, at: Attrs, training: bool) -> Tensor:
    return F.avg_pool2d(_t(a, 0), at["kernel_size"], at["stride"], at["padding"])


def _sdpa(a: Args, at: Attrs, training: bool) -> Tensor:
    return F.scaled_dot_product_attention(_t(a, 0), _t(a, 1), _t(a, 2), is_causal=at["is_causal"])


def _arange_embedding(a: Args, at: Attrs, training: bool) -> Tensor:
    x = _t(a, 0)
    if x.dim() < 2:
        raise ValueError(f"expected ids of shape [B, T], got {list(x.shape)}")
    # narrow (not slicing) so a sequence longer than the table is an error, not silent truncation.
    return _t(a, 1).narrow(0, 0, x.shape[1])


def _unary(fn: Callable[[Tensor], Tensor]) -> OpFn:
    return lambda a, at, training: fn(_t(a, 0))


def _binary(fn: Callable[[Tensor, Tensor], Tensor]) -> OpFn:
    return lambda a, at, training: fn(_t(a, 0), _t(a, 1))


# One implementation per op of engine/spec.json (tests/engine/test_ops.py holds them to it).
OPS: dict[str, OpFn] = {
    "linear": _linear,
    "conv2d": _conv2d,
    "batch_norm": _batch_norm,
    "layer_norm": _layer_norm,
    "embedding": _embedding,
    "relu": _unary(torch.relu),
    "tanh": _unary(torch.tanh),
    "sigmoid": _unary(torch.sigmoid),
    "gelu": _gelu,
    "softmax": lambda a, at, tr: torch.softmax(_t(a, 0), at["dim"]),
    "log_softmax": lambda a, at, tr: torch.log_softmax(_t(a, 0), at["dim"]),
    "dropout": _dropout,
    "max_pool2d": _max_pool2d,
    "avg_pool2d": _avg_pool2d,
    "adaptive_avg_pool2d": lambda a, at, tr: F.adaptive_avg_pool2d(_t(a, 0), at["output_size"]),
    "flatten": lambda a, at, tr: torch.flatten(_t(a, 0), at["start_dim"], at["end_dim"]),
    "reshape": lambda a, at, tr: _t(a, 0).reshape(at["shape"]),
    "permute": lambda a, at, tr: _t(a, 0).permute(at["dims"]),
    "transpose": lambda a, at, tr: _t(a, 0).transpose(at["dim0"], at["dim1"]),
    "add": _binary(torch.add),
    "sub": _binary(torch.sub),
    "mul": _binary(torch.mul),
    "div": _binary(torch.div),
    "scale": lambda a, at, tr: _t(a, 0) * at["factor"],
    "matmul": _binary(torch.matmul),
    "concat": lambda a, at, tr: torch.cat([_t(a, i) for i in range(len(a))], at["dim"]),
    "split": lambda a, at, tr: _t(a, 0).narrow(at["dim"], at["start"], at["length"]),
    "scaled_dot_product_attention": _sdpa,
    "arange_embedding": _arange_embedding,
}


def run_op(op: str, args: Args, attrs: Attrs, training: bool) -> Tensor:
    return OPS[op](args, attrs, training)


def check_loss_shapes(op: str, pred: Tensor, target: Tensor) -> None:
    """Raise ValueError unless ``pred``/``target`` fit the loss (torch alone would broadcast or
    reinterpret float targets as probabilities instead of failing)."""
    p, t = list(pred.shape), list(target.shape)
    if pred.dtype != torch.float32:
        raise ValueError(f"prediction must be float32, got {pred.dtype}")
    if op == "mse":
        if p != t or target.dtype != torch.float32:
            raise ValueError(f"mse needs a float32 target of shape {p}, got {t} {target.dtype}")
        return
    if target.dtype != torch.int64:
        raise ValueError(f"cross_entropy needs int64 class targets, got {target.dtype}")
    if len(p) not in (2, 3) or p[:-1] != t:
        raise ValueError(
            f"cross_entropy needs logits [N,C] / [N,T,C] with targets [N] / [N,T]; "
            f"got logits {p} and targets {t}"
        )


def run_loss(op: str, pred: Tensor, target: Tensor) -> Tensor:
    if op == "mse":
        return F.mse_loss(pred, target)
    # Sequence targets: the mean over batch and positions equals the mean over flattened rows.
    return F.cross_entropy(pred.reshape(-1, pred.shape[-1]), target.reshape(-1))


LOSSES: tuple[str, ...] = tuple(spec.GRAPH["losses"])
