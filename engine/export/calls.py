"""Handlers for functions and Tensor methods. Each binds the call to the Python signature below (so every
argument has a name), and either honours each argument or refuses it by name."""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from . import build
from .attention import sdpa_call
from .core import Bound, CallEntry, CallHandler, Exporter, ExportError, Ref, Refused


# Python signatures of the supported functions/methods, used only to bind fx args by name. Each spelling
# gets the parameters torch gives it, so none is accepted here that torch would not honour.
def _s_x(input: Any) -> None: ...
def _s_x_inplace(input: Any, inplace: bool = False) -> None: ...
def _s_leaky_relu(input: Any, negative_slope: float = 0.01, inplace: bool = False) -> None: ...
def _s_elu(input: Any, alpha: float = 1.0, inplace: bool = False) -> None: ...
def _s_gelu(input: Any, approximate: str = "none") -> None: ...
def _s_softmax_f(input: Any, dim: Any = None, _stacklevel: int = 3, dtype: Any = None) -> None: ...
def _s_softmax(input: Any, dim: Any, dtype: Any = None) -> None: ...
def _s_dropout(input: Any, p: float = 0.5, training: bool = True, inplace: bool = False) -> None: ...
def _s_flatten(input: Any, start_dim: int = 0, end_dim: int = -1) -> None: ...
def _s_var(input: Any, *sizes: Any) -> None: ...
def _s_transpose(input: Any, dim0: int, dim1: int) -> None: ...
def _s_contiguous(input: Any, memory_format: Any = torch.contiguous_format) -> None: ...
def _s_addsub(input: Any, other: Any, alpha: Any = 1) -> None: ...
def _s_div(input: Any, other: Any, rounding_mode: Any = None) -> None: ...
def _s_ab(input: Any, other: Any) -> None: ...
def _s_cat(tensors: Any, dim: int = 0) -> None: ...
def _s_linear(input: Any, weight: Any, bias: Any = None) -> None: ...
def _s_split(input: Any, split_size_or_sections: Any, dim: int = 0) -> None: ...
def _s_chunk(input: Any, chunks: int, dim: int = 0) -> None: ...
def _s_unbind(input: Any, dim: int = 0) -> None: ...
def _s_squeeze(input: Any, dim: Any = None) -> None: ...
def _s_unsqueeze(input: Any, dim: int) -> None: ...
def _s_reduce(input: Any, dim: Any = None, keepdim: bool = False, dtype: Any = None) -> None: ...
def _s_conv(
    input: Any,
    weight: Any,
    bias: Any = None,
    stride: Any = 1,
    padding: Any = 0,
    dilation: Any = 1,
    groups: int = 1,
) -> None: ...
def _s_conv_transpose(
    input: Any,
    weight: Any,
    bias: Any = None,
    stride: Any = 1,
    padding: Any = 0,
    output_padding: Any = 0,
    groups: int = 1,
    dilation: Any = 1,
) -> None: ...
def _s_max_pool2d(
    input: Any,
    kernel_size: Any,
    stride: Any = None,
    padding: Any = 0,
    dilation: Any = 1,
    ceil_mode: bool = False,
    return_indices: bool = False,
) -> None: ...
def _s_avg_pool2d(
    input: Any,
    kernel_size: Any,
    stride: Any = None,
    padding: Any = 0,
    ceil_mode: bool = False,
    count_include_pad: bool = True,
    divisor_override: Any = None,
) -> None: ...
def _s_adaptive(input: Any, output_size: Any) -> None: ...
def _s_layer_norm(
    input: Any, normalized_shape: Any, weight: Any = None, bias: Any = None, eps: float = 1e-5
) -> None: ...
def _s_group_norm(
    input: Any, num_groups: int, weight: Any = None, bias: Any = None, eps: float = 1e-5
) -> None: ...
def _s_embedding(
    input: Any,
    weight: Any,
    padding_idx: Any = None,
    max_norm: Any = None,
    norm_type: float = 2.0,
    scale_grad_by_freq: bool = False,
    sparse: bool = False,
) -> None: ...
def _s_interpolate(
    input: Any,
    size: Any = None,
    scale_factor: Any = None,
    mode: str = "nearest",
    align_corners: Any = None,
    recompute_scale_factor: Any = None,
    antialias: bool = False,
) -> None: ...
def _s_stochastic_depth(input: Any, p: float, mode: str, training: bool = True) -> None: ...
def _s_batch_norm(
    input: Any,
    running_mean: Any,
    running_var: Any,
    weight: Any = None,
    bias: Any = None,
    training: bool = False,
    momentum: Any = 0.1,
    eps: float = 1e-5,
) -> None: ...
def _s_sdpa(
    query: Any,
    key: Any,
    value: Any,
    attn_mask: Any = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Any = None,
    enable_gqa: bool = False,
) -> None: ...


def _x(e: Exporter, b: Bound, what: str) -> Ref:
    return e.ref(b["input"], what)


def _unary(op: str, *attrs: str) -> CallHandler:
    """A one-input op; attrs are passed through by name. inplace is checked, never dropped."""

    def handler(e: Exporter, n: fx.Node, b: Bound, what: str) -> Ref:
        if e.const(b.get("inplace", False), what):
            e.check_inplace(n, b["input"], what)
        return e.emit(n.name, op, [_x(e, b, what)], **{k: e.const(b[k], what) for k in attrs})

    return handler


def _softmax(op: str) -> CallHandler:
    def handler(e: Exporter, n: fx.Node, b: Bound, what: str) -> Ref:
        # _stacklevel only picks the frame of a deprecation warning.
        if b["dtype"] is not None:
            raise e.refuse(what, "dtype", e.const(b["dtype"], what), "graph tensors stay float32")
        dim = build.softmax_dim(e, what, e.const(b["dim"], what), b["input"])
        return e.emit(n.name, op, [_x(e, b, what)], dim=dim)

    return handler


def _dropout(op: str, rank: int | None = None) -> CallHandler:
    def handler(e: Exporter, n: fx.Node, b: Bound, what: str) -> Ref:
        if rank is not None and len(e.shape(b["input"])) != rank:
            raise e.fail(what, f"only batched {rank}-D inputs, got shape {e.shape(b['input'])}")
        if e.const(b["inplace"], what):
            e.check_inplace(n, b["input"], what)
        p, training = float(e.const(b["p"], what)), bool(e.const(b["training"], what))
        return build.dropout(e, n.name, op, _x(e, b, what), p, training)

    return handler


TORCHVISION_STOCHASTIC_DEPTH = "torchvision.ops.stochastic_depth.stochastic_depth"  # fx-wrapped: a leaf


def _stochastic_depth(e: Exporter, n: fx.Node, b: Bound, what: str) -> Ref:
    """torchvision.ops.stochastic_depth: mode "row" with training=self.training is the graph's drop_path."""
    p, mode = float(e.const(b["p"], what)), e.const(b["mode"], what)
    if not 0.0 <= p <= 1.0:
        raise e.refuse(what, "p", p, "a probability is between 0 and 1")
    if mode != "row":
        raise e.refuse(what, "mode", mode, 'only "row" (one draw per sample)')
    training = bool(e.const(b["training"], what))
    if e.eval_const(n, _s_stochastic_depth, "training", what):
        raise e.refuse(what, "training", True, "it stays random in eval mode, the graph's drop_path does not")
    return build.dropout(e, n.name, "drop_path", _x(e, b, what), p, training)


def _batch_norm(e: Exporter, n: fx.Node, b: Bound, what: str) -> Ref:
    """F.batch_norm as nn.BatchNorm2d calls it (timm's BatchNormAct2d does): batch statistics while training,
    the running ones in eval mode, which is what the graph's batch_norm does with the interpreter's mode."""
    training = bool(e.const(b["training"], what))
    if not training or e.eval_const(n, _s_batch_norm, "training", what):
        why = "the graph's batch_norm uses batch statistics exactly when training (pass self.training)"
        raise e.refuse(what, "training", training, why)
    momentum = e.const(b["momentum"], what)
    if momentum is None:
        raise e.refuse(what, "momentum", None, "the cumulative moving average is not supported")
    refs = [e.opt_ref(b[k], what) for k in ("weight", "bias", "running_mean", "running_var")]
    if None in refs:
        missing = ("weight", "bias", "running_mean", "running_var")[refs.index(None)]
        raise e.refuse(what, missing, None, "the graph's batch_norm needs all four tensors")
    eps = float(e.const(b["eps"], what))
    return e.emit(n.name, "batch_norm", [_x(e, b, what), *refs], eps=eps, momentum=float(momentum))


def _flatten(e: Exporter, n: fx.Node, b: Bound, what: str) -> Ref:
    start, end = e.const(b["start_dim"], what), e.const(b["end_dim"], what)
    build.check_flatten(e, what, b["input"], start, end)
    return e.emit(n.name, "flatten", [_x(e, b, what)], start_dim=start, end_dim=end)


def _reshape(e: Exporter, n: fx.Node, b: Bound, what: str) -> Ref:
    """view/reshape/squeeze/unsqueeze: the target shape is the recorded one, batch written -1."""
    # Sizes may depend on the batch (x.size(0)): only their recorded output shape matters, never a dtype.
    sizes = [e.runs[0].get(s) if isinstance(s, fx.Node) else s for s in b.get("sizes", ())]
    if any(isinstance(s, torch.dtype) for s in sizes):
        raise e.refuse(what, "dtype", sizes[0], "graph tensors stay float32")
    return e.emit(n.name, "reshape", [_x(e, b, what)], shape=e.batch_shape(n, what))


def _expand(e: Exporter, n: fx.Node, b: Bound, what: str) -> Ref:
    """x.expand(sizes) as the recorded shape; a size that follows the batch must be the batch size itself,
    which the graph's expand reads off the graph input "x" (its first dimension)."""
    sizes = [e.runs[0].get(s) if isinstance(s, fx.Node) else s for s in b["sizes"]]
    if any(isinstance(s, torch.dtype) for s in sizes):
        raise e.refuse(what, "sizes", sizes, "a dtype")
    dim = e.batch_dim(n, what)
    if dim is not None and [run[n].shape[dim] for run in e.runs] != [2, 3]:
        raise e.refuse(what, "sizes", sizes, "a size that is a multiple of the batch size")
    return e.emit(n.name, "expand", [_x(e, b, what), "x"], shape=e.batch_shape(n, what))


def _permute(e: Exporter, n: fx.Node, b: Bound, what: str) -> Ref:
    sizes = e.const(b["sizes"], what)
    dims = list(sizes[0]) if len(sizes) == 1 and isinstance(sizes[0], (list, tuple)) else list(sizes)
    return e.emit(n.name, "permute", [_x(e, b, what)], dims=dims)


def _transpose(e: Exporter, n: fx.Node, b: Bound, what: str) -> Ref:
    dims = {k: e.const(b[k], what) for k in ("dim0", "dim1")}
    return e.emit(n.name, "transpose", [_x(e, b, what)], **dims)


def _t(e: Exporter, n: fx.Node, b: Bound, what: str) -> Ref:
    if len(e.shape(b["input"])) != 2:
        raise e.fail(what, "only 2-D tensors")
    return e.emit(n.name, "transpose", [_x(e, b, what)], dim0=0, dim1=1)


def _identity(e: Exporter, n: fx.Node, b: Bound, what: str) -> Ref:
    # memory_format only changes strides, never values.
    return _x(e, b, what)


def _neg(e: Exporter, n: fx.Node, b: Bound, what: str) -> Ref:
    return e.emit(n.name, "scale", [_x(e, b, what)], factor=-1.0)


def _arith(op: str) -> CallHandler:
    def handler(e: Exporter, n: fx.Node, b: Bound, what: str) -> Ref:
        if b.get("rounding_mode") is not None:
            raise e.refuse(what, "rounding_mode", e.const(b["rounding_mode"], what))
        a, c, alpha = b["input"], b["other"], e.const(b.get("alpha", 1), what)
        if not (e.is_tensor(a) and e.is_tensor(c)):
            return _scalar_arith(e, n, op, a, c, alpha, what)
        other = e.ref(c, what)
        if alpha != 1:  # torch.add(a, b, alpha=k) is a + k * b
            other = e.emit(e.sub(n, "alpha"), "scale", [other], factor=float(alpha))
        return e.emit(n.name, op, [e.ref(a, what), other])

    return handler


def _scalar_arith(e: Exporter, n: fx.Node, op: str, a: Any, c: Any, alpha: Any, what: str) -> Ref:
    """A tensor with a Python number: scale for * and /, add_scalar for + and -."""
    tensor_first = e.is_tensor(a)
    tensor, scalar = (a, c) if tensor_first else (c, a)
    value = e.const(scalar, what)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value * alpha):
        raise e.fail(
            what, f"the other operand must be a tensor from the graph or a finite number, got {value!r}"
        )
    x, value = e.ref(tensor, what), float(value * alpha)
    if op == "mul" or op == "div" and tensor_first:
        # Division by a constant becomes a scale by its reciprocal (within 1 ulp).
        return e.emit(n.name, "scale", [x], factor=value if op == "mul" else 1.0 / value)
    if op == "add" or op == "sub" and tensor_first:
        return e.emit(n.name, "add_scalar", [x], value=value if op == "add" else -value)
    if op == "sub":  # number - tensor
        negated = e.emit(e.sub(n, "neg"), "scale", [x], factor=-1.0)
        return e.emit(n.name, "add_scalar", [negated], value=value)
    raise e.fail(what, "dividing a Python number by a tensor is not supported")


def _matmul(e: Exporter, n: fx.Node, b: Bound, what: str) -> Ref:
    return e.emit(n.name, "matmul", [e.ref(b["input"], what), e.ref(b["other"], what)])


def _cat(e: Exporter, n: fx.Node, b: Bound, what: str) -> Ref:
    parts, dim = [e.ref(t, what) for t in b["tensors"]], e.const(b["dim"], what)
    if dim % len(e.shape(n)) == e.batch_dim(n, what):
        raise e.refuse(what, "dim", dim, "concatenating along the batch dimension")
    return e.emit(n.name, "concat", parts, dim=dim)


def _linear(e: Exporter, n: fx.Node, b: Bound, what: str) -> Ref:
    inputs = [_x(e, b, what), e.ref(b["weight"], what), e.opt_ref(b["bias"], what)]
    return e.emit(n.name, "linear", inputs)


def _split(e: Exporter, n: fx.Node, b: Bound, what: str) -> tuple[Ref, ...]:
    """split/chunk: one graph `split` slice per piece, read back by getitem."""
    x = _x(e, b, what)
    dim = e.const(b["dim"], what)
    pieces = e.runs[0][n]
    rank = len(pieces[0].shape)
    if dim % rank == e.batch_dim(b["input"], what):
        raise e.refuse(what, "dim", dim, "splitting the batch dimension")
    refs, start = [], 0
    for i, piece in enumerate(pieces):
        length = piece.shape[dim]
        refs.append(e.emit(e.sub(n, str(i)), "split", [x], dim=dim, start=start, length=length))
        start += length
    return tuple(refs)


def _unbind(e: Exporter, n: fx.Node, b: Bound, what: str) -> tuple[Ref, ...]:
    """x.unbind(dim) (e.g. timm's q, k, v = qkv.unbind(0)): a `split` of length one and a `reshape` each."""
    x, shape = _x(e, b, what), e.batch_shape(b["input"], what)
    dim = e.const(b["dim"], what) % len(shape)
    if shape[dim] == -1:
        raise e.refuse(what, "dim", b["dim"], "unbinding the batch dimension")
    piece = shape[:dim] + shape[dim + 1 :]
    return tuple(
        e.emit(e.sub(n, str(i)), "reshape", [e.emit(e.sub(n, f"{i}:slice"), "split", [x], dim=dim, start=i,
               length=1)], shape=piece)
        for i in range(shape[dim])
    )  # fmt: skip


def _getitem(e: Exporter, n: fx.Node, b: Bound, what: str) -> Any:
    container = e.value(b["input"])
    if isinstance(container, Refused):
        raise ExportError(container.message)
    if isinstance(container, (tuple, list)):
        return container[e.const(b["other"], what)]
    return _index(e, n, b["input"], e.const(b["other"], what), what)


def _index(e: Exporter, n: fx.Node, x_node: fx.Node, index: Any, what: str) -> Ref:
    """x[...] with ints, unit-step slices, Ellipsis and None: `split` per indexed dim, then a reshape."""
    items = list(index) if isinstance(index, tuple) else [index]
    for item in items:
        if not (item is None or item is Ellipsis or isinstance(item, (int, slice))) or isinstance(item, bool):
            raise e.refuse(what, "index", item, "only ints, slices, ... and None")
    shape = e.shape(x_node)
    items = _expand_ellipsis(items, len(shape))
    batch = e.batch_dim(x_node, what)
    x, reshape, dim = e.ref(x_node, what), False, 0
    for item in items:
        if item is None:
            reshape = True
            continue
        x = _index_dim(e, n, x, item, dim, shape[dim], dim == batch, what)
        reshape |= isinstance(item, int)
        dim += 1
    return e.emit(n.name, "reshape", [x], shape=e.batch_shape(n, what)) if reshape else x


def _expand_ellipsis(items: list[Any], rank: int) -> list[Any]:
    used = sum(1 for i in items if i is not None and i is not Ellipsis)
    if Ellipsis not in items:
        return items + [slice(None)] * (rank - used)
    at = items.index(Ellipsis)
    return items[:at] + [slice(None)] * (rank - used) + items[at + 1 :]


def _index_dim(
    e: Exporter, n: fx.Node, x: Ref, item: Any, dim: int, size: int, batch: bool, what: str
) -> Ref:
    if isinstance(item, int):
        if batch:
            raise e.refuse(what, "index", item, "indexing the batch dimension")
        if not -size <= item < size:
            raise e.refuse(what, "index", item, f"out of range for size {size}")
        return e.emit(e.sub(n, f"d{dim}"), "split", [x], dim=dim, start=item % size, length=1)
    start, stop, step = item.indices(size)
    if step != 1:
        raise e.refuse(what, "step", item.step, "only unit steps")
    if (start, stop) == (0, size):
        return x
    if batch:
        raise e.refuse(what, "index", item, "slicing the batch dimension")
    if stop <= start:
        raise e.refuse(what, "index", item, "an empty slice")
    return e.emit(e.sub(n, f"d{dim}"), "split", [x], dim=dim, start=start, length=stop - start)


def _conv2d(e: Exporter, n: fx.Node, b: Bound, what: str) -> Ref:
    c = build.Conv(*(e.const(b[k], what) for k in ("stride", "padding", "dilation", "groups")))
    w = e.ref(b["weight"], what)
    kernel = e.shape(b["weight"])[2:]
    return build.conv2d(e, n, _x(e, b, what), w, e.opt_ref(b["bias"], what), kernel, c, what)


def _conv1d(e: Exporter, n: fx.Node, b: Bound, what: str) -> Ref:
    c = build.Conv(*(e.const(b[k], what) for k in ("stride", "padding", "dilation", "groups")))
    w, bias = e.ref(b["weight"], what), e.opt_ref(b["bias"], what)
    return build.conv1d(e, n, b["input"], w, e.shape(b["weight"]), bias, c, what)


def _conv_transpose2d(e: Exporter, n: fx.Node, b: Bound, what: str) -> Ref:
    e.const(b["output_padding"], what)  # honoured through the recorded output size, which build reads
    c = build.Conv(*(e.const(b[k], what) for k in ("stride", "padding", "dilation", "groups")))
    w, bias = e.ref(b["weight"], what), e.opt_ref(b["bias"], what)
    return build.conv_transpose2d(e, n, b["input"], w, bias, e.shape(b["weight"]), c, what)


def _pool(op: str) -> CallHandler:
    def handler(e: Exporter, n: fx.Node, b: Bound, what: str) -> Ref:
        extra = {
            k: e.const(b[k], what)
            for k in ("dilation", "ceil_mode", "return_indices", "count_include_pad", "divisor_override")
            if k in b
        }
        kernel, stride, padding = (e.const(b[k], what) for k in ("kernel_size", "stride", "padding"))
        return build.pool(e, n, op, b["input"], build.make_pool(kernel, stride, padding, 2, **extra), what)

    return handler


def _adaptive(e: Exporter, n: fx.Node, b: Bound, what: str) -> Ref:
    return build.adaptive_avg_pool(e, n, b["input"], e.const(b["output_size"], what), 2, what)


def _layer_norm(e: Exporter, n: fx.Node, b: Bound, what: str) -> Ref:
    shape = e.const(b["normalized_shape"], what)
    inputs = [_x(e, b, what), e.opt_ref(b["weight"], what), e.opt_ref(b["bias"], what)]
    return e.emit(
        n.name,
        "layer_norm",
        inputs,
        eps=float(e.const(b["eps"], what)),
        normalized_shape=[shape] if isinstance(shape, int) else list(shape),
    )


def _group_norm(e: Exporter, n: fx.Node, b: Bound, what: str) -> Ref:
    inputs = [_x(e, b, what), e.opt_ref(b["weight"], what), e.opt_ref(b["bias"], what)]
    attrs = {"num_groups": e.const(b["num_groups"], what), "eps": float(e.const(b["eps"], what))}
    return e.emit(n.name, "group_norm", inputs, **attrs)


def _embedding(e: Exporter, n: fx.Node, b: Bound, what: str) -> Ref:
    args = build.EmbeddingArgs(
        *(e.const(b[k], what) for k in ("padding_idx", "max_norm", "scale_grad_by_freq", "sparse"))
    )
    rows = e.shape(b["weight"])[0]
    return build.embedding(e, n, b["input"], e.ref(b["weight"], what), rows, args, what)


def _interpolate(e: Exporter, n: fx.Node, b: Bound, what: str) -> Ref:
    keys = ("size", "scale_factor", "mode", "align_corners", "recompute_scale_factor", "antialias")
    a = build.Interpolate(*(e.const(b[k], what) for k in keys))
    return build.interpolate(e, n, b["input"], a, what)


def _reduce(op: str) -> CallHandler:
    """mean/sum over explicit non-batch dims (e.g. global average pooling x.mean((2, 3)))."""

    def handler(e: Exporter, n: fx.Node, b: Bound, what: str) -> Ref:
        if b["dtype"] is not None:
            raise e.refuse(what, "dtype", e.const(b["dtype"], what), "graph tensors stay float32")
        dim, rank = e.const(b["dim"], what), len(e.shape(b["input"]))
        dims = sorted({d % rank for d in ([dim] if isinstance(dim, int) else list(dim or []))})
        batch = e.batch_dim(b["input"], what)
        if not dims or batch in dims:
            raise e.refuse(what, "dim", dim, "reducing over the batch dimension")
        keepdim = bool(e.const(b["keepdim"], what))
        return e.emit(n.name, op, [_x(e, b, what)], dims=dims, keepdim=keepdim)

    return handler


def _method(*names: str) -> list[tuple[str, str]]:
    return [("method", name) for name in names]


def _entries(
    keys: Iterable[Any], signature: Callable[..., Any], handler: CallHandler
) -> dict[Any, CallEntry]:
    return {key: (signature, handler) for key in keys}


CALLS: dict[Any, CallEntry] = {
    **_entries([F.relu], _s_x_inplace, _unary("relu")),
    **_entries([torch.relu, *_method("relu")], _s_x, _unary("relu")),
    **_entries([torch.tanh, F.tanh, *_method("tanh")], _s_x, _unary("tanh")),
    **_entries([torch.sigmoid, F.sigmoid, *_method("sigmoid")], _s_x, _unary("sigmoid")),
    **_entries([F.silu], _s_x_inplace, _unary("silu")),
    **_entries([F.hardswish], _s_x_inplace, _unary("hardswish")),
    **_entries([F.hardsigmoid], _s_x_inplace, _unary("hardsigmoid")),
    **_entries([F.leaky_relu], _s_leaky_relu, _unary("leaky_relu", "negative_slope")),
    **_entries([F.elu], _s_elu, _unary("elu", "alpha")),
    **_entries([F.gelu], _s_gelu, _unary("gelu", "approximate")),
    **_entries([F.softmax], _s_softmax_f, _softmax("softmax")),
    **_entries([torch.softmax, *_method("softmax")], _s_softmax, _softmax("softmax")),
    **_entries([F.log_softmax], _s_softmax_f, _softmax("log_softmax")),
    **_entries([torch.log_softmax, *_method("log_softmax")], _s_softmax, _softmax("log_softmax")),
    **_entries([F.dropout], _s_dropout, _dropout("dropout")),
    **_entries([F.dropout1d], _s_dropout, _dropout("dropout2d", 3)),
    **_entries([F.dropout2d], _s_dropout, _dropout("dropout2d", 4)),
    **_entries([torch.flatten, *_method("flatten")], _s_flatten, _flatten),
    **_entries([torch.reshape, *_method("view", "reshape")], _s_var, _reshape),
    **_entries([torch.squeeze, *_method("squeeze")], _s_squeeze, _reshape),
    **_entries([torch.unsqueeze, *_method("unsqueeze")], _s_unsqueeze, _reshape),
    **_entries([operator.neg, torch.neg, *_method("neg")], _s_x, _neg),
    **_entries([torch.permute, *_method("permute")], _s_var, _permute),
    **_entries(_method("expand"), _s_var, _expand),
    **_entries([torch.transpose, *_method("transpose")], _s_transpose, _transpose),
    **_entries(_method("t"), _s_x, _t),
    **_entries(_method("contiguous"), _s_contiguous, _identity),
    **_entries([operator.add], _s_ab, _arith("add")),
    **_entries([operator.sub], _s_ab, _arith("sub")),
    **_entries([torch.add, *_method("add")], _s_addsub, _arith("add")),
    **_entries([torch.sub, *_method("sub")], _s_addsub, _arith("sub")),
    **_entries([operator.mul, torch.mul, *_method("mul")], _s_ab, _arith("mul")),
    **_entries([operator.truediv], _s_ab, _arith("div")),
    **_entries([torch.div, *_method("div")], _s_div, _arith("div")),
    **_entries([operator.matmul, torch.matmul, torch.bmm, *_method("matmul", "bmm")], _s_ab, _matmul),
    **_entries([torch.cat, torch.concat], _s_cat, _cat),
    **_entries([F.linear], _s_linear, _linear),
    **_entries([F.scaled_dot_product_attention], _s_sdpa, sdpa_call),
    **_entries([torch.split, *_method("split")], _s_split, _split),
    **_entries([torch.chunk, *_method("chunk")], _s_chunk, _split),
    **_entries([torch.unbind, *_method("unbind")], _s_unbind, _unbind),
    **_entries([operator.getitem], _s_ab, _getitem),
    **_entries([F.conv1d], _s_conv, _conv1d),
    **_entries([F.conv2d], _s_conv, _conv2d),
    **_entries([F.conv_transpose2d], _s_conv_transpose, _conv_transpose2d),
    **_entries([F.max_pool2d], _s_max_pool2d, _pool("max_pool2d")),
    **_entries([F.avg_pool2d], _s_avg_pool2d, _pool("avg_pool2d")),
    **_entries([F.adaptive_avg_pool2d], _s_adaptive, _adaptive),
    **_entries([F.layer_norm], _s_layer_norm, _layer_norm),
    **_entries([F.group_norm], _s_group_norm, _group_norm),
    **_entries([F.batch_norm], _s_batch_norm, _batch_norm),
    **_entries([("function", TORCHVISION_STOCHASTIC_DEPTH)], _s_stochastic_depth, _stochastic_depth),
    **_entries([F.embedding], _s_embedding, _embedding),
    **_entries([F.interpolate], _s_interpolate, _interpolate),
    **_entries([torch.mean, *_method("mean")], _s_reduce, _reduce("reduce_mean")),
    **_entries([torch.sum, *_method("sum")], _s_reduce, _reduce("reduce_sum")),
}
