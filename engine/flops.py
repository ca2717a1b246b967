"""FLOPs per sample, computed from the graph and its inferred shapes (never reported by clients).

Counts exactly like torch.utils.flop_counter.FlopCounterMode: only matrix products and
convolutions count (2 FLOPs per multiply-add), elementwise ops and normalisations count 0.
Backward counts a product's input gradient only when that input depends on a parameter, because
autograd skips gradients nobody needs (so the first layer never computes d(loss)/d(input)).
Attention is counted as its two batched products (q @ k^T and weights @ v), which is what
FlopCounterMode reports for the math implementation.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from engine.graph import Graph, Node, infer_shapes

Shape = tuple[int, ...]


def _matmul_shapes(a: Shape, b: Shape) -> tuple[int, int, int, int]:
    """(batch, m, k, n) of a torch.matmul, with 1-D operands promoted like torch does."""
    a2 = (1, *a) if len(a) == 1 else a
    b2 = (*b, 1) if len(b) == 1 else b
    batch = math.prod(_broadcast(a2[:-2], b2[:-2]))
    return batch, a2[-2], a2[-1], b2[-1]


def _broadcast(a: Shape, b: Shape) -> Shape:
    n = max(len(a), len(b))
    a, b = (1,) * (n - len(a)) + a, (1,) * (n - len(b)) + b
    return tuple(max(x, y) for x, y in zip(a, b, strict=True))


def node_flops(node: Node, shapes: dict[str, Shape], needs_grad: Sequence[bool]) -> tuple[int, int]:
    """(forward, backward) FLOPs of one node for the batch the shapes were inferred with."""
    s = [shapes[n] if n is not None else () for n in node.inputs]
    if node.op == "linear":
        fwd = 2 * math.prod(s[0][:-1]) * s[1][1] * s[1][0]
        return fwd, fwd * (needs_grad[0] + needs_grad[1])
    if node.op == "matmul":
        batch, m, k, n = _matmul_shapes(s[0], s[1])
        fwd = 2 * batch * m * k * n
        return fwd, fwd * (needs_grad[0] + needs_grad[1])
    if node.op == "conv2d":
        out = shapes[node.name]
        fwd = 2 * out[0] * out[2] * out[3] * math.prod(s[1])
        # grad of the weight is conv(input^T, grad_out^T): full input channels even with groups.
        grad_w = 2 * out[0] * out[1] * out[2] * out[3] * s[0][1] * s[1][2] * s[1][3]
        return fwd, fwd * needs_grad[0] + grad_w * needs_grad[1]
    if node.op == "conv_transpose2d":
        # Every input pixel meets the whole kernel; each gradient is a convolution of the same size.
        fwd = 2 * s[0][0] * s[0][2] * s[0][3] * math.prod(s[1])
        return fwd, fwd * (needs_grad[0] + needs_grad[1])
    if node.op == "scaled_dot_product_attention":
        return _attention_flops(s[0], s[1], s[2], needs_grad)
    return 0, 0


def _attention_flops(q: Shape, k: Shape, v: Shape, needs_grad: Sequence[bool]) -> tuple[int, int]:
    heads = math.prod(q[:-2])
    scores = 2 * heads * q[-2] * q[-1] * k[-2]  # q @ k^T
    mix = 2 * heads * q[-2] * k[-2] * v[-1]  # weights @ v
    weights_grad = needs_grad[0] or needs_grad[1]
    backward = mix * (weights_grad + needs_grad[2]) + scores * (needs_grad[0] + needs_grad[1])
    return scores + mix, backward


def feeds_output(graph: Graph) -> set[str]:
    """Names the output depends on; backward never runs through dead branches."""
    live = {graph.output}
    for node in reversed(graph.nodes):
        if node.name in live:
            live.update(n for n in node.inputs if n is not None)
    return live


def _count(graph: Graph) -> tuple[int, int]:
    shapes = infer_shapes(graph, batch=1)  # every counted op is linear in the batch size
    grad = {p.name: True for p in graph.params}
    live = feeds_output(graph)
    forward = backward = 0
    for node in graph.nodes:
        needs = [n is not None and grad.get(n, False) for n in node.inputs]
        grad[node.name] = any(needs)
        f, b = node_flops(node, shapes, needs)
        forward += f
        backward += b if grad[node.name] and node.name in live else 0
    return forward, backward


def forward_flops_per_sample(graph: Graph) -> int:
    return _count(graph)[0]


def train_flops_per_sample(graph: Graph) -> int:
    """Forward + backward FLOPs of one training step, per sample."""
    forward, backward = _count(graph)
    return forward + backward
