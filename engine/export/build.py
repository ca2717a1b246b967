"""Emitting the graph ops of layers that an nn.Module and its functional spelling share.

Each helper receives every argument torch would honour and either represents it in the graph or refuses
it with an ExportError naming it (see docs/graph-format.md, "The exporter").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from .core import Deferred, Exporter, Ref

INTERPOLATE_MODES = ("nearest", "bilinear")


def ints(v: Any, n: int) -> list[int]:
    """An int or a sequence as a list of n ints (torch's _pair/_single)."""
    return [int(v)] * n if isinstance(v, int) else [int(a) for a in v]


def conv_padding(e: Exporter, what: str, padding: Any, kernel: list[int], dilation: list[int]) -> list[int]:
    """Explicit symmetric padding for torch's int/tuple, "valid" and "same" spellings."""
    if padding == "valid":
        return [0] * len(kernel)
    if padding == "same":
        totals = [d * (k - 1) for d, k in zip(dilation, kernel, strict=True)]
        if any(t % 2 for t in totals):
            raise e.refuse(
                what, "padding", padding, "dilation*(kernel-1) is odd, so torch pads one side more"
            )
        return [t // 2 for t in totals]
    if isinstance(padding, str):
        raise e.refuse(what, "padding", padding)
    return ints(padding, len(kernel))


def check_padding_mode(e: Exporter, what: str, mode: str) -> None:
    if mode != "zeros":
        raise e.refuse(what, "padding_mode", mode, "only zero padding")


def lift_1d(e: Exporter, name: str, x_node: fx.Node, what: str) -> Ref:
    """[N, C, L] -> [N, C, 1, L]: 1-D layers run as their 2-D op over a height of one."""
    shape = e.batch_shape(x_node, what)
    if len(shape) != 3:
        raise e.fail(what, f"expected a batched [N, C, L] input, got shape {e.shape(x_node)}")
    return e.emit(name, "reshape", [e.ref(x_node, what)], shape=[shape[0], shape[1], 1, shape[2]])


def lower_1d(e: Exporter, n: fx.Node, y: Ref, what: str) -> Ref:
    return e.emit(n.name, "reshape", [y], shape=e.batch_shape(n, what))


@dataclass(frozen=True)
class Conv:
    stride: Any
    padding: Any
    dilation: Any
    groups: int


def conv2d(
    e: Exporter, n: fx.Node, x: Ref, w: Ref, b: Ref | None, kernel: list[int], c: Conv, what: str
) -> Ref:
    dilation = ints(c.dilation, 2)
    return e.emit(
        n.name,
        "conv2d",
        [x, w, b],
        stride=ints(c.stride, 2),
        padding=conv_padding(e, what, c.padding, kernel, dilation),
        dilation=dilation,
        groups=int(c.groups),
    )


def conv1d(
    e: Exporter, n: fx.Node, x_node: fx.Node, w: Ref, w_shape: list[int], b: Ref | None, c: Conv, what: str
) -> Ref:
    """conv1d as conv2d: x [N,C,L] -> [N,C,1,L], weight [O,I,k] -> [O,I,1,k] (a reshape of the param)."""
    (dilation,) = ints(c.dilation, 1)
    (padding,) = conv_padding(e, what, c.padding, [w_shape[2]], [dilation])
    (stride,) = ints(c.stride, 1)
    x4 = lift_1d(e, e.sub(n, "x2d"), x_node, what)
    w4 = e.emit(e.sub(n, "weight2d"), "reshape", [w], shape=[w_shape[0], w_shape[1], 1, w_shape[2]])
    y = e.emit(
        e.sub(n, "conv2d"),
        "conv2d",
        [x4, w4, b],
        stride=[1, stride],
        padding=[0, padding],
        dilation=[1, dilation],
        groups=int(c.groups),
    )
    return lower_1d(e, n, y, what)


def conv_transpose2d(
    e: Exporter, n: fx.Node, x_node: fx.Node, w: Ref, b: Ref | None, w_shape: list[int], c: Conv, what: str
) -> Ref:
    """The output size (from output_padding or a call's output_size) is read off the example runs."""
    if c.groups != 1:
        raise e.refuse(what, "groups", c.groups, "the graph op has no groups")
    if ints(c.dilation, 2) != [1, 1]:
        raise e.refuse(what, "dilation", c.dilation, "the graph op has no dilation")
    stride, padding = ints(c.stride, 2), ints(c.padding, 2)
    size_in, size_out = e.shape(x_node)[2:], e.shape(n)[2:]
    extra = [
        o - ((i - 1) * s - 2 * p + k)
        for o, i, s, p, k in zip(size_out, size_in, stride, padding, w_shape[2:], strict=True)
    ]
    x = e.ref(x_node, what)
    return e.emit(n.name, "conv_transpose2d", [x, w, b], stride=stride, padding=padding, output_padding=extra)


@dataclass(frozen=True)
class Pool:
    kernel: list[int]
    stride: list[int]
    padding: list[int]
    dilation: Any = 1
    ceil_mode: bool = False
    return_indices: bool = False
    count_include_pad: bool = True
    divisor_override: int | None = None


def make_pool(kernel: Any, stride: Any, padding: Any, dims: int, **extra: Any) -> Pool:
    k = ints(kernel, dims)
    # torch's default stride (None or, in the functional spelling, an empty list) is the kernel size.
    s = k if stride is None or stride == [] or stride == () else ints(stride, dims)
    return Pool(k, s, ints(padding, dims), **extra)


def pool2d(
    e: Exporter, name: str, op: str, x: Ref, hw: tuple[list[int], list[int]], p: Pool, what: str
) -> Ref:
    """max_pool2d / avg_pool2d. ceil_mode is honoured when it gives floor mode's output size (the graph's
    shapes are fixed), count_include_pad when there is no padding, divisor_override as a scale."""
    _check_pool(e, op, hw, p, what)
    if p.divisor_override is None:
        return e.emit(name, op, [x], kernel_size=p.kernel, stride=p.stride, padding=p.padding)
    pooled = e.emit(f"{name}:pool", op, [x], kernel_size=p.kernel, stride=p.stride, padding=p.padding)
    # Without ceil-mode overhang every window divides by its full size, so sum/d = mean * (k*k/d).
    return e.emit(name, "scale", [pooled], factor=math.prod(p.kernel) / p.divisor_override)


def _check_pool(e: Exporter, op: str, hw: tuple[list[int], list[int]], p: Pool, what: str) -> None:
    if p.return_indices:
        raise e.refuse(what, "return_indices", True)
    if ints(p.dilation, len(p.kernel)) != [1] * len(p.kernel):
        raise e.refuse(what, "dilation", p.dilation, "the graph op has no dilation")
    floor = [
        (i + 2 * pad - k) // s + 1 for i, pad, k, s in zip(hw[0], p.padding, p.kernel, p.stride, strict=True)
    ]
    if p.ceil_mode and floor != hw[1]:
        raise e.refuse(what, "ceil_mode", True, f"it changes the output size ({hw[1]} instead of {floor})")
    if not p.count_include_pad and any(p.padding):
        raise e.refuse(what, "count_include_pad", False, "with padding")
    if p.divisor_override is not None and op != "avg_pool2d":
        raise e.refuse(what, "divisor_override", p.divisor_override)


def pool(e: Exporter, n: fx.Node, op: str, x_node: fx.Node, p: Pool, what: str) -> Ref:
    """A 2-D pool, or a 1-D one lifted to 2-D with a kernel of height one."""
    if p.return_indices:  # the output is a tuple, before anything reads its shape
        raise e.refuse(what, "return_indices", True)
    if len(p.kernel) == 2:
        hw = (e.shape(x_node)[-2:], e.shape(n)[-2:])
        return pool2d(e, n.name, op, e.ref(x_node, what), hw, p, what)
    lifted = Pool(
        [1, *p.kernel], [1, *p.stride], [0, *p.padding], p.dilation, p.ceil_mode, p.return_indices,
        p.count_include_pad, p.divisor_override,
    )  # fmt: skip
    hw = ([1, e.shape(x_node)[-1]], [1, e.shape(n)[-1]])
    x4 = lift_1d(e, e.sub(n, "x2d"), x_node, what)
    return lower_1d(e, n, pool2d(e, e.sub(n, "pool2d"), op, x4, hw, lifted, what), what)


def adaptive_avg_pool(e: Exporter, n: fx.Node, x_node: fx.Node, size: Any, dims: int, what: str) -> Ref:
    """None in output_size keeps that input size, as torch does."""
    given = [size] * dims if size is None or isinstance(size, int) else list(size)
    out = [e.shape(x_node)[-dims + i] if s is None else int(s) for i, s in enumerate(given)]
    if dims == 2:
        return e.emit(n.name, "adaptive_avg_pool2d", [e.ref(x_node, what)], output_size=out)
    x4 = lift_1d(e, e.sub(n, "x2d"), x_node, what)
    y = e.emit(e.sub(n, "pool2d"), "adaptive_avg_pool2d", [x4], output_size=[1, *out])
    return lower_1d(e, n, y, what)


@dataclass(frozen=True)
class Interpolate:
    size: Any
    scale_factor: Any
    mode: str
    align_corners: bool | None
    recompute_scale_factor: bool | None
    antialias: bool = False


def interpolate(e: Exporter, n: fx.Node, x_node: fx.Node, a: Interpolate, what: str) -> Ref:
    """The graph gives the output size; torch's scale_factor maps coordinates by 1/scale_factor instead of
    in/out, which agree exactly when in*scale_factor is an integer (or torch recomputes the scale)."""
    if len(e.shape(x_node)) != 4:
        raise e.fail(what, f"only 4-D [N, C, H, W] inputs, got shape {e.shape(x_node)}")
    if a.mode not in INTERPOLATE_MODES:
        raise e.refuse(what, "mode", a.mode, f"only {list(INTERPOLATE_MODES)}")
    if a.antialias:
        raise e.refuse(what, "antialias", True)
    size_in, size_out = e.shape(x_node)[2:], e.shape(n)[2:]
    aligned = a.mode == "bilinear" and bool(a.align_corners)
    if a.size is None and not a.recompute_scale_factor and not aligned:
        scales = [float(s) for s in ([a.scale_factor] * 2 if _is_number(a.scale_factor) else a.scale_factor)]
        if any(i * s != o for i, s, o in zip(size_in, scales, size_out, strict=True)):
            raise e.refuse(
                what, "scale_factor", a.scale_factor, "input size times scale_factor is not an integer, so "
                "torch's coordinate mapping differs from the output size's (set recompute_scale_factor=True)"
            )  # fmt: skip
    return e.emit(
        n.name, "interpolate", [e.ref(x_node, what)], size=size_out, mode=a.mode, align_corners=aligned
    )


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass(frozen=True)
class EmbeddingArgs:
    padding_idx: int | None
    max_norm: float | None
    scale_grad_by_freq: bool
    sparse: bool


def embedding(e: Exporter, n: fx.Node, ids: Any, w: Ref, rows: int, a: EmbeddingArgs, what: str) -> Ref:
    if a.max_norm is not None:
        raise e.refuse(what, "max_norm", a.max_norm, "it renormalises the table in place")
    if a.scale_grad_by_freq:
        raise e.refuse(what, "scale_grad_by_freq", True)
    if a.sparse:
        raise e.refuse(what, "sparse", True)
    pad = None if a.padding_idx is None else int(a.padding_idx) % rows  # torch's normalisation
    if isinstance(e.env.get(ids), Deferred):
        return _embedding_of_range(e, n, ids, w, pad, what)
    return e.emit(n.name, "embedding", [e.ref(ids, what), w], padding_idx=pad)


def _embedding_of_range(e: Exporter, n: fx.Node, ids: fx.Node, w: Ref, pad: int | None, what: str) -> Ref:
    """Positions: the table looked up at torch.arange(start, stop) is the slice weight[start:stop]."""
    value = e.constant_tensor(ids, what, "input")
    start = int(value[0]) if value.dim() == 1 and len(value) else 0
    span = torch.arange(start, start + len(value)) if value.dim() == 1 else None
    if span is None or value.is_floating_point() or not torch.equal(value.long(), span):
        raise e.refuse(what, "input", ids.name, "constant ids other than a range torch.arange(start, stop)")
    if pad is not None and start <= pad < start + len(value):
        raise e.refuse(what, "padding_idx", pad, "a range of constant ids that contains it")
    return e.emit(n.name, "split", [w], dim=0, start=start, length=len(value))


def dropout(e: Exporter, name: str, op: str, x: Ref, p: float, training: bool = True) -> Ref:
    """Active while the interpreter trains; training=False (or p=0) is the identity in both modes."""
    if not training or p == 0:
        return x
    return e.emit(name, op, [x], p=float(p))


def check_flatten(e: Exporter, what: str, x_node: fx.Node, start: int, end: int) -> None:
    rank, batch = len(e.shape(x_node)), e.batch_dim(x_node, what)
    first, last = start % max(rank, 1), end % max(rank, 1)
    if batch is not None and first <= batch <= last and first != last:
        raise e.refuse(what, "start_dim", start, "flattening the batch dimension into others")


def softmax_dim(e: Exporter, what: str, dim: int | None, x_node: fx.Node) -> int:
    """torch's implicit dim for dim=None (0 for 0-, 1- and 3-D inputs, else 1), never the batch."""
    if dim is not None:
        return dim
    rank = len(e.shape(x_node))
    implicit = 0 if rank in (0, 1, 3) else 1
    if implicit == e.batch_dim(x_node, what):
        raise e.refuse(what, "dim", None, f"torch's implicit dim {implicit} is the batch dimension")
    return implicit
