"""Checking volunteers' updates and combining them into one (aggregation rules).

Updates are flat ``dict[str, Tensor]`` so they can be stored with engine.codecs, or codecs.Packed blobs
(mappings that decode on access), which check_update and WeightedSum read without decoding them. All
functions are pure: inputs are never modified. The server's optimizer steps that apply the result are in
engine.optim.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from engine.codecs import Packed

Tensors = Mapping[str, Tensor]


def _check_same_keys(updates: Sequence[Tensors]) -> list[str]:
    if not updates:
        raise ValueError("no updates to aggregate")
    names = list(updates[0])
    for u in updates[1:]:
        if set(u) != set(names):
            raise ValueError("updates have different tensor names")
    return names


def weighted_mean(updates: Sequence[Tensors], weights: Sequence[float]) -> dict[str, Tensor]:
    """Sum of w_i * u_i / sum(w_i), e.g. weighted by each volunteer's sample count."""
    names = _check_same_keys(updates)
    if len(weights) != len(updates) or any(w < 0 or not math.isfinite(w) for w in weights):
        raise ValueError("need one finite non-negative weight per update")
    total = float(sum(weights))
    if total <= 0:
        raise ValueError("weights sum to zero")
    return {
        n: sum(
            (u[n].float() * (w / total) for u, w in zip(updates, weights, strict=True)),
            torch.zeros_like(updates[0][n], dtype=torch.float32),
        )
        for n in names
    }


class WeightedSum:
    """sum(w_i * u_i) / sum(w_i) over updates folded in one at a time, so a round holds one sum, not every
    update: weighted_mean's result (within float32 rounding) in the memory of one update. Packed updates are
    dequantized straight into the sum, never decoded into a float copy of their own."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names, self.total, self.count = list(names), 0.0, 0
        self._sums: dict[str, Tensor] = {}

    def add(self, update: Tensors, weight: float) -> None:
        if weight < 0 or not math.isfinite(weight):
            raise ValueError("need a finite non-negative weight")
        missing = [name for name in self.names if name not in update]
        if missing:
            raise ValueError(f"the update has no {missing[:5]}")
        if not self._sums:
            self._sums = {name: torch.zeros(_shape(update, name)) for name in self.names}
        if isinstance(update, Packed):
            update.select(self.names).add_to(self._sums, weight)
        else:
            _add_to(self._sums, update, weight)
        self.total, self.count = self.total + weight, self.count + 1

    def mean(self) -> dict[str, Tensor]:
        """The weighted mean; the sum is spent (its tensors are the result's)."""
        if not self.count:
            raise ValueError("no updates to aggregate")
        if self.total <= 0:
            raise ValueError("weights sum to zero")
        sums, self._sums, self.count = self._sums, {}, 0
        return {name: value.div_(self.total) for name, value in sums.items()}


def _add_to(sums: dict[str, Tensor], update: Tensors, weight: float) -> None:
    """Packed.add_to for decoded tensors."""
    for name, value in sums.items():
        if tuple(update[name].shape) != tuple(value.shape):
            raise ValueError(f"'{name}' has shape {tuple(update[name].shape)}, its sum {tuple(value.shape)}")
    for name, value in sums.items():
        value.add_(update[name].float(), alpha=weight)


def _shape(update: Tensors, name: str) -> tuple[int, ...]:
    return update.shape(name) if isinstance(update, Packed) else tuple(update[name].shape)


def _stack(updates: Sequence[Tensors], name: str) -> Tensor:
    return torch.stack([u[name].float() for u in updates])


def trimmed_mean(updates: Sequence[Tensors], trim: float) -> dict[str, Tensor]:
    """Per coordinate, drop the floor(trim*n) largest and smallest values and average the rest."""
    names = _check_same_keys(updates)
    if not 0 <= trim < 0.5:
        raise ValueError("trim must be in [0, 0.5)")
    k, n = int(trim * len(updates)), len(updates)
    return {name: _stack(updates, name).sort(dim=0).values[k : n - k].mean(dim=0) for name in names}


def coordinate_median(updates: Sequence[Tensors]) -> dict[str, Tensor]:
    """Per-coordinate median (mean of the two middle values for an even count)."""
    names = _check_same_keys(updates)
    n = len(updates)
    out = {}
    for name in names:
        s = _stack(updates, name).sort(dim=0).values
        out[name] = (s[(n - 1) // 2] + s[n // 2]) / 2
    return out


def check_update(update: Tensors, expected: Mapping[str, tuple[int, ...]]) -> str | None:
    """Why ``update`` must be rejected (wrong names, shapes, non-finite values), or None if fine."""
    missing, extra = sorted(set(expected) - set(update)), sorted(set(update) - set(expected))
    if missing or extra:
        return f"tensor names differ: missing {missing[:5]}, unexpected {extra[:5]}"
    for name, shape in expected.items():
        if isinstance(update, Packed):
            reason = _packed_problem(update, name, shape)
        else:
            reason = _tensor_problem(update[name], name, shape)
        if reason:
            return reason
    return None


def _tensor_problem(t: object, name: str, shape: tuple[int, ...]) -> str | None:
    if not isinstance(t, Tensor) or tuple(t.shape) != tuple(shape):
        got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
        return f"'{name}' has shape {got}, expected {tuple(shape)}"
    if not t.is_floating_point():
        return f"'{name}' is not a float tensor ({t.dtype})"
    if not bool(torch.isfinite(t).all()):
        return f"'{name}' contains NaN or infinite values"
    return None


def _packed_problem(update: Packed, name: str, shape: tuple[int, ...]) -> str | None:
    """_tensor_problem's verdict, from the blob's header and scales rather than its decoded values."""
    if update.shape(name) != tuple(shape):
        return f"'{name}' has shape {update.shape(name)}, expected {tuple(shape)}"
    if not update.is_float(name):
        return f"'{name}' is not a float tensor ({update.dtype(name)})"
    if not update.finite(name):
        return f"'{name}' contains NaN or infinite values"
    return None
