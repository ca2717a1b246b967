"""PyTorch interpreter of a validated graph (the server-side twin of frontend's runtime.js)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from engine import ops
from engine.graph import DTYPES, EVAL_MEMORY_BYTES, Graph, TensorSpec, activation_memory, load_graph


def safe_attr(name: str) -> str:
    """Injective map from a graph name to a valid torch attribute name.

    Graph names may contain '.', which torch reserves for submodule paths; every character outside
    [A-Za-z0-9] (including '_' itself) becomes '_' + two hex digits, so distinct names never collide.
    """
    return "".join(c if c.isascii() and c.isalnum() else f"_{ord(c):02x}" for c in name)


def as_graph(graph: Graph | Mapping[str, Any] | str | bytes) -> Graph:
    return (
        graph
        if isinstance(graph, Graph)
        else load_graph(dict(graph) if isinstance(graph, Mapping) else graph)
    )


def _cast(value: Tensor, spec: TensorSpec) -> Tensor:
    """Check a batch against its spec and fix the dtype.

    Shards store labels/tokens as int32; torch's embedding and cross_entropy want int64.
    """
    if value.dim() != len(spec.shape) or tuple(value.shape[1:]) != spec.shape[1:]:
        raise ValueError(f"'{spec.name}' has shape {list(value.shape)}, expected {list(spec.shape)}")
    want = DTYPES[spec.dtype]
    return value if value.dtype == want else value.to(want)


class GraphModule(nn.Module):
    """Runs a Graph with torch.nn.functional; params are nn.Parameters, buffers are buffers."""

    def __init__(self, graph: Graph | Mapping[str, Any] | str | bytes) -> None:
        super().__init__()
        self.graph = as_graph(graph)
        for spec in self.graph.params:
            self.register_parameter(safe_attr(spec.name), nn.Parameter(torch.zeros(spec.shape)))
        for spec in self.graph.buffers:
            self.register_buffer(safe_attr(spec.name), torch.zeros(spec.shape))

    def _tensor(self, name: str) -> Tensor:
        return getattr(self, safe_attr(name))  # type: ignore[no-any-return]

    def load_state(self, weights: Mapping[str, Tensor]) -> None:
        """Copy params and buffers (by graph name) in; every one must be present with its shape."""
        for spec in (*self.graph.params, *self.graph.buffers):
            if spec.name not in weights:
                raise KeyError(f"missing weight '{spec.name}'")
            value = torch.as_tensor(weights[spec.name])
            if tuple(value.shape) != spec.shape:
                raise ValueError(
                    f"weight '{spec.name}' has shape {tuple(value.shape)}, expected {spec.shape}"
                )
            with torch.no_grad():
                self._tensor(spec.name).copy_(value)

    def state(self) -> dict[str, Tensor]:
        """Params and buffers by graph name (detached copies)."""
        specs = (*self.graph.params, *self.graph.buffers)
        return {s.name: self._tensor(s.name).detach().clone() for s in specs}

    def grads(self) -> dict[str, Tensor]:
        """Gradients by param name; zeros for params the loss does not depend on."""
        out = {}
        for spec in self.graph.params:
            grad = self._tensor(spec.name).grad
            out[spec.name] = torch.zeros(spec.shape) if grad is None else grad.detach().clone()
        return out

    def forward(self, inputs: Mapping[str, Tensor]) -> Tensor:
        values: dict[str, Tensor] = {}
        for spec in self.graph.inputs:
            if spec.name not in inputs:
                raise KeyError(f"missing input '{spec.name}'")
            values[spec.name] = _cast(torch.as_tensor(inputs[spec.name]), spec)
        for spec in (*self.graph.params, *self.graph.buffers):
            values[spec.name] = self._tensor(spec.name)
        for spec in self.graph.targets:
            # Nodes may read targets; forward-only callers (inference) simply don't pass them.
            if spec.name in inputs:
                values[spec.name] = _cast(torch.as_tensor(inputs[spec.name]), spec)
        for node in self.graph.nodes:
            args = [None if n is None else values[n] for n in node.inputs]
            values[node.name] = ops.run_op(node.op, args, node.attrs, self.training)
        return values[self.graph.output]

    def loss(self, output: Tensor, targets: Mapping[str, Tensor]) -> Tensor:
        spec = self.graph.loss
        return ops.run_loss(spec.op, output, self.loss_target(targets), spec.attrs, self.loss_weight())

    def loss_weight(self) -> Tensor | None:
        """The loss's class-weight buffer, if it names one."""
        name = self.graph.loss.weight
        return None if name is None else self._tensor(name)

    def loss_target(self, targets: Mapping[str, Tensor]) -> Tensor:
        name = self.graph.loss.inputs[1]
        if name not in targets:
            raise KeyError(f"missing target '{name}'")
        spec = next(t for t in self.graph.targets if t.name == name)
        return _cast(torch.as_tensor(targets[name]), spec)


@dataclass(frozen=True)
class GradientResult:
    grads: dict[str, Tensor]
    loss: float
    buffers: dict[str, Tensor]


def compute_gradients(
    graph: Graph | Mapping[str, Any],
    weights: Mapping[str, Tensor],
    inputs: Mapping[str, Tensor],
    targets: Mapping[str, Tensor],
) -> GradientResult:
    """Gradient of the batch-mean loss (train mode), plus the buffers after the step's updates."""
    module = GraphModule(graph)
    module.load_state(weights)
    module.train()
    loss = module.loss(module({**targets, **inputs}), targets)
    torch.autograd.backward(loss)
    state = module.state()
    buffers = {s.name: state[s.name] for s in module.graph.buffers}
    return GradientResult(module.grads(), float(loss.detach()), buffers)


@dataclass(frozen=True)
class LocalResult:
    delta: dict[str, Tensor]  # params before minus params after, per param name
    loss: float  # mean training loss over the slice
    buffers: dict[str, Tensor]


def local_steps(
    graph: Graph | Mapping[str, Any],
    weights: Mapping[str, Tensor],
    inputs: Mapping[str, Tensor],
    targets: Mapping[str, Tensor],
    batch_size: int,
    lr: float,
    momentum: float,
) -> LocalResult:
    """One pass over the slice in mini-batches with torch.optim.SGD, as browsers do in averaging mode."""
    module = GraphModule(graph)
    module.load_state(weights)
    module.train()
    optimizer = torch.optim.SGD(module.parameters(), lr=lr, momentum=momentum)
    n = len(next(iter(inputs.values())))
    total = 0.0
    for start in range(0, n, batch_size):
        x, y = _slice(inputs, start, start + batch_size), _slice(targets, start, start + batch_size)
        optimizer.zero_grad()
        loss = module.loss(module({**y, **x}), y)
        torch.autograd.backward(loss)
        optimizer.step()
        total += float(loss.detach()) * min(batch_size, n - start)
    state = module.state()
    delta = {s.name: torch.as_tensor(weights[s.name]) - state[s.name] for s in module.graph.params}
    return LocalResult(delta, total / max(n, 1), {s.name: state[s.name] for s in module.graph.buffers})


def _slice(batch: Mapping[str, Tensor], start: int, stop: int) -> dict[str, Tensor]:
    return {k: torch.as_tensor(v)[start:stop] for k, v in batch.items()}


@torch.no_grad()
def evaluate(
    graph: Graph | Mapping[str, Any],
    weights: Mapping[str, Tensor],
    inputs: Mapping[str, Tensor],
    targets: Mapping[str, Tensor],
    batch_size: int = 1000,
) -> dict[str, float]:
    """Mean loss (and accuracy for cross_entropy) over the whole set, eval mode, in chunks."""
    module = GraphModule(graph)
    module.load_state(weights)
    module.eval()
    # Every node's output is kept for the whole batch: bound the batch by memory, not only by count.
    batch_size = activation_memory(module.graph).batch_within(EVAL_MEMORY_BYTES, batch_size)
    spec = module.graph.loss
    loss_sum, denominator, correct, count = 0.0, 0.0, 0, 0
    for x, y in _chunks(inputs, targets, batch_size):
        out, target = module({**y, **x}), module.loss_target(y)
        # Each chunk's mean counts by what it divides by, so the result is the mean over the whole set.
        part = ops.loss_denominator(spec.op, target, spec.attrs, module.loss_weight())
        if part > 0:  # else torch's mean is 0/0: a chunk of nothing but ignored targets
            loss_sum += float(module.loss(out, y)) * part
            denominator += part
        if spec.op == "cross_entropy":
            scored = target != spec.attrs["ignore_index"]
            correct += int((out.argmax(-1) == target)[scored].sum())
            count += int(scored.sum())
    result = {"loss": loss_sum / denominator if denominator > 0 else 0.0}
    if spec.op == "cross_entropy":
        result["accuracy"] = correct / max(count, 1)
    return result


def _chunks(
    inputs: Mapping[str, Tensor], targets: Mapping[str, Tensor], size: int
) -> Iterator[tuple[dict[str, Tensor], dict[str, Tensor]]]:
    n = len(next(iter(inputs.values())))
    for start in range(0, n, size):
        yield _slice(inputs, start, start + size), _slice(targets, start, start + size)
