"""Checking volunteers' updates and combining them into one (aggregation rules).

Updates are flat ``dict[str, Tensor]`` so they can be stored with engine.codecs. All functions are
pure: inputs are never modified. The server's optimizer steps that apply the result are in engine.optim.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

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
        t = update[name]
        if not isinstance(t, Tensor) or tuple(t.shape) != tuple(shape):
            got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            return f"'{name}' has shape {got}, expected {tuple(shape)}"
        if not t.is_floating_point():
            return f"'{name}' is not a float tensor ({t.dtype})"
        if not bool(torch.isfinite(t).all()):
            return f"'{name}' contains NaN or infinite values"
    return None
