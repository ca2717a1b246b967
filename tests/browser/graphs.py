"""Hand-made graphs that together use every op and loss of docs/graph-format.md, with weights and a
batch. Sizes are tiny: the point is semantics (layouts, padding, broadcasting), not speed."""

from __future__ import annotations

import math
from typing import Any

import torch

Graph = dict[str, Any]
Tensors = dict[str, torch.Tensor]


def spec(name: str, shape: list[int], dtype: str = "float32") -> dict[str, Any]:
    return {"name": name, "shape": shape, "dtype": dtype}


def node(name: str, op: str, inputs: list[str | None], **attrs: Any) -> dict[str, Any]:
    return {"name": name, "op": op, "inputs": inputs, "attrs": attrs}


def graph(
    name: str, inputs: list, targets: list, params: list, buffers: list, nodes: list, output: str, loss: str
) -> Graph:
    return {
        "format": "crowdtrain.graph",
        "version": 1,
        "name": name,
        "inputs": inputs,
        "targets": targets,
        "params": params,
        "buffers": buffers,
        "nodes": nodes,
        "output": output,
        "loss": {"op": loss, "inputs": [output, targets[0]["name"]], "attrs": {}},
    }


def init_weights(g: Graph, seed: int) -> Tensors:
    """fan-in scaled normals for weights; BN affine near 1/0, running stats away from 0/1."""
    gen = torch.Generator().manual_seed(seed)
    out: Tensors = {}
    for p in g["params"]:
        shape, name = p["shape"], p["name"]
        fan_in = math.prod(shape[1:]) if len(shape) > 1 else shape[0]
        value = torch.randn(shape, generator=gen) / math.sqrt(fan_in)
        if name.startswith("bn") and name.endswith(".weight"):
            value = 1 + 0.2 * torch.randn(shape, generator=gen)
        out[name] = value
    for b in g["buffers"]:
        noise = torch.rand(b["shape"], generator=gen)
        out[b["name"]] = 0.5 + noise if b["name"].endswith("running_var") else noise - 0.5
    return out


def mlp() -> Graph:
    return graph(
        "mlp-hand",
        [spec("x", [-1, 1, 8, 8])],
        [spec("y", [-1], "int64")],
        [
            spec("fc1.weight", [32, 64]),
            spec("fc1.bias", [32]),
            spec("fc2.weight", [10, 32]),
            spec("fc2.bias", [10]),
        ],
        [],
        [
            node("flat", "flatten", ["x"], start_dim=1, end_dim=-1),
            node("fc1", "linear", ["flat", "fc1.weight", "fc1.bias"]),
            node("relu1", "relu", ["fc1"]),
            node("fc2", "linear", ["relu1", "fc2.weight", "fc2.bias"]),
        ],
        "fc2",
        "cross_entropy",
    )


def _bn(prefix: str, c: int) -> tuple[list, list]:
    return (
        [spec(f"{prefix}.weight", [c]), spec(f"{prefix}.bias", [c])],
        [spec(f"{prefix}.running_mean", [c]), spec(f"{prefix}.running_var", [c])],
    )


def _bn_node(name: str, x: str) -> dict[str, Any]:
    return node(
        name,
        "batch_norm",
        [x, f"{name}.weight", f"{name}.bias", f"{name}.running_mean", f"{name}.running_var"],
        eps=1e-5,
        momentum=0.1,
    )


def cnn() -> Graph:
    """conv (dilated, grouped, strided, padded), batch_norm 4-D and 2-D, all pools, concat, dropout."""
    bn1_p, bn1_b = _bn("bn1", 8)
    bn2_p, bn2_b = _bn("bn2", 16)
    params = [
        spec("c1.weight", [8, 2, 3, 3]),
        *bn1_p,
        spec("c2.weight", [6, 8, 3, 3]),
        spec("c2.bias", [6]),
        spec("fc1.weight", [16, 132]),
        *bn2_p,
        spec("fc2.weight", [5, 16]),
        spec("fc2.bias", [5]),
    ]
    nodes = [
        node(
            "c1", "conv2d", ["x", "c1.weight", None], stride=[1, 1], padding=[1, 1], dilation=[2, 2], groups=2
        ),
        _bn_node("bn1", "c1"),  # [N,8,10,10]
        node("r1", "relu", ["bn1"]),
        node("p1", "max_pool2d", ["r1"], kernel_size=[3, 3], stride=[2, 2], padding=[1, 1]),  # [N,8,5,5]
        node("c2", "conv2d", ["p1", "c2.weight", "c2.bias"], stride=[2, 1], padding=[1, 0]),  # [N,6,3,3]
        node("r2", "relu", ["c2"]),  # keeps c2.bias from being cancelled by bn2
        node("a1", "avg_pool2d", ["r1"], kernel_size=[2, 2], stride=[1, 1], padding=[1, 1]),  # [N,8,11,11]
        node("ad", "adaptive_avg_pool2d", ["a1"], output_size=[3, 3]),  # [N,8,3,3]
        node("cat", "concat", ["r2", "ad"], dim=1),  # [N,14,3,3]
        node("f1", "flatten", ["cat"]),  # [N,126]
        node("g", "adaptive_avg_pool2d", ["r2"], output_size=[1, 1]),
        node("gf", "flatten", ["g"]),  # [N,6]
        node("feat", "concat", ["f1", "gf"], dim=-1),  # [N,132]
        node("drop", "dropout", ["feat"], p=0.0),
        node("fc1", "linear", ["drop", "fc1.weight", None]),
        _bn_node("bn2", "fc1"),
        node("s", "sigmoid", ["bn2"]),
        node("fc2", "linear", ["s", "fc2.weight", "fc2.bias"]),
    ]
    return graph(
        "cnn-hand",
        [spec("x", [-1, 4, 12, 12])],
        [spec("y", [-1], "int64")],
        params,
        bn1_b + bn2_b,
        nodes,
        "fc2",
        "cross_entropy",
    )


def seq() -> Graph:
    """A small causal transformer block with sequence targets: embeddings, attention, norms, gelus,
    shape ops, batched matmuls, softmax on a non-last dim, and every binary op."""
    t, d, v = 6, 8, 11
    params = [
        spec("emb.weight", [v, d]),
        spec("pos.weight", [10, d]),
        spec("ln1.weight", [d]),
        spec("ln1.bias", [d]),
        spec("qkv.weight", [3 * d, d]),
        spec("qkv.bias", [3 * d]),
        spec("proj.weight", [d, d]),
        spec("ff1.weight", [2 * d, d]),
        spec("ff1.bias", [2 * d]),
        spec("ff2.weight", [d, 2 * d]),
        spec("mw", [d, d]),
        spec("head.weight", [v, d]),
        spec("head.bias", [v]),
    ]
    heads = lambda name, src: node(name, "reshape", [src], shape=[-1, t, 2, d // 2])  # noqa: E731
    nodes = [
        node("emb", "embedding", ["x", "emb.weight"]),
        node("pos", "arange_embedding", ["x", "pos.weight"]),
        node("h", "add", ["emb", "pos"]),
        node("ln1", "layer_norm", ["h", "ln1.weight", "ln1.bias"], normalized_shape=[d], eps=1e-5),
        node("qkv", "linear", ["ln1", "qkv.weight", "qkv.bias"]),
        node("q", "split", ["qkv"], dim=2, start=0, length=d),
        node("k", "split", ["qkv"], dim=-1, start=d, length=d),
        node("v", "split", ["qkv"], dim=2, start=2 * d, length=d),
        heads("q4", "q"),
        heads("k4", "k"),
        heads("v4", "v"),
        node("qh", "permute", ["q4"], dims=[0, 2, 1, 3]),
        node("kh", "transpose", ["k4"], dim0=1, dim1=2),
        node("vh", "permute", ["v4"], dims=[0, -2, 1, 3]),
        node("att", "scaled_dot_product_attention", ["qh", "kh", "vh"], is_causal=True),
        node("att_full", "scaled_dot_product_attention", ["qh", "kh", "vh"], is_causal=False),
        node("kt", "transpose", ["kh"], dim0=2, dim1=3),
        node("scores", "matmul", ["qh", "kt"]),  # [N,2,T,T]
        node("sm_heads", "softmax", ["scores"], dim=1),
        node("lsm", "log_softmax", ["scores"], dim=-1),
        node("mix", "mul", ["sm_heads", "lsm"]),
        node("mixv", "matmul", ["mix", "vh"]),
        node("att_half", "scale", ["att_full"], factor=0.5),
        node("att_sum", "add", ["att", "att_half"]),
        node("att_all", "sub", ["att_sum", "mixv"]),
        node("merged_t", "permute", ["att_all"], dims=[0, 2, 1, 3]),
        node("merged", "reshape", ["merged_t"], shape=[-1, t, d]),
        node("proj", "linear", ["merged", "proj.weight", None]),
        node("h2", "add", ["h", "proj"]),
        node("ln2", "layer_norm", ["h2", None, None], normalized_shape=[d]),
        node("ff1", "linear", ["ln2", "ff1.weight", "ff1.bias"]),
        node("g1", "gelu", ["ff1"], approximate="none"),
        node("g2", "gelu", ["ff1"], approximate="tanh"),
        node("g2s", "scale", ["g2"], factor=0.3),
        node("gm", "sub", ["g1", "g2s"]),
        node("ff2", "linear", ["gm", "ff2.weight", None]),
        node("den", "sigmoid", ["ln2"]),
        node("dv", "div", ["ff2", "den"]),
        node("m", "matmul", ["ln2", "mw"]),
        node("th", "tanh", ["m"]),
        node("h3", "add", ["h2", "dv"]),
        node("h4", "add", ["h3", "th"]),
        node("logits", "linear", ["h4", "head.weight", "head.bias"]),
    ]
    return graph(
        "seq-hand",
        [spec("x", [-1, t], "int64")],
        [spec("y", [-1, t], "int64")],
        params,
        [],
        nodes,
        "logits",
        "cross_entropy",
    )


def regression() -> Graph:
    return graph(
        "reg-hand",
        [spec("x", [-1, 5])],
        [spec("y", [-1, 3])],
        [spec("l1.weight", [7, 5]), spec("l1.bias", [7]), spec("l2.weight", [3, 7]), spec("l2.bias", [3])],
        [],
        [
            node("l1", "linear", ["x", "l1.weight", "l1.bias"]),
            node("t", "tanh", ["l1"]),
            node("l2", "linear", ["t", "l2.weight", "l2.bias"]),
        ],
        "l2",
        "mse",
    )


def batch_for(g: Graph, n: int, seed: int) -> Tensors:
    """Random inputs/targets matching the graph's specs (class ids inside the output width)."""
    gen = torch.Generator().manual_seed(seed)
    out: Tensors = {}
    classes = _classes(g)
    for s in g["inputs"] + g["targets"]:
        shape = [n if d == -1 else d for d in s["shape"]]
        if s["dtype"] == "int64":
            high = classes if s in g["targets"] else _vocab(g)
            out[s["name"]] = torch.randint(0, high, shape, generator=gen)
        else:
            out[s["name"]] = torch.randn(shape, generator=gen)
    return out


def _classes(g: Graph) -> int:
    last = next(n for n in g["nodes"] if n["name"] == g["output"])
    weight = next(p for p in g["params"] if p["name"] == last["inputs"][1])
    return weight["shape"][0]


def _vocab(g: Graph) -> int:
    emb = next((n for n in g["nodes"] if n["op"] == "embedding"), None)
    if emb is None:
        return 10
    return next(p for p in g["params"] if p["name"] == emb["inputs"][1])["shape"][0]


HAND_MADE = {"mlp": mlp, "cnn": cnn, "seq": seq, "regression": regression}
