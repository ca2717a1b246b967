"""The graph's loss from a loss name or a torch loss module (its every attribute honoured or refused)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from engine import ops

from .core import ExportError

LOSS_WEIGHT = "loss:weight"  # ':' appears in no torch name, so it cannot collide with the module's
LOSS_MODULES: dict[type, str] = {nn.CrossEntropyLoss: "cross_entropy", nn.MSELoss: "mse", nn.L1Loss: "l1"}


@dataclass(frozen=True)
class LossSpec:
    op: str
    attrs: dict[str, Any] = field(default_factory=dict)
    weight: Tensor | None = None  # cross_entropy's class weights, exported as the buffer LOSS_WEIGHT


def loss_spec(loss: str | nn.Module) -> LossSpec:
    if isinstance(loss, str):
        if loss not in ops.LOSSES:
            raise ExportError(f"unknown loss {loss!r} (expected one of {list(ops.LOSSES)} or a loss module)")
        return LossSpec(loss)
    op = LOSS_MODULES.get(type(loss))
    if op is None:
        known = ", ".join(f"nn.{c.__name__}" for c in LOSS_MODULES)
        raise ExportError(f"unsupported loss module {type(loss).__name__} (supported: {known})")
    if loss.reduction != "mean":
        raise ExportError(
            f"unsupported argument reduction={loss.reduction!r} of {type(loss).__name__} (also set by the "
            "deprecated size_average/reduce): the graph's loss is a mean"
        )
    return _cross_entropy(loss) if isinstance(loss, nn.CrossEntropyLoss) else LossSpec(op)


def _cross_entropy(loss: nn.CrossEntropyLoss) -> LossSpec:
    weight = loss.weight
    if weight is not None and weight.dtype != torch.float32:
        raise ExportError(
            f"unsupported argument weight of CrossEntropyLoss with dtype={weight.dtype}: float32 only"
        )
    attrs = {"label_smoothing": float(loss.label_smoothing), "ignore_index": int(loss.ignore_index)}
    return LossSpec("cross_entropy", attrs, None if weight is None else weight.detach().clone())
