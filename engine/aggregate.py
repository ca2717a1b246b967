"""Combining volunteers' updates and applying them on the server.

Updates and optimizer states are flat ``dict[str, Tensor]`` so they can be stored with
engine.codecs. Optimizer state keys are ``"<kind>:<param name>"`` (kind has no ':', so the first ':'
splits unambiguously even though param names may contain ':'). All functions are pure: inputs are
never modified.
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
    return {n: sum((u[n].float() * (w / total) for u, w in zip(updates, weights, strict=True)),
                   torch.zeros_like(updates[0][n], dtype=torch.float32)) for n in names}


def _stack(updates: Sequence[Tensors], name: str) -> Tensor:
    return torch.stack([u[name].float() for u in updates])


def trimmed_mean(updates: Sequence[Tensors], trim: float) -> dict[str, Tensor]:
    """Per coordinate, drop the floor(trim*n) largest and smallest values and average the rest."""
    names = _check_same_keys(updates)
    if not 0 <= trim < 0.5:
        raise ValueError("trim must be in [0, 0.5)")
    k, n = int(trim * len(updates)), len(updates)
    return {name: _stack(updates, name).sort(dim=0).values[k : n - k].mean(dim=0)
            for name in names}


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


def sgd_step(params: Tensors, grads: Tensors, state: Tensors, lr: float, momentum: float = 0.0,
             weight_decay: float = 0.0, nesterov: bool = False, dampening: float = 0.0
             ) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """One step of torch.optim.SGD (same formulas, same order of operations).

    State: ``"momentum_buffer:<name>"``; a missing buffer starts as the first gradient, like torch.
    """
    new_params, new_state = dict(params), dict(state)
    for name, grad in grads.items():
        p = params[name]
        d_p = grad.add(p, alpha=weight_decay) if weight_decay else grad.clone()
        if momentum:
            key = f"momentum_buffer:{name}"
            buf = state.get(key)
            buf = d_p.clone() if buf is None else buf.mul(momentum).add_(d_p, alpha=1 - dampening)
            new_state[key] = buf
            d_p = d_p.add(buf, alpha=momentum) if nesterov else buf
        new_params[name] = p.add(d_p, alpha=-lr)
    return new_params, new_state


def adam_step(params: Tensors, grads: Tensors, state: Tensors, lr: float = 1e-3,
              betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
              weight_decay: float = 0.0) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """One step of torch.optim.Adam (non-amsgrad, single-tensor path).

    State: ``"step:<name>"`` (0-d float), ``"exp_avg:<name>"``, ``"exp_avg_sq:<name>"``.
    """
    beta1, beta2 = betas
    new_params, new_state = dict(params), dict(state)
    for name, grad in grads.items():
        p = params[name]
        step = float(state.get(f"step:{name}", torch.tensor(0.0))) + 1
        exp_avg = state.get(f"exp_avg:{name}", torch.zeros_like(p)).clone()
        exp_avg_sq = state.get(f"exp_avg_sq:{name}", torch.zeros_like(p)).clone()
        if weight_decay:
            grad = grad.add(p, alpha=weight_decay)
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        step_size = lr / (1 - beta1**step)
        denom = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2**step)).add_(eps)
        new_params[name] = p.addcdiv(exp_avg, denom, value=-step_size)
        new_state[f"step:{name}"] = torch.tensor(step)
        new_state[f"exp_avg:{name}"], new_state[f"exp_avg_sq:{name}"] = exp_avg, exp_avg_sq
    return new_params, new_state


def outer_nesterov_step(params: Tensors, deltas: Tensors, state: Tensors, lr: float = 0.7,
                        momentum: float = 0.9) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """DiLoCo outer step: SGD with Nesterov momentum on the averaged pseudo-gradient.

    ``deltas`` are averaged ``params_before_round - params_after_local_training``; with lr=1 and
    momentum=0 this is plain model averaging.
    """
    return sgd_step(params, deltas, state, lr, momentum=momentum, nesterov=momentum > 0)
