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
    weight, pad = _t(a, 1), at["padding_idx"]
    # F.embedding asserts the range (AssertionError, which graph validation would not report as such).
    if pad is not None and not -weight.shape[0] <= pad < weight.shape[0]:
        raise ValueError(f"padding_idx {pad} is outside the table of {weight.shape[0]} rows")
    return F.embedding(_t(a, 0), weight, padding_idx=pad)


def _gelu(a: Args, at: Attrs, training: bool) -> Tensor:
    return F.gelu(_t(a, 0), approximate=at["approximate"])


def _dropout(a: Args, at: Attrs, training: bool) -> Tensor:
    return F.dropout(_t(a, 0), at["p"], training)


def _dropout2d(a: Args, at: Attrs, training: bool) -> Tensor:
    x, p = _t(a, 0), at["p"]
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    # What F.dropout2d computes (one draw per sample and channel of [N, C, ...]), without the warnings
    # it gives for inputs other than 4-D.
    return torch.feature_dropout(x, p, training)


def _group_norm(a: Args, at: Attrs, training: bool) -> Tensor:
    return F.group_norm(_t(a, 0), at["num_groups"], a[1], a[2], at["eps"])


def _reduce(fn: Callable[..., Tensor]) -> OpFn:
    # Empty dims reduce over every dim, as torch.sum(x, []) / torch.mean(x, []) do.
    return lambda a, at, training: fn(_t(a, 0), list(at["dims"]), keepdim=at["keepdim"])


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


def _interpolate(a: Args, at: Attrs, training: bool) -> Tensor:
    x, size = _t(a, 0), tuple(at["size"])
    if x.dim() != 4:
        raise ValueError(f"interpolate needs a 4-D input [N, C, H, W], got {list(x.shape)}")
    if min(size) < 1:  # torch's meta kernels would divide by zero rather than say so
        raise ValueError(f"size must be positive, got {list(size)}")
    if at["mode"] == "nearest":
        # torch refuses align_corners for nearest (even False): the graph says false, torch wants None.
        if at["align_corners"]:
            raise ValueError("align_corners applies to mode 'bilinear' only")
        return F.interpolate(x, size=size, mode="nearest")
    return F.interpolate(x, size=size, mode="bilinear", align_corners=at["align_corners"])


def _conv_transpose2d(a: Args, at: Attrs, training: bool) -> Tensor:
    stride, padding, extra = at["stride"], at["padding"], at["output_padding"]
    # torch checks these only when it computes, not on the meta tensors graph validation runs on.
    if min(stride) < 1 or min(padding) < 0 or min(extra) < 0:
        raise ValueError(
            f"need stride >= 1, padding >= 0, output_padding >= 0; got {stride} {padding} {extra}"
        )
    if any(e >= s for e, s in zip(extra, stride, strict=True)):
        raise ValueError(f"output_padding {extra} must be smaller than the stride {stride}")
    x, w, b = _t(a, 0), _t(a, 1), a[2]
    _check_transposed_shapes(x, w, b)
    return F.conv_transpose2d(x, w, b, stride, padding, extra)


def _check_transposed_shapes(x: Tensor, w: Tensor, b: Tensor | None) -> None:
    # On meta tensors torch checks none of these (it also takes an unbatched 3-D x, which we do not).
    if x.dim() != 4 or w.dim() != 4 or x.shape[1] != w.shape[0]:
        raise ValueError(f"need x [N, C, H, W], weight [C, out, kh, kw]; got {list(x.shape)} {list(w.shape)}")
    if b is not None and list(b.shape) != [w.shape[1]]:
        raise ValueError(f"bias must have shape [{w.shape[1]}], got {list(b.shape)}")


def _expand(a: Args, at: Attrs, training: bool) -> Tensor:
    # -1 is the batch size, read off `like` (the graph input); never torch's "keep this size".
    batch = _t(a, 1).shape[0]
    return _t(a, 0).expand([batch if s == -1 else s for s in at["shape"]])


def _drop_path(a: Args, at: Attrs, training: bool) -> Tensor:
    """Stochastic depth, torchvision's mode "row": each sample is zeroed with probability p, the rest
    scaled by 1 / (1 - p); the identity in eval mode. Draws as torchvision does (one bernoulli_ per call)."""
    x, p = _t(a, 0), at["p"]
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"drop probability has to be between 0 and 1, but got {p}")
    if not training or p == 0.0:
        return x
    noise = torch.empty([x.shape[0]] + [1] * (x.dim() - 1), dtype=x.dtype, device=x.device)
    noise.bernoulli_(1.0 - p)
    return x * (noise / (1.0 - p) if p < 1.0 else noise)


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
    "interpolate": _interpolate,
    "conv_transpose2d": _conv_transpose2d,
    "silu": _unary(F.silu),
    "hardswish": _unary(F.hardswish),
    "hardsigmoid": _unary(F.hardsigmoid),
    "leaky_relu": lambda a, at, tr: F.leaky_relu(_t(a, 0), at["negative_slope"]),
    "elu": lambda a, at, tr: F.elu(_t(a, 0), at["alpha"]),
    "group_norm": _group_norm,
    "reduce_mean": _reduce(torch.mean),
    "reduce_sum": _reduce(torch.sum),
    "add_scalar": lambda a, at, tr: _t(a, 0) + at["value"],
    "dropout2d": _dropout2d,
    "expand": _expand,
    "drop_path": _drop_path,
}


def run_op(op: str, args: Args, attrs: Attrs, training: bool) -> Tensor:
    return OPS[op](args, attrs, training)


def check_loss_shapes(op: str, pred: Tensor, target: Tensor, weight: Tensor | None = None) -> None:
    """Raise ValueError unless ``pred``/``target`` (and the class ``weight``) fit the loss (torch alone
    would broadcast or reinterpret float targets as probabilities instead of failing)."""
    if pred.dtype != torch.float32:
        raise ValueError(f"prediction must be float32, got {pred.dtype}")
    p, t = list(pred.shape), list(target.shape)
    if op in ("mse", "l1"):
        if p != t or target.dtype != torch.float32:
            raise ValueError(f"{op} needs a float32 target of shape {p}, got {t} {target.dtype}")
        return
    _check_class_shapes(p, t, target.dtype, weight)


def _check_class_shapes(p: list[int], t: list[int], dtype: torch.dtype, weight: Tensor | None) -> None:
    if dtype != torch.int64:
        raise ValueError(f"cross_entropy needs int64 class targets, got {dtype}")
    if len(p) not in (2, 3) or p[:-1] != t:
        raise ValueError(
            f"cross_entropy needs logits [N,C] / [N,T,C] with targets [N] / [N,T]; "
            f"got logits {p} and targets {t}"
        )
    if weight is not None and list(weight.shape) != p[-1:]:
        raise ValueError(f"class weights must have shape [{p[-1]}] (one per class), got {list(weight.shape)}")


def loss_attrs(op: str, attrs: Attrs | None = None) -> dict[str, Any]:
    """The loss's attrs over engine/spec.json's defaults (a loaded graph's are already complete)."""
    defaults = {k: a["default"] for k, a in spec.GRAPH["losses"][op].get("attrs", {}).items()}
    return {**defaults, **(attrs or {})}


def run_loss(
    op: str, pred: Tensor, target: Tensor, attrs: Attrs | None = None, weight: Tensor | None = None
) -> Tensor:
    if op == "mse":
        return F.mse_loss(pred, target)
    if op == "l1":
        return F.l1_loss(pred, target)
    at = loss_attrs(op, attrs)
    if loss_denominator(op, target, at, weight) == 0:
        # Every target ignored (or weighted 0): torch's mean is 0/0, NaN. An honest volunteer's batch must
        # not look invalid, so it is the sum over nothing: loss 0 and zero gradients (docs/graph-format.md).
        return pred.sum() * 0.0
    # Sequence targets: torch's mean over batch and positions (weighted by the targets' class weights,
    # ignored positions left out) is the mean over the flattened rows.
    return F.cross_entropy(
        pred.reshape(-1, pred.shape[-1]),
        target.reshape(-1),
        weight=weight,
        ignore_index=at["ignore_index"],
        label_smoothing=at["label_smoothing"],
    )


def loss_denominator(
    op: str, target: Tensor, attrs: Attrs | None = None, weight: Tensor | None = None
) -> float:
    """What run_loss's mean divides by: the target's elements, or for cross_entropy the summed class
    weights (1 without weights) of the targets that are not ignore_index. Chunked means combine by it."""
    if op != "cross_entropy":
        return float(target.numel())
    kept = target[target != loss_attrs(op, attrs)["ignore_index"]]
    return float(kept.numel() if weight is None else weight[kept].sum())


LOSSES: tuple[str, ...] = tuple(spec.GRAPH["losses"])
