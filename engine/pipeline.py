"""Stage work units on the server interpreter (engine/runtime.py), stateless as BOINC work units are.

A forward unit maps a micro-batch's input activation to the stage's output activation. A backward unit
gets the same input again (the server keeps it), recomputes the forward (activation recomputation: no
device holds activations between units) and turns the gradient of the output into the gradient of the
input and of the stage's parameters. The last stage has only the backward unit, which takes the targets
and returns the loss. Dropout draws from ``seed``, so the recomputed forward draws the forward's masks.

Micro-batch gradients add up to the whole batch's when each micro-batch's loss is scaled by its share of
the batch's loss denominator (loss_scales), in any mode without batch statistics; batch norm in train mode
normalises each micro-batch by its own statistics (as GPipe does), which no scaling undoes.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor

from engine import ops
from engine.graph import Graph
from engine.partition import Stage
from engine.runtime import GraphModule

MAX_SEED = 2**63 - 1


class StageUnitError(ValueError):
    """A work unit's inputs do not fit its stage; the message names the offending part."""


@dataclass(frozen=True)
class ForwardResult:
    output: Tensor
    buffers: dict[str, Tensor]  # the stage's trained buffers after this forward (batch norm statistics)


@dataclass(frozen=True)
class BackwardResult:
    input_grad: Tensor | None  # None for the first stage, and when nothing before the stage trains
    grads: dict[str, Tensor]  # by param name; zeros for params the output does not depend on
    loss: float | None  # the last stage's unscaled loss
    buffers: dict[str, Tensor]  # the trained buffers after the recomputed forward, as ForwardResult's


def stage_weights(stage: Stage, weights: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The stage's params and buffers, picked from the whole model's weights by name."""
    missing = [s.name for s in (*stage.graph.params, *stage.graph.buffers) if s.name not in weights]
    if missing:
        raise StageUnitError(f"stage {stage.index}: missing weights {missing[:5]}")
    return {s.name: weights[s.name] for s in (*stage.graph.params, *stage.graph.buffers)}


def stage_forward(
    stage: Stage,
    weights: Mapping[str, Tensor],
    inputs: Tensor | Mapping[str, Tensor],
    *,
    seed: int | None = None,
    training: bool = True,
) -> ForwardResult:
    """The forward unit: the output activation of ``inputs`` (the activation, or the graph's inputs by
    name for the first stage), and the trained buffers this micro-batch updated."""
    module = _module(stage, weights, training)
    with torch.no_grad(), _seeded(seed):
        output = module(_feed(stage, inputs, None, grad=False))
    return ForwardResult(output, _trained(stage, module))


def stage_backward(
    stage: Stage,
    weights: Mapping[str, Tensor],
    inputs: Tensor | Mapping[str, Tensor],
    output_grad: Tensor | None = None,
    *,
    targets: Mapping[str, Tensor] | None = None,
    loss_scale: float = 1.0,
    seed: int | None = None,
    training: bool = True,
) -> BackwardResult:
    """The backward unit: recompute the forward from ``inputs`` with the forward unit's ``seed``, then
    backpropagate ``output_grad`` (or, in the last stage, the loss of ``targets`` times ``loss_scale``).
    Its result reports the trained buffers after that forward too: the server applies a backward result's."""
    _check_unit(stage, output_grad, targets, loss_scale)
    module = _module(stage, weights, training)
    feed = _feed(stage, inputs, targets, grad=stage.needs_input_grad)
    with _seeded(seed):
        output = module(feed)
    loss = _backpropagate(module, stage, output, output_grad, targets or {}, loss_scale)
    return BackwardResult(_input_grad(stage, feed), module.grads(), loss, _trained(stage, module))


def loss_scales(
    graph: Graph, weights: Mapping[str, Tensor], targets: Sequence[Mapping[str, Tensor]]
) -> list[float]:
    """Each micro-batch's share of the batch's loss denominator (its samples, or for cross_entropy its
    scored targets' class weights): scaled by these, micro-batch gradients sum to the batch's gradient."""
    loss = graph.loss
    weight = None if loss.weight is None else torch.as_tensor(weights[loss.weight])
    parts = [ops.loss_denominator(loss.op, _loss_target(graph, t), loss.attrs, weight) for t in targets]
    total = sum(parts)
    return [part / total if total > 0 else 0.0 for part in parts]


# ---------------------------------------------------------------- helpers


def _loss_target(graph: Graph, targets: Mapping[str, Tensor]) -> Tensor:
    name = graph.loss.inputs[1]
    if name not in targets:
        raise StageUnitError(f"missing target '{name}'")
    target = torch.as_tensor(targets[name])
    return target.long() if graph.loss.op == "cross_entropy" else target


def _check_unit(
    stage: Stage, output_grad: Tensor | None, targets: Mapping[str, Tensor] | None, scale: float
) -> None:
    if stage.last and (targets is None or output_grad is not None):
        raise StageUnitError(f"stage {stage.index} is the last: it takes targets, not an output gradient")
    if not stage.last and (output_grad is None or targets is not None):
        raise StageUnitError(f"stage {stage.index} takes the gradient of its output, not targets")
    if not (isinstance(scale, (int, float)) and 0.0 <= scale < float("inf")):
        raise StageUnitError(f"loss_scale must be finite and non-negative, got {scale!r}")


@contextmanager
def _seeded(seed: int | None) -> Iterator[None]:
    """Dropout masks from ``seed`` without disturbing the caller's RNG; None draws from the global RNG."""
    if seed is None:
        yield
        return
    if not (isinstance(seed, int) and 0 <= seed <= MAX_SEED):
        raise StageUnitError(f"seed must be an integer from 0 to {MAX_SEED}, got {seed!r}")
    with torch.random.fork_rng(devices=[]):
        # The CPU generator only, as torch.manual_seed seeds it: that also seeds every accelerator
        # lazily, recording a stack trace each time (40% of a small unit's time), and fork_rng restores
        # none of them.
        torch.default_generator.manual_seed(seed)
        yield


def _module(stage: Stage, weights: Mapping[str, Tensor], training: bool) -> GraphModule:
    module = GraphModule(stage.graph)
    module.load_state(stage_weights(stage, weights))
    module.train(training)
    return module


def _trained(stage: Stage, module: GraphModule) -> dict[str, Tensor]:
    state = module.state()
    return {name: state[name] for name in stage.graph.trained_buffers()}


def _feed(
    stage: Stage,
    inputs: Tensor | Mapping[str, Tensor],
    targets: Mapping[str, Tensor] | None,
    grad: bool,
) -> dict[str, Tensor]:
    specs = stage.graph.inputs
    if isinstance(inputs, Tensor):
        if len(specs) != 1:
            raise StageUnitError(f"stage {stage.index} takes inputs {[s.name for s in specs]} by name")
        inputs = {specs[0].name: inputs}
    missing = [s.name for s in specs if s.name not in inputs]
    if missing:
        raise StageUnitError(f"stage {stage.index}: missing inputs {missing}")
    feed = {**(targets or {}), **{s.name: torch.as_tensor(inputs[s.name]) for s in specs}}
    if grad:  # a fresh leaf: the input gradient is read off it after backward
        name = specs[0].name
        feed[name] = feed[name].detach().to(torch.float32).requires_grad_(True)
    return feed


def _backpropagate(
    module: GraphModule,
    stage: Stage,
    output: Tensor,
    output_grad: Tensor | None,
    targets: Mapping[str, Tensor],
    scale: float,
) -> float | None:
    if stage.last:
        loss = module.loss(output, targets)
        if loss.requires_grad:
            torch.autograd.backward(loss * scale)
        return float(loss.detach())
    grad = torch.as_tensor(output_grad)
    if grad.shape != output.shape or not grad.is_floating_point():
        raise StageUnitError(
            f"stage {stage.index}: output gradient has shape {list(grad.shape)} ({grad.dtype}), "
            f"expected {list(output.shape)} float32"
        )
    if output.requires_grad:
        torch.autograd.backward(output, grad.to(output.dtype))
    return None


def _input_grad(stage: Stage, feed: Mapping[str, Tensor]) -> Tensor | None:
    if not stage.needs_input_grad:
        return None
    x = feed[stage.graph.inputs[0].name]
    return torch.zeros_like(x) if x.grad is None else x.grad.detach()
