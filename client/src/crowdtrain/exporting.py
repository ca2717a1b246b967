"""A researcher's nn.Module class to the graph + weights the server trains, with the server's own exporter
(engine.export, shipped inside this package: the same module, not a copy)."""

from __future__ import annotations

import importlib
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn

from engine import codecs
from engine.export import ExportError, export_module

from .errors import CrowdtrainError

INPUT_DTYPES = ("float32", "int64")
LOSSES = ("cross_entropy", "mse", "l1")
MAX_DIM = 2**20


@dataclass(frozen=True)
class Exported:
    graph: dict[str, Any]
    weights: dict[str, Tensor] = field(repr=False)

    def weights_bytes(self) -> bytes:
        return codecs.encode(self.weights)  # fp32 safetensors, as the server stores versions


def parse_shape(text: str) -> tuple[int, ...]:
    """'1,28,28' -> (1, 28, 28): one sample's shape, without the batch dimension."""
    try:
        shape = tuple(int(part) for part in text.replace(" ", "").split(","))
    except ValueError:
        raise CrowdtrainError(f"an input shape is integers like 1,28,28; got {text!r}") from None
    if not shape or any(not 0 < dim <= MAX_DIM for dim in shape):
        raise CrowdtrainError(f"input shape dimensions must be between 1 and {MAX_DIM}; got {text!r}")
    return shape


def parse_kwargs(text: str | None) -> dict[str, Any]:
    if not text:
        return {}
    try:
        kwargs = json.loads(text)
    except ValueError as exc:
        raise CrowdtrainError(f"--kwargs is not JSON: {exc}") from None
    if not isinstance(kwargs, dict):
        raise CrowdtrainError('--kwargs must be a JSON object, e.g. {"hidden": 128}')
    return kwargs


def import_class(spec: str) -> type[nn.Module]:
    """'mypkg.models:Net' -> the class, importable from the current directory as researchers expect."""
    module_name, _, class_name = spec.partition(":")
    if not module_name or not class_name:
        raise CrowdtrainError(f"expected module:Class (e.g. mypkg.models:Net); got {spec!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # the researcher's module may raise anything while importing
        raise CrowdtrainError(f"cannot import {module_name!r}: {type(exc).__name__}: {exc}") from exc
    cls = getattr(module, class_name, None)
    if not isinstance(cls, type) or not issubclass(cls, nn.Module):
        raise CrowdtrainError(f"{class_name!r} in {module_name!r} is not a torch.nn.Module subclass")
    return cls


def instantiate(cls: type[nn.Module], kwargs: dict[str, Any]) -> nn.Module:
    try:
        return cls(**kwargs)
    except Exception as exc:  # the researcher's constructor may raise anything
        raise CrowdtrainError(
            f"{cls.__qualname__}(**{kwargs!r}) failed: {type(exc).__name__}: {exc}"
        ) from exc


def export(
    module: nn.Module,
    input_shape: tuple[int, ...],
    *,
    input_dtype: str = "float32",
    loss: str | nn.Module = "cross_entropy",
    name: str = "model",
) -> Exported:
    """Trace ``module`` (parameter and buffer names kept as in its state_dict)."""
    try:
        graph, weights = export_module(module, input_shape, input_dtype=input_dtype, loss=loss, name=name)
    except ExportError as exc:  # names the op and the module path
        raise CrowdtrainError(f"cannot export {name}: {exc}") from exc
    except Exception as exc:  # the researcher's forward may raise anything on the exporter's sample batch
        raise CrowdtrainError(
            f"cannot export {name}: its forward pass failed: {type(exc).__name__}: {exc}"
        ) from exc
    return Exported(graph=graph, weights=weights)
