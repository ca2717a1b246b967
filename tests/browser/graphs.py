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
    name: str,
    inputs: list,
    targets: list,
    params: list,
    buffers: list,
    nodes: list,
    output: str,
    loss: str,
    *,
    loss_attrs: dict[str, Any] | None = None,
    class_weights: str | None = None,
) -> Graph:
    """The loss reads the output and the first target (then `class_weights`, a buffer, if given)."""
    loss_inputs = [output, targets[0]["name"], *([class_weights] if class_weights else [])]
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
        "loss": {"op": loss, "inputs": loss_inputs, "attrs": loss_attrs or {}},
    }


def init_weights(g: Graph, seed: int) -> Tensors:
    """fan-in scaled normals for weights; BN affine near 1/0, running stats away from 0/1, class weights
    in [0.5, 1.5); a param named "<p>.twin" starts equal to <p>."""
    gen = torch.Generator().manual_seed(seed)
    out: Tensors = {}
    for p in g["params"]:
        shape, name = p["shape"], p["name"]
        fan_in = math.prod(shape[1:]) if len(shape) > 1 else shape[0]
        value = torch.randn(shape, generator=gen) / math.sqrt(fan_in)
        if name.startswith("bn") and name.endswith(".weight"):
            value = 1 + 0.2 * torch.randn(shape, generator=gen)
        out[name] = value
    for name in out:
        if name.endswith(".twin"):
            out[name] = out[name.removesuffix(".twin")].clone()
    for b in g["buffers"]:
        noise = torch.rand(b["shape"], generator=gen)
        positive = b["name"].endswith(("running_var", "class_weight"))
        out[b["name"]] = 0.5 + noise if positive else noise - 0.5
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


def odd() -> Graph:
    """Odd widths after ops whose f(0) is not 0 (sigmoid, a broadcast subtraction): TF.js 4.22's packed WebGL
    kernels compute those ops on the padding lanes of packed textures too, and its packed matmul sums the
    padding lanes when the shared dimension is odd. Single steps start from clean weights and are right;
    from the second local step on, the weights carry those lanes (runtime.js "packed textures")."""
    return graph(
        "odd-hand",
        [spec("x", [-1, 6])],
        [spec("y", [-1], "int64")],
        [
            spec("fc1.weight", [5, 6]),
            spec("fc1.bias", [5]),
            spec("fc2.weight", [3, 5]),
            spec("fc2.bias", [3]),
        ],
        [],
        [
            node("fc1", "linear", ["x", "fc1.weight", "fc1.bias"]),
            node("s", "sigmoid", ["fc1"]),
            node("fc2", "linear", ["s", "fc2.weight", "fc2.bias"]),
        ],
        "fc2",
        "cross_entropy",
    )


def head() -> Graph:
    """Even widths up to an odd class count (5), after a sigmoid: the backward product dy @ fc2.weight sums
    that odd width, so on WebGL the engine pads fc2's weight to an even width (runtime.js linearProduct) to
    run its steps with packed elementwise kernels (runtime.js "packed textures")."""
    return graph(
        "head-hand",
        [spec("x", [-1, 6])],
        [spec("y", [-1], "int64")],
        [
            spec("fc1.weight", [4, 6]),
            spec("fc1.bias", [4]),
            spec("fc2.weight", [5, 4]),
            spec("fc2.bias", [5]),
        ],
        [],
        [
            node("fc1", "linear", ["x", "fc1.weight", "fc1.bias"]),
            node("s", "sigmoid", ["fc1"]),
            node("fc2", "linear", ["s", "fc2.weight", "fc2.bias"]),
        ],
        "fc2",
        "cross_entropy",
    )


def conv_odd() -> Graph:
    """A convolution with 3 output channels after one with 4: the first's input gradient sums those 3 lanes
    (TF.js's packed Conv2DBackpropInput), so WebGL runs its steps unpacked (runtime.js "packed textures")."""
    return graph(
        "conv-odd-hand",
        [spec("x", [-1, 2, 6, 6])],
        [spec("y", [-1], "int64")],
        [
            spec("c1.weight", [4, 2, 3, 3]),
            spec("c1.bias", [4]),
            spec("c2.weight", [3, 4, 3, 3]),
            spec("c2.bias", [3]),
            spec("fc.weight", [4, 108]),
            spec("fc.bias", [4]),
        ],
        [],
        [
            node("c1", "conv2d", ["x", "c1.weight", "c1.bias"], padding=[1, 1]),  # [N,4,6,6]
            node("s1", "sigmoid", ["c1"]),
            node("c2", "conv2d", ["s1", "c2.weight", "c2.bias"], padding=[1, 1]),  # [N,3,6,6]
            node("s2", "sigmoid", ["c2"]),
            node("f", "flatten", ["s2"]),  # [N,108]
            node("fc", "linear", ["f", "fc.weight", "fc.bias"]),
        ],
        "fc",
        "cross_entropy",
    )


def conv_one_channel() -> Graph:
    """A 3x3 convolution of a 1-channel image sums 9 lanes per output, as an im2col product whose operands
    both hold exact zeros in their padding lanes: WebGL may run its steps packed (runtime.js LANE_SUMS)."""
    return graph(
        "conv1-hand",
        [spec("x", [-1, 1, 6, 6])],
        [spec("y", [-1], "int64")],
        [
            spec("c1.weight", [4, 1, 3, 3]),
            spec("c1.bias", [4]),
            spec("fc.weight", [4, 144]),
            spec("fc.bias", [4]),
        ],
        [],
        [
            node("c1", "conv2d", ["x", "c1.weight", "c1.bias"], padding=[1, 1]),  # [N,4,6,6]
            node("s1", "sigmoid", ["c1"]),
            node("f", "flatten", ["s1"]),  # [N,144]
            node("fc", "linear", ["f", "fc.weight", "fc.bias"]),
        ],
        "fc",
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


def blocks() -> Graph:
    """Issue 11's activations, group norms, reductions (keepdim, negative and empty dims), add_scalar and
    dropout2d, both on the NHWC values convolutions leave and on NCHW ones. dropout2d has p=0 here: its
    masks are random on both sides (tests/browser/test_ops.py checks them)."""
    params = [
        spec("c1.weight", [6, 4, 3, 3]),
        spec("c1.bias", [6]),
        spec("gn1.weight", [6]),
        spec("gn1.bias", [6]),
        spec("c2.weight", [6, 6, 3, 3]),
        spec("fc.weight", [5, 18]),
        spec("fc.bias", [5]),
    ]
    nodes = [
        node("c1", "conv2d", ["x", "c1.weight", "c1.bias"], padding=[1, 1]),  # [N,6,6,6], NHWC from here
        node("s1", "scale", ["c1"], factor=3.0),  # past hardswish's and hardsigmoid's kinks at -3 and 3
        node("hs", "hardswish", ["s1"]),
        node("lr", "leaky_relu", ["hs"], negative_slope=0.2),
        node("as", "add_scalar", ["lr"], value=-0.5),
        node("el", "elu", ["as"], alpha=0.5),
        node("d2", "dropout2d", ["el"], p=0.0),
        node("gn1", "group_norm", ["d2", "gn1.weight", "gn1.bias"], num_groups=3),  # reads NCHW
        node("si", "silu", ["gn1"]),  # NCHW
        node("c2", "conv2d", ["si", "c2.weight", None], padding=[1, 1]),
        node("e1", "elu", ["c2"]),  # alpha 1: tf.elu
        node("gn2", "group_norm", ["e1", None, None], num_groups=2, eps=1e-3),
        node("lr2", "leaky_relu", ["gn2"]),
        node("m1", "reduce_mean", ["lr2"], dims=[2, 3]),  # [N,6]
        node("all", "reduce_mean", ["si"], dims=[]),  # a scalar, broadcast back below
        node("m1b", "add", ["m1", "all"]),
        node("hsig", "hardsigmoid", ["s1"]),  # NHWC
        node("m2s", "reduce_sum", ["hsig"], dims=[-1, -2]),  # [N,6]
        node("m2", "scale", ["m2s"], factor=0.1),  # logits of a sane size
        node("hsig2", "hardsigmoid", ["gn1"]),  # NCHW
        node("d3", "dropout2d", ["hsig2"], p=0.0),
        node("m3", "reduce_mean", ["d3"], dims=[1], keepdim=True),  # [N,1,6,6]
        node("m3s", "reduce_sum", ["m3"], dims=[2]),  # [N,1,6]
        node("m3f", "flatten", ["m3s"]),
        node("cat", "concat", ["m1b", "m2", "m3f"], dim=1),  # [N,18]
        node("fc", "linear", ["cat", "fc.weight", "fc.bias"]),
    ]
    return graph(
        "blocks-hand",
        [spec("x", [-1, 4, 6, 6])],
        [spec("y", [-1], "int64")],
        params,
        [],
        nodes,
        "fc",
        "cross_entropy",
    )


def padding() -> Graph:
    """embedding's padding_idx (positive and negative) on a table that an embedding without one shares: the
    padding row is looked up, and trained only through the other lookup."""
    t, d, v = 6, 8, 9
    params = [
        spec("emb.weight", [v, d]),
        spec("emb2.weight", [v, d]),
        spec("fc.weight", [4, d]),
        spec("fc.bias", [4]),
    ]
    nodes = [
        node("e", "embedding", ["x", "emb.weight"], padding_idx=0),
        node("e2", "embedding", ["x", "emb2.weight"], padding_idx=-1),
        node("e3", "embedding", ["x", "emb.weight"]),
        node("h", "add", ["e", "e2"]),
        node("h2", "mul", ["h", "e3"]),
        node("s", "silu", ["h2"]),
        node("r", "reduce_sum", ["s"], dims=[1]),  # [N,d]
        node("r2", "reduce_mean", ["e3"], dims=[-2], keepdim=True),  # [N,1,d]
        node("r2f", "flatten", ["r2"]),
        node("z", "add", ["r", "r2f"]),
        node("fc", "linear", ["z", "fc.weight", "fc.bias"]),
    ]
    return graph(
        "padding-hand",
        [spec("x", [-1, t], "int64")],
        [spec("y", [-1], "int64")],
        params,
        [],
        nodes,
        "fc",
        "cross_entropy",
    )


def resample() -> Graph:
    """interpolate (nearest up and down, bilinear with and without align_corners, one axis unchanged) and
    conv_transpose2d (stride 2, padding 1, output_padding 1 on NHWC values; uneven attrs on NCHW ones), into
    cross_entropy with class weights, label smoothing and an ignore_index that is a class id."""
    params = [
        spec("ct1.weight", [3, 4, 3, 3]),
        spec("ct1.bias", [4]),
        spec("ct2.weight", [4, 2, 2, 3]),
        spec("fc.weight", [5, 1139]),
        spec("fc.bias", [5]),
    ]
    nodes = [
        node(
            "ct1", "conv_transpose2d", ["x", "ct1.weight", "ct1.bias"], stride=2, padding=1, output_padding=1
        ),
        node("r1", "relu", ["ct1"]),  # [N,4,10,12], NHWC
        node("near_down", "interpolate", ["r1"], size=[7, 9]),  # [N,4,7,9]
        node("near_up", "interpolate", ["x"], size=[11, 13], mode="nearest"),  # [N,3,11,13]
        node("half", "interpolate", ["r1"], size=[13, 5], mode="bilinear"),  # [N,4,13,5]
        node("corners", "interpolate", ["x"], size=[9, 6], mode="bilinear", align_corners=True),  # [N,3,9,6]
        node(
            "ct2",
            "conv_transpose2d",
            ["near_down", "ct2.weight", None],
            stride=[1, 2],
            padding=[0, 1],
            output_padding=[0, 1],
        ),  # [N,2,8,18]
        *(node(f"f_{n}", "flatten", [n]) for n in ("near_up", "half", "corners", "ct2")),
        node("feat", "concat", ["f_near_up", "f_half", "f_corners", "f_ct2"], dim=1),  # [N,1139]
        node("t", "tanh", ["feat"]),
        node("fc", "linear", ["t", "fc.weight", "fc.bias"]),
    ]
    return graph(
        "resample-hand",
        [spec("x", [-1, 3, 5, 6])],
        [spec("y", [-1], "int64")],
        params,
        [spec("class_weight", [5])],
        nodes,
        "fc",
        "cross_entropy",
        loss_attrs={"label_smoothing": 0.15, "ignore_index": 2},
        class_weights="class_weight",
    )


def l1() -> Graph:
    """l1 over a conv_transpose2d + bilinear regression, and over values equal to their target: torch's l1
    gradient there is 0 (tf.abs's would be -1), which the twin linears (equal weights) would pass on."""
    params = [
        spec("ct.weight", [2, 3, 3, 3]),
        spec("ct.bias", [3]),
        spec("a", [4, 5]),
        spec("a.twin", [4, 5]),
    ]
    nodes = [
        node("ct", "conv_transpose2d", ["x", "ct.weight", "ct.bias"], stride=2, padding=1, output_padding=1),
        node("up", "interpolate", ["ct"], size=[6, 6], mode="bilinear"),  # [N,3,6,6]
        node("pred", "flatten", ["up"]),  # [N,108]
        node("v", "split", ["x"], dim=2, start=0, length=1),  # [N,2,1,4]
        node("vf", "flatten", ["v"]),  # [N,8]
        node("vv", "split", ["vf"], dim=1, start=0, length=5),  # [N,5]
        node("pa", "linear", ["vv", "a", None]),
        node("pb", "linear", ["vv", "a.twin", None]),
        node("zero", "sub", ["pa", "pb"]),  # exactly 0, with a gradient for both
        node("y_tail", "split", ["y"], dim=1, start=108, length=4),
        node("same", "add", ["y_tail", "zero"]),  # equal to its target
        node("out", "concat", ["pred", "same"], dim=1),  # [N,112]
    ]
    return graph(
        "l1-hand", [spec("x", [-1, 2, 4, 4])], [spec("y", [-1, 112])], params, [], nodes, "out", "l1"
    )


def batch_for(g: Graph, n: int, seed: int) -> Tensors:
    """Random inputs/targets matching the graph's specs (class ids inside the output width)."""
    gen = torch.Generator().manual_seed(seed)
    out: Tensors = {}
    for s in g["inputs"] + g["targets"]:
        shape = [n if d == -1 else d for d in s["shape"]]
        if s["dtype"] == "int64":
            high = _classes(g) if s in g["targets"] else _vocab(g)
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


HAND_MADE = {
    "mlp": mlp,
    "cnn": cnn,
    "seq": seq,
    "regression": regression,
    "resample": resample,
    "l1": l1,
    "blocks": blocks,
    "padding": padding,
}
