"""Attention: F.scaled_dot_product_attention, and nn.MultiheadAttention / nn.TransformerEncoderLayer /
nn.TransformerEncoder expanded into linear, split, reshape, transpose and scaled_dot_product_attention."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import Tensor, nn

from . import build
from .core import Bound, Exporter, Ref, Refused


def is_causal_mask(mask: Tensor, size: int, keep_true: bool) -> bool:
    """Whether ``mask`` (leading dims of size one allowed) is the causal mask of ``size`` positions: additive
    float with -inf above the diagonal and 0 elsewhere, or boolean with True meaning keep (sdpa's
    convention) or mask (MultiheadAttention's), as ``keep_true`` says."""
    while mask.dim() > 2 and mask.shape[0] == 1:
        mask = mask[0]
    if list(mask.shape) != [size, size]:
        return False
    above = torch.ones(size, size, dtype=torch.bool).triu(1)
    if mask.dtype == torch.bool:
        return bool(torch.equal(mask, ~above if keep_true else above))
    if not mask.is_floating_point():
        return False
    return bool((mask[above] == -math.inf).all() and (mask[~above] == 0).all())


def causal_from_mask(
    e: Exporter, mask: Any, hint: bool, size: int, what: str, name: str, keep_true: bool = False
) -> bool:
    """Whether attention is causal: torch trusts ``hint`` (is_causal) where it does, else the mask must be
    absent or the causal mask (checked by value: it may not depend on the input)."""
    if hint:
        return True
    if mask is None:
        return False
    value = e.constant_tensor(mask, what, name)
    if not is_causal_mask(value, size, keep_true):
        raise e.refuse(what, name, mask.name, "only the causal mask (or none)")
    return True


def sdpa_call(e: Exporter, n: fx.Node, b: Bound, what: str) -> Ref:
    q_node, k_node = b["query"], b["key"]
    if e.const(b["dropout_p"], what) != 0.0:
        raise e.refuse(what, "dropout_p", e.const(b["dropout_p"], what), "the graph op has no dropout")
    heads = (e.shape(q_node)[-3:-2], e.shape(k_node)[-3:-2])
    if e.const(b["enable_gqa"], what) and heads[0] != heads[1]:
        raise e.refuse(what, "enable_gqa", True, "grouped keys/values (fewer heads than the query)")
    size = e.shape(q_node)[-2]
    causal = bool(e.const(b["is_causal"], what))
    if b["attn_mask"] is not None:
        if size != e.shape(k_node)[-2]:
            raise e.refuse(what, "attn_mask", b["attn_mask"].name, "queries and keys of different lengths")
        causal = causal_from_mask(e, b["attn_mask"], False, size, what, "attn_mask", keep_true=True)
    q = _scaled_query(e, n, q_node, e.const(b["scale"], what), what)
    refs = [q, e.ref(k_node, what), e.ref(b["value"], what)]
    return e.emit(n.name, "scaled_dot_product_attention", refs, is_causal=causal)


def _scaled_query(e: Exporter, n: fx.Node, q_node: fx.Node, scale: float | None, what: str) -> Ref:
    """scale= as a factor on q: softmax(q*c k^T / sqrt(E)) with c = scale*sqrt(E)."""
    q = e.ref(q_node, what)
    factor = 1.0 if scale is None else float(scale) * math.sqrt(e.shape(q_node)[-1])
    return q if factor == 1.0 else e.emit(e.sub(n, "scale"), "scale", [q], factor=factor)


# ---------------------------------------------------------------- MultiheadAttention


@dataclass(frozen=True)
class Seq:
    """A [N, L, E] (batch_first) or [L, N, E] tensor of the graph."""

    ref: Ref
    length: int
    batch_first: bool


def seq_of(e: Exporter, node: Any, batch_first: bool, what: str, arg: str) -> Seq:
    shape = e.shape(node)
    expected = 0 if batch_first else 1
    if len(shape) != 3 or e.batch_dim(node, what) != expected:
        raise e.refuse(
            what,
            "batch_first",
            batch_first,
            f"{arg} of shape {shape} does not have its batch at dim {expected}",
        )
    return Seq(e.ref(node, what), shape[1 - expected], batch_first)


def check_mha(e: Exporter, m: nn.MultiheadAttention, what: str) -> None:
    if m.bias_k is not None:
        raise e.refuse(what, "add_bias_kv", True)
    if m.add_zero_attn:
        raise e.refuse(what, "add_zero_attn", True)


def mha_module(e: Exporter, n: fx.Node, m: nn.MultiheadAttention, b: Bound, what: str) -> tuple[Any, Any]:
    """(output, weights): the averaged weights (need_weights=True) are refused only if something uses them."""
    check_mha(e, m, what)
    if b["key_padding_mask"] is not None:
        raise e.refuse(what, "key_padding_mask", b["key_padding_mask"].name)
    need_weights = bool(e.const(b["need_weights"], what))
    e.const(b["average_attn_weights"], what)  # shapes only the weights output, refused below if used
    q, k, v = (seq_of(e, b[a], m.batch_first, what, a) for a in ("query", "key", "value"))
    # torch trusts is_causal only without key_padding_mask and when it need not return weights.
    hint = bool(e.const(b["is_causal"], what)) and not need_weights
    size = q.length if q.length == k.length else -1
    causal = causal_from_mask(e, b["attn_mask"], hint, size, what, "attn_mask")
    out = attend(e, n.name, m, (q, k, v), causal, what)
    weights = Refused(
        f"unsupported argument need_weights=True of {what} at '{e.path}': its attention weights output is "
        "used, and the graph cannot compute it (pass need_weights=False)"
    )
    return out, weights if need_weights else None


def attend(
    e: Exporter, base: str, m: nn.MultiheadAttention, qkv: tuple[Seq, Seq, Seq], causal: bool, what: str
) -> Ref:
    heads, dim = m.num_heads, m.embed_dim
    weights, biases = _projections(e, base, m, what), _biases(e, base, m, what)
    parts = [
        _split_heads(e, f"{base}:{tag}", s, w, bias, heads, dim // heads)
        for tag, s, w, bias in zip("qkv", qkv, weights, biases, strict=True)
    ]
    y = _attention(e, base, parts, causal, m.dropout, dim // heads, what)
    merged = _merge_heads(e, base, y, qkv[0], dim)
    out_w, out_b = e.tensor_ref(m.out_proj.weight, what), e.tensor_ref(m.out_proj.bias, what)
    return e.emit(base, "linear", [merged, out_w, out_b])


def _projections(e: Exporter, base: str, m: nn.MultiheadAttention, what: str) -> list[Ref]:
    if not m._qkv_same_embed_dim:
        refs = [e.tensor_ref(w, what) for w in (m.q_proj_weight, m.k_proj_weight, m.v_proj_weight)]
        return [r for r in refs if r is not None]
    packed = e.tensor_ref(m.in_proj_weight, what)
    dim = m.embed_dim
    return [
        e.emit(f"{base}:w{t}", "split", [packed], dim=0, start=i * dim, length=dim)
        for i, t in enumerate("qkv")
    ]


def _biases(e: Exporter, base: str, m: nn.MultiheadAttention, what: str) -> list[Ref | None]:
    packed = e.tensor_ref(m.in_proj_bias, what)
    if packed is None:
        return [None, None, None]
    dim = m.embed_dim
    return [
        e.emit(f"{base}:b{t}", "split", [packed], dim=0, start=i * dim, length=dim)
        for i, t in enumerate("qkv")
    ]


def _split_heads(e: Exporter, base: str, s: Seq, w: Ref, bias: Ref | None, heads: int, head_dim: int) -> Ref:
    """Project, then [N, L, E] / [L, N, E] -> [N, heads, L, head_dim]."""
    projected = e.emit(f"{base}:proj", "linear", [s.ref, w, bias])
    if s.batch_first:
        split = e.emit(f"{base}:heads", "reshape", [projected], shape=[-1, s.length, heads, head_dim])
        return e.emit(f"{base}:bhld", "transpose", [split], dim0=1, dim1=2)
    split = e.emit(f"{base}:heads", "reshape", [projected], shape=[s.length, -1, heads, head_dim])
    return e.emit(f"{base}:bhld", "permute", [split], dims=[1, 2, 0, 3])


def _merge_heads(e: Exporter, base: str, y: Ref, q: Seq, dim: int) -> Ref:
    if q.batch_first:
        t = e.emit(f"{base}:blhd", "transpose", [y], dim0=1, dim1=2)
        return e.emit(f"{base}:merged", "reshape", [t], shape=[-1, q.length, dim])
    t = e.emit(f"{base}:lbhd", "permute", [y], dims=[2, 0, 1, 3])
    return e.emit(f"{base}:merged", "reshape", [t], shape=[q.length, -1, dim])


def _attention(
    e: Exporter, base: str, qkv: list[Ref], causal: bool, p: float, head_dim: int, what: str
) -> Ref:
    """sdpa; with attention dropout, the same maths spelled out (the graph's sdpa has no dropout)."""
    if p == 0:
        return e.emit(f"{base}:sdpa", "scaled_dot_product_attention", qkv, is_causal=causal)
    if causal:
        raise e.refuse(what, "dropout", p, "attention dropout with a causal mask")
    q, k, v = qkv
    kt = e.emit(f"{base}:kt", "transpose", [k], dim0=2, dim1=3)
    scores = e.emit(f"{base}:scores", "matmul", [q, kt])
    scaled = e.emit(f"{base}:scaled", "scale", [scores], factor=1.0 / math.sqrt(head_dim))
    probs = e.emit(f"{base}:probs", "softmax", [scaled], dim=-1)
    dropped = build.dropout(e, f"{base}:dropped", "dropout", probs, p)
    return e.emit(f"{base}:mixed", "matmul", [dropped, v])


# ---------------------------------------------------------------- TransformerEncoder(Layer)


def _activation(e: Exporter, layer: nn.TransformerEncoderLayer, what: str) -> tuple[str, dict[str, Any]]:
    act = layer.activation
    if act in (F.relu, torch.relu) or isinstance(act, nn.ReLU):
        return "relu", {}
    if act is F.gelu:
        return "gelu", {"approximate": "none"}
    if isinstance(act, nn.GELU):
        return "gelu", {"approximate": act.approximate}
    raise e.refuse(what, "activation", act, "only relu and gelu")


def _layer_norm(e: Exporter, name: str, ln: nn.LayerNorm, x: Ref, what: str) -> Ref:
    refs = [e.tensor_ref(ln.weight, what), e.tensor_ref(ln.bias, what)]
    return e.emit(name, "layer_norm", [x, *refs], normalized_shape=list(ln.normalized_shape), eps=ln.eps)


def _linear(e: Exporter, name: str, lin: nn.Linear, x: Ref, what: str) -> Ref:
    return e.emit(name, "linear", [x, e.tensor_ref(lin.weight, what), e.tensor_ref(lin.bias, what)])


def encoder_layer(
    e: Exporter, base: str, layer: nn.TransformerEncoderLayer, s: Seq, causal: bool, what: str
) -> Ref:
    """torch's reference path (Fig. 1 of arXiv:2002.04745), post-norm or norm_first."""
    check_mha(e, layer.self_attn, what)
    x = s.ref
    if layer.norm_first:
        h = _self_attention(
            e, base, layer, _layer_norm(e, f"{base}:norm1", layer.norm1, x, what), s, causal, what
        )
        x = e.emit(f"{base}:res1", "add", [x, h])
        h = _feed_forward(e, base, layer, _layer_norm(e, f"{base}:norm2", layer.norm2, x, what), what)
        return e.emit(f"{base}:res2", "add", [x, h])
    h = _self_attention(e, base, layer, x, s, causal, what)
    x = _layer_norm(e, f"{base}:norm1", layer.norm1, e.emit(f"{base}:res1", "add", [x, h]), what)
    h = _feed_forward(e, base, layer, x, what)
    return _layer_norm(e, f"{base}:norm2", layer.norm2, e.emit(f"{base}:res2", "add", [x, h]), what)


def _self_attention(
    e: Exporter, base: str, layer: nn.TransformerEncoderLayer, x: Ref, s: Seq, causal: bool, what: str
) -> Ref:
    seq = Seq(x, s.length, s.batch_first)
    out = attend(e, f"{base}:attn", layer.self_attn, (seq, seq, seq), causal, what)
    return build.dropout(e, f"{base}:dropout1", "dropout", out, layer.dropout1.p)


def _feed_forward(e: Exporter, base: str, layer: nn.TransformerEncoderLayer, x: Ref, what: str) -> Ref:
    op, attrs = _activation(e, layer, what)
    h = e.emit(f"{base}:act", op, [_linear(e, f"{base}:linear1", layer.linear1, x, what)], **attrs)
    h = build.dropout(e, f"{base}:dropout", "dropout", h, layer.dropout.p)
    h = _linear(e, f"{base}:linear2", layer.linear2, h, what)
    return build.dropout(e, f"{base}:dropout2", "dropout", h, layer.dropout2.p)


def encoder_layer_module(e: Exporter, n: fx.Node, m: nn.TransformerEncoderLayer, b: Bound, what: str) -> Ref:
    if b["src_key_padding_mask"] is not None:
        raise e.refuse(what, "src_key_padding_mask", b["src_key_padding_mask"].name)
    s = seq_of(e, b["src"], m.self_attn.batch_first, what, "src")
    causal = causal_from_mask(
        e, b["src_mask"], bool(e.const(b["is_causal"], what)), s.length, what, "src_mask"
    )
    return encoder_layer(e, n.name, m, s, causal, what)


def encoder_module(e: Exporter, n: fx.Node, m: nn.TransformerEncoder, b: Bound, what: str) -> Ref:
    """Layers in turn, then the optional final norm. enable_nested_tensor and mask_check matter only with a
    src_key_padding_mask, which is refused."""
    if b["src_key_padding_mask"] is not None:
        raise e.refuse(what, "src_key_padding_mask", b["src_key_padding_mask"].name)
    layers = list(m.layers)
    if not all(type(layer) is nn.TransformerEncoderLayer for layer in layers):
        raise e.refuse(what, "encoder_layer", type(layers[0]).__name__, "only nn.TransformerEncoderLayer")
    s = seq_of(e, b["src"], layers[0].self_attn.batch_first, what, "src")
    causal = causal_from_mask(e, b["mask"], e.const(b["is_causal"], what) is True, s.length, what, "mask")
    for i, layer in enumerate(layers):
        s = Seq(encoder_layer(e, f"{n.name}:layers.{i}", layer, s, causal, what), s.length, s.batch_first)
    if m.norm is not None and not isinstance(m.norm, nn.LayerNorm):
        raise e.refuse(what, "norm", type(m.norm).__name__, "only nn.LayerNorm")
    return s.ref if m.norm is None else _layer_norm(e, f"{n.name}:norm", m.norm, s.ref, what)
