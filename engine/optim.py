"""Server-side optimizer steps, the twin of frontend/static/engine/optim.js (same torch.optim rules).

Parameters, gradients and optimizer states are flat ``dict[str, Tensor]`` so they can be stored with
engine.codecs. State keys are ``"<kind>:<param name>"`` (kind has no ':', so the first ':' splits
unambiguously even though param names may contain ':'). All functions are pure (inputs are never modified)
but the in-place twins ending in ``_``, which the server uses on weights it owns: the same operations in the
same order, so the same numbers, without allocating a second copy of the model.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor

Tensors = Mapping[str, Tensor]


def sgd_step(
    params: Tensors,
    grads: Tensors,
    state: Tensors,
    lr: float,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    dampening: float = 0.0,
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


def sgd_step_(
    params: dict[str, Tensor],
    grads: Mapping[str, Tensor],
    state: dict[str, Tensor],
    lr: float,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    dampening: float = 0.0,
) -> None:
    """sgd_step in place: changes `params` and `state`, and uses `grads` as scratch (garbage afterwards)."""
    for name, grad in grads.items():
        p = params[name]
        d_p = grad.add_(p, alpha=weight_decay) if weight_decay else grad
        if momentum:
            key = f"momentum_buffer:{name}"
            buf = state.get(key)
            if buf is None:
                buf = state[key] = d_p.clone()
            else:
                buf.mul_(momentum).add_(d_p, alpha=1 - dampening)
            d_p = d_p.add_(buf, alpha=momentum) if nesterov else buf
        p.add_(d_p, alpha=-lr)


def outer_nesterov_step(
    params: Tensors, deltas: Tensors, state: Tensors, lr: float = 0.7, momentum: float = 0.9
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """DiLoCo outer step: SGD with Nesterov momentum on the averaged pseudo-gradient.

    ``deltas`` are averaged ``params_before_round - params_after_local_training``; with lr=1 and
    momentum=0 this is plain model averaging.
    """
    return sgd_step(params, deltas, state, lr, momentum=momentum, nesterov=momentum > 0)


def server_step(
    params: Tensors,
    update: Tensors,
    state: Tensors,
    *,
    averaging: bool,
    lr: float,
    momentum: float,
    weight_decay: float,
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """A project's server step: the outer Nesterov step on averaged deltas in averaging mode, else SGD on
    the averaged gradient. The platform and the one-CPU baseline share it, so they step alike."""
    if averaging:
        return outer_nesterov_step(params, update, state, lr=lr, momentum=momentum)
    return sgd_step(params, update, state, lr, momentum=momentum, weight_decay=weight_decay)


def server_step_(
    params: dict[str, Tensor],
    update: Mapping[str, Tensor],
    state: dict[str, Tensor],
    *,
    averaging: bool,
    lr: float,
    momentum: float,
    weight_decay: float,
) -> None:
    """server_step in place (see sgd_step_): `params` and `state` become the next version's."""
    if averaging:
        sgd_step_(params, update, state, lr, momentum=momentum, nesterov=momentum > 0)
    else:
        sgd_step_(params, update, state, lr, momentum=momentum, weight_decay=weight_decay)


def momentum_recovered(
    before: Tensors,
    after: Tensors,
    prior: Tensors,
    names: list[str],
    *,
    nesterov: bool,
    lr: float,
    momentum: float,
) -> dict[str, Tensor]:
    """The momentum buffers an sgd_step_ (dampening 0) left, recomputed from the params it started from
    (`before`), the ones it produced (`after`) and, with Nesterov, the buffers it started from (`prior`;
    none on a first step): equal to the lost ones up to float32 rounding. The step moved each param by
    -lr * buf (weight decay is inside buf), or by -lr * (g + momentum * buf) with Nesterov, where
    buf = momentum * prior + g, so buf = (moved / lr + momentum * prior) / (1 + momentum)."""
    state: dict[str, Tensor] = {}
    for name in names:
        key = f"momentum_buffer:{name}"
        buf = (before[name] - after[name]).div_(lr)
        if nesterov:
            if (previous := prior.get(key)) is not None:
                buf.add_(previous, alpha=momentum)
            buf.div_(1 + momentum)
        state[key] = buf
    return state
