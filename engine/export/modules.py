"""Handlers for torch.nn layers (fx leaves): each reads every attribute torch's forward would use."""

from __future__ import annotations

from typing import Any

import torch.fx as fx
from torch import nn

from engine.layers import PositionalEmbedding

from . import build
from .core import Bound, Exporter, ModuleHandler, Ref


def _input(e: Exporter, b: Bound, what: str) -> tuple[fx.Node, Ref]:
    """The single tensor a one-input layer's forward takes."""
    if len(b) != 1:
        raise e.fail(what, f"expected one input, got {sorted(b)}")
    node = next(iter(b.values()))
    return node, e.ref(node, what)


def _linear(e: Exporter, n: fx.Node, m: nn.Linear, b: Bound, what: str) -> Ref:
    _, x = _input(e, b, what)
    return e.emit(n.name, "linear", [x, e.tensor_ref(m.weight, what), e.tensor_ref(m.bias, what)])


def _conv(m: nn.Conv1d | nn.Conv2d | nn.ConvTranspose2d) -> build.Conv:
    return build.Conv(m.stride, m.padding, m.dilation, m.groups)


def _conv2d(e: Exporter, n: fx.Node, m: nn.Conv2d, b: Bound, what: str) -> Ref:
    build.check_padding_mode(e, what, m.padding_mode)
    _, x = _input(e, b, what)
    w, bias = e.tensor_ref(m.weight, what), e.tensor_ref(m.bias, what)
    assert w is not None
    return build.conv2d(e, n, x, w, bias, list(m.kernel_size), _conv(m), what)


def _conv1d(e: Exporter, n: fx.Node, m: nn.Conv1d, b: Bound, what: str) -> Ref:
    build.check_padding_mode(e, what, m.padding_mode)
    node, _ = _input(e, b, what)
    w, bias = e.tensor_ref(m.weight, what), e.tensor_ref(m.bias, what)
    assert w is not None
    return build.conv1d(e, n, node, w, list(m.weight.shape), bias, _conv(m), what)


def _conv_transpose2d(e: Exporter, n: fx.Node, m: nn.ConvTranspose2d, b: Bound, what: str) -> Ref:
    # forward's output_size only picks output_padding, which the recorded output shape already gives.
    build.check_padding_mode(e, what, m.padding_mode)
    w, bias = e.tensor_ref(m.weight, what), e.tensor_ref(m.bias, what)
    assert w is not None
    return build.conv_transpose2d(e, n, b["input"], w, bias, list(m.weight.shape), _conv(m), what)


def _batch_norm(e: Exporter, n: fx.Node, m: nn.modules.batchnorm._BatchNorm, b: Bound, what: str) -> Ref:
    if m.momentum is None:
        raise e.refuse(what, "momentum", None, "the cumulative moving average is not supported")
    if not m.affine:
        raise e.refuse(what, "affine", False, "the graph's batch_norm needs weight and bias")
    if not m.track_running_stats:
        raise e.refuse(what, "track_running_stats", False, "the graph's batch_norm keeps running stats")
    if m.bias is None:
        raise e.refuse(what, "bias", False, "the graph's batch_norm needs a bias")
    _, x = _input(e, b, what)
    refs = [e.tensor_ref(t, what) for t in (m.weight, m.bias, m.running_mean, m.running_var)]
    return e.emit(n.name, "batch_norm", [x, *refs], eps=m.eps, momentum=m.momentum)


def _layer_norm(e: Exporter, n: fx.Node, m: nn.LayerNorm, b: Bound, what: str) -> Ref:
    # elementwise_affine=False / bias=False leave weight / bias None: the graph's optional inputs.
    _, x = _input(e, b, what)
    refs = [e.tensor_ref(m.weight, what), e.tensor_ref(m.bias, what)]
    return e.emit(n.name, "layer_norm", [x, *refs], normalized_shape=list(m.normalized_shape), eps=m.eps)


def _group_norm(e: Exporter, n: fx.Node, m: nn.GroupNorm, b: Bound, what: str) -> Ref:
    _, x = _input(e, b, what)
    refs = [e.tensor_ref(m.weight, what), e.tensor_ref(m.bias, what)]
    return e.emit(n.name, "group_norm", [x, *refs], num_groups=m.num_groups, eps=m.eps)


def _instance_norm(
    e: Exporter, n: fx.Node, m: nn.modules.instancenorm._InstanceNorm, b: Bound, what: str
) -> Ref:
    """Instance statistics in both modes = group_norm with one group per channel (momentum is unused)."""
    if m.track_running_stats:
        raise e.refuse(what, "track_running_stats", True, "eval mode would use running stats")
    node, x = _input(e, b, what)
    refs = [e.tensor_ref(m.weight, what), e.tensor_ref(m.bias, what)]
    return e.emit(n.name, "group_norm", [x, *refs], num_groups=e.shape(node)[1], eps=m.eps)


def _embedding(e: Exporter, n: fx.Node, m: nn.Embedding, b: Bound, what: str) -> Ref:
    # norm_type matters only with max_norm, which is refused.
    args = build.EmbeddingArgs(m.padding_idx, m.max_norm, m.scale_grad_by_freq, m.sparse)
    w = e.tensor_ref(m.weight, what)
    assert w is not None
    return build.embedding(e, n, b["input"], w, m.num_embeddings, args, what)


def _activation(op: str, **attrs: str) -> ModuleHandler:
    """A one-input layer; attrs maps graph attr -> module attribute. inplace is checked, never dropped."""

    def handler(e: Exporter, n: fx.Node, m: Any, b: Bound, what: str) -> Ref:
        node, x = _input(e, b, what)
        if getattr(m, "inplace", False):
            e.check_inplace(n, node, what)
        return e.emit(n.name, op, [x], **{k: getattr(m, attr) for k, attr in attrs.items()})

    return handler


def _softmax(op: str) -> ModuleHandler:
    def handler(e: Exporter, n: fx.Node, m: Any, b: Bound, what: str) -> Ref:
        node, x = _input(e, b, what)
        return e.emit(n.name, op, [x], dim=build.softmax_dim(e, what, m.dim, node))

    return handler


def _dropout(e: Exporter, n: fx.Node, m: nn.Dropout, b: Bound, what: str) -> Ref:
    node, x = _input(e, b, what)
    if m.inplace:
        e.check_inplace(n, node, what)
    return build.dropout(e, n.name, "dropout", x, m.p)


def _dropout_channels(rank: int) -> ModuleHandler:
    """Dropout2d on [N,C,H,W], Dropout1d on [N,C,L]: one draw per sample and channel (graph op dropout2d)."""

    def handler(e: Exporter, n: fx.Node, m: Any, b: Bound, what: str) -> Ref:
        node, x = _input(e, b, what)
        if len(e.shape(node)) != rank:
            raise e.fail(what, f"only batched {rank}-D inputs, got shape {e.shape(node)}")
        if m.inplace:
            e.check_inplace(n, node, what)
        return build.dropout(e, n.name, "dropout2d", x, m.p)

    return handler


def _pool(op: str, dims: int) -> ModuleHandler:
    def handler(e: Exporter, n: fx.Node, m: Any, b: Bound, what: str) -> Ref:
        extra = {
            k: getattr(m, k)
            for k in ("dilation", "ceil_mode", "return_indices", "count_include_pad", "divisor_override")
            if hasattr(m, k)
        }
        p = build.make_pool(m.kernel_size, m.stride, m.padding, dims, **extra)
        return build.pool(e, n, op, b["input"], p, what)

    return handler


def _adaptive(dims: int) -> ModuleHandler:
    def handler(e: Exporter, n: fx.Node, m: Any, b: Bound, what: str) -> Ref:
        node, _ = _input(e, b, what)
        return build.adaptive_avg_pool(e, n, node, m.output_size, dims, what)

    return handler


def _flatten(e: Exporter, n: fx.Node, m: nn.Flatten, b: Bound, what: str) -> Ref:
    node, x = _input(e, b, what)
    build.check_flatten(e, what, node, m.start_dim, m.end_dim)
    return e.emit(n.name, "flatten", [x], start_dim=m.start_dim, end_dim=m.end_dim)


def _unflatten(e: Exporter, n: fx.Node, m: nn.Unflatten, b: Bound, what: str) -> Ref:
    _, x = _input(e, b, what)  # dim and unflattened_size are in the recorded output shape
    return e.emit(n.name, "reshape", [x], shape=e.batch_shape(n, what))


def _identity(e: Exporter, n: fx.Node, m: nn.Identity, b: Bound, what: str) -> Ref:
    return _input(e, b, what)[1]


def _upsample(e: Exporter, n: fx.Node, m: nn.Upsample, b: Bound, what: str) -> Ref:
    node, _ = _input(e, b, what)
    a = build.Interpolate(m.size, m.scale_factor, m.mode, m.align_corners, m.recompute_scale_factor)
    return build.interpolate(e, n, node, a, what)


def _positions(e: Exporter, n: fx.Node, m: PositionalEmbedding, b: Bound, what: str) -> Ref:
    _, x = _input(e, b, what)
    return e.emit(n.name, "arange_embedding", [x, e.tensor_ref(m.weight, what)])


MODULES: dict[type, ModuleHandler] = {
    nn.Linear: _linear,
    nn.Conv1d: _conv1d,
    nn.Conv2d: _conv2d,
    nn.ConvTranspose2d: _conv_transpose2d,
    nn.BatchNorm1d: _batch_norm,
    nn.BatchNorm2d: _batch_norm,
    nn.LayerNorm: _layer_norm,
    nn.GroupNorm: _group_norm,
    nn.InstanceNorm1d: _instance_norm,
    nn.InstanceNorm2d: _instance_norm,
    nn.Embedding: _embedding,
    nn.ReLU: _activation("relu"),
    nn.Tanh: _activation("tanh"),
    nn.Sigmoid: _activation("sigmoid"),
    nn.GELU: _activation("gelu", approximate="approximate"),
    nn.SiLU: _activation("silu"),
    nn.Hardswish: _activation("hardswish"),
    nn.Hardsigmoid: _activation("hardsigmoid"),
    nn.LeakyReLU: _activation("leaky_relu", negative_slope="negative_slope"),
    nn.ELU: _activation("elu", alpha="alpha"),
    nn.Softmax: _softmax("softmax"),
    nn.LogSoftmax: _softmax("log_softmax"),
    nn.Dropout: _dropout,
    nn.Dropout1d: _dropout_channels(3),
    nn.Dropout2d: _dropout_channels(4),
    nn.MaxPool1d: _pool("max_pool2d", 1),
    nn.MaxPool2d: _pool("max_pool2d", 2),
    nn.AvgPool1d: _pool("avg_pool2d", 1),
    nn.AvgPool2d: _pool("avg_pool2d", 2),
    nn.AdaptiveAvgPool1d: _adaptive(1),
    nn.AdaptiveAvgPool2d: _adaptive(2),
    nn.Flatten: _flatten,
    nn.Unflatten: _unflatten,
    nn.Identity: _identity,
    nn.Upsample: _upsample,
    PositionalEmbedding: _positions,
}
