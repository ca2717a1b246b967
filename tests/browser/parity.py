"""Helpers shared by the browser tests: tensors in and out of the page, PyTorch references, errors."""

from __future__ import annotations

import base64
import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from tests.browser.graphs import Graph, Tensors

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"


def b64(tensors: Tensors) -> str:
    return base64.b64encode(st_save({k: v.contiguous() for k, v in tensors.items()})).decode()


def unb64(text: str) -> bytes:
    return base64.b64decode(text)


def tensors_from_b64(text: str) -> Tensors:
    return st_load(unb64(text))


def split_batch(g: Graph, batch: Tensors) -> tuple[Tensors, Tensors]:
    inputs = {s["name"]: batch[s["name"]] for s in g["inputs"]}
    targets = {s["name"]: batch[s["name"]] for s in g["targets"]}
    return inputs, targets


def rel_error(got: torch.Tensor, want: torch.Tensor, floor: float = 1e-12) -> float:
    """max |got - want| / max |want|: relative to the tensor's scale, so tiny entries don't dominate.
    `floor` bounds the scale from below for tensors whose exact value is ~0."""
    got, want = got.double().reshape(want.shape), want.double()
    return float((got - want).abs().max() / want.abs().max().clamp_min(floor)) if want.numel() else 0.0


def max_errors(got: Tensors, want: Tensors, floor: float = 1e-12) -> dict[str, float]:
    assert set(got) == set(want), (sorted(got), sorted(want))
    return {name: rel_error(got[name], want[name], floor) for name in want}


def gradient_floor(grads: Tensors) -> float:
    """1e-6 of the largest gradient anywhere: a gradient that is exactly zero in theory (e.g. attention
    key biases, which softmax cancels) is compared against the model's gradient scale, not ~1e-19."""
    return _largest(grads, 1e-6)


def buffer_floor(buffers: Tensors) -> float:
    """1e-4 of the largest buffer value: a running mean that is exactly zero in theory (batch norm after a
    bias-free conv of batch-normed channels) is float32 noise of ~1e-9, compared against the scale of the
    model's statistics rather than against itself."""
    return _largest(buffers, 1e-4)


def _largest(tensors: Tensors, fraction: float) -> float:
    """`fraction` of the largest magnitude in any of `tensors` (0 when there are none)."""
    return fraction * max((float(t.abs().max()) for t in tensors.values() if t.numel()), default=0.0)


def perturbed(weights: Tensors, seed: int, steps: int = 4) -> Tensors:
    """The float32 weights, each times 1 + k / 2**24 for a random whole k, |k| <= `steps` (2**-24: float32's
    relative rounding, half an ulp or less): the same model as far as float32 can tell."""
    gen = torch.Generator().manual_seed(seed)
    return {
        k: v * (1 + torch.randint(-steps, steps + 1, v.shape, generator=gen) * 2.0**-24)
        if v.dtype == torch.float32
        else v
        for k, v in weights.items()
    }


def record(name: str, data: Any) -> None:
    """Append a result line to test-artifacts/ (gitignored) so numbers can be reported."""
    ARTIFACTS.mkdir(exist_ok=True)
    with (ARTIFACTS / "browser-parity.jsonl").open("a") as handle:
        handle.write(json.dumps({"test": name, **data}) + "\n")


@contextlib.contextmanager
def _float64_inputs() -> Iterator[None]:
    """engine.runtime casts float inputs to float32; let them through as float64 for a reference."""
    import engine.runtime as rt

    original = rt._cast
    rt._cast = lambda value, spec: (
        original(value, spec).double() if spec.dtype == "float32" else original(value, spec)
    )
    try:
        yield
    finally:
        rt._cast = original


def float64_gradients(g: Graph, weights: Tensors, batch: Tensors) -> Tensors:
    """The exact (float64) gradients: the yardstick for how accurate float32 PyTorch itself is."""
    return float64_step(g, weights, batch)[0]


def float64_step(g: Graph, weights: Tensors, batch: Tensors) -> tuple[Tensors, Tensors]:
    """The exact (float64) gradients and updated buffers of one training step."""
    from engine.runtime import GraphModule

    inputs, targets = split_batch(g, batch)
    with _float64_inputs():
        module = GraphModule(g).double()
        module.load_state({k: v.double() for k, v in weights.items()})
        module.train()
        module.loss(module({**targets, **inputs}), targets).backward()
    state = module.state()
    buffers = {b["name"]: state[b["name"]].float() for b in g["buffers"]}
    return {k: v.float() for k, v in module.grads().items()}, buffers


def float64_local_steps(
    g: Graph, weights: Tensors, batch: Tensors, batch_size: int, lr: float, momentum: float
) -> Tensors:
    """engine.runtime.local_steps in float64: the exact deltas, to judge float32 PyTorch and TF.js by."""
    from engine.runtime import GraphModule, _slice

    inputs, targets = split_batch(g, batch)
    n = len(next(iter(inputs.values())))
    with _float64_inputs():
        module = GraphModule(g).double()
        module.load_state({k: v.double() for k, v in weights.items()})
        module.train()
        optimizer = torch.optim.SGD(module.parameters(), lr=lr, momentum=momentum)
        for start in range(0, n, batch_size):
            x, y = _slice(inputs, start, start + batch_size), _slice(targets, start, start + batch_size)
            optimizer.zero_grad()
            module.loss(module({**y, **x}), y).backward()
            optimizer.step()
    state = module.state()
    return {p["name"]: weights[p["name"]].double() - state[p["name"]] for p in g["params"]}
