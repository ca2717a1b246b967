"""Helpers shared by the engine tests: cached preset exports and matching example batches."""

from __future__ import annotations

from functools import cache
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.presets import PRESETS, build_preset, export_preset


@cache
def exported(name: str) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """Export each preset once per session (resnet18's init alone takes a second)."""
    return export_preset(name, seed=0)


def preset_module(name: str) -> nn.Module:
    return build_preset(name, seed=0)


def preset_batch(name: str, batch: int = 2, seed: int = 1) -> tuple[Tensor, Tensor]:
    spec = PRESETS[name]
    g = torch.Generator().manual_seed(seed)
    if spec.input_dtype == "int64":
        x = torch.randint(0, spec.classes, (batch, *spec.input_shape), generator=g)
        y = torch.randint(0, spec.classes, (batch, *spec.input_shape), generator=g)
    else:
        x = torch.randn((batch, *spec.input_shape), generator=g)
        y = torch.randint(0, spec.classes, (batch,), generator=g)
    return x, y


def reference_loss(out: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def reference_grads(module: nn.Module, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """(output, loss, grads by param name) of the plain torch module."""
    module.zero_grad()
    out = module(x)
    loss = reference_loss(out, y)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}
    return out.detach(), loss.detach(), grads
