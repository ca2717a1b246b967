"""Server optimizer steps, checked against torch.optim."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.aggregate import weighted_mean
from engine.optim import outer_nesterov_step, server_step, server_step_, sgd_step, sgd_step_


def _updates(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{"w": torch.randn(3, 4, generator=g), "b": torch.randn(4, generator=g)} for _ in range(n)]


def _reference(
    opt_cls: type[torch.optim.Optimizer], steps: int, **kw: Any
) -> tuple[list[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """Grads used and final params of a real torch optimizer run."""
    start = _updates(1, seed=42)[0]
    params = {k: torch.nn.Parameter(v.clone()) for k, v in start.items()}
    opt = opt_cls(list(params.values()), **kw)
    grads = []
    for i in range(steps):
        g = _updates(1, seed=i)[0]
        grads.append(g)
        for k, p in params.items():
            p.grad = g[k].clone()
        opt.step()
    return grads, {k: p.detach() for k, p in params.items()}


SGD_CONFIGS = [
    {"lr": 0.1},
    {"lr": 0.1, "momentum": 0.9},
    {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01},
    {"lr": 0.05, "momentum": 0.8, "dampening": 0.3, "weight_decay": 0.1},
]


@pytest.mark.parametrize("config", SGD_CONFIGS)
def test_sgd_step_matches_torch(config: dict[str, float]) -> None:
    grads, expected = _reference(torch.optim.SGD, 4, **config)
    params, state = dict(_updates(1, seed=42)[0]), dict[str, torch.Tensor]()
    for g in grads:
        params, state = sgd_step(params, g, state, **config)  # type: ignore[arg-type]
    for k in expected:
        torch.testing.assert_close(params[k], expected[k], atol=1e-6, rtol=1e-6)
    if config.get("momentum"):
        assert set(state) == {"momentum_buffer:w", "momentum_buffer:b"}


@pytest.mark.parametrize("config", SGD_CONFIGS)
def test_sgd_step_does_not_mutate_its_inputs(config: dict[str, float]) -> None:
    params, grads = _updates(1, seed=1)[0], _updates(1, seed=2)[0]
    _, state = sgd_step(params, grads, {}, **config)  # type: ignore[arg-type]
    frozen = [{k: v.clone() for k, v in d.items()} for d in (params, grads, state)]
    sgd_step(params, grads, state, **config)  # type: ignore[arg-type]
    for before, after in zip(frozen, (params, grads, state), strict=True):
        assert all(torch.equal(before[k], after[k]) for k in before)


def test_outer_nesterov_step() -> None:
    before = _updates(1, seed=3)[0]
    locals_ = [{k: v - 0.1 * d[k] for k, v in before.items()} for d in _updates(4, seed=4)]
    avg = weighted_mean(locals_, [1.0] * 4)
    deltas = {k: before[k] - avg[k] for k in before}
    # lr 1 without momentum is plain model averaging.
    plain, _ = outer_nesterov_step(before, deltas, {}, lr=1.0, momentum=0.0)
    for k in before:
        torch.testing.assert_close(plain[k], avg[k])
    # Otherwise it is torch's SGD with Nesterov momentum on the pseudo-gradient.
    params = {k: torch.nn.Parameter(v.clone()) for k, v in before.items()}
    opt = torch.optim.SGD(list(params.values()), lr=0.7, momentum=0.9, nesterov=True)
    ours, state = dict(before), dict[str, torch.Tensor]()
    for _ in range(3):
        for k, p in params.items():
            p.grad = deltas[k].clone()
        opt.step()
        ours, state = outer_nesterov_step(ours, deltas, state, lr=0.7, momentum=0.9)
    for k in before:
        torch.testing.assert_close(ours[k], params[k].detach())


@pytest.mark.parametrize("config", SGD_CONFIGS)
def test_the_in_place_step_gives_exactly_the_pure_steps_numbers(config: dict[str, float]) -> None:
    """The server steps the weights it owns in place (no second copy): the same numbers, bit for bit."""
    pure, pure_state = dict(_updates(1, seed=42)[0]), dict[str, torch.Tensor]()
    owned, owned_state = {k: v.clone() for k, v in pure.items()}, dict[str, torch.Tensor]()
    for i in range(4):
        grads = _updates(1, seed=i)[0]
        pure, pure_state = sgd_step(pure, grads, pure_state, **config)  # type: ignore[arg-type]
        sgd_step_(owned, {k: v.clone() for k, v in grads.items()}, owned_state, **config)  # type: ignore[arg-type]
    assert all(torch.equal(pure[k], owned[k]) for k in pure)
    assert pure_state.keys() == owned_state.keys()
    assert all(torch.equal(pure_state[k], owned_state[k]) for k in pure_state)


@pytest.mark.parametrize("averaging", [True, False])
def test_the_in_place_server_step_is_the_server_step(averaging: bool) -> None:
    rule = {"averaging": averaging, "lr": 0.7, "momentum": 0.9, "weight_decay": 0.01}
    params, state = _updates(1, seed=5)[0], dict[str, torch.Tensor]()
    owned, owned_state = {k: v.clone() for k, v in params.items()}, dict[str, torch.Tensor]()
    for i in range(3):
        update = _updates(1, seed=10 + i)[0]
        params, state = server_step(params, update, state, **rule)  # type: ignore[arg-type]
        server_step_(owned, {k: v.clone() for k, v in update.items()}, owned_state, **rule)  # type: ignore[arg-type]
    assert all(torch.equal(params[k], owned[k]) for k in params)
    assert all(torch.equal(state[k], owned_state[k]) for k in state)


@pytest.mark.parametrize(
    "config",
    [{"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}, {"lr": 0.7, "momentum": 0.9, "nesterov": True}],
)
def test_momentum_is_recovered_from_the_weights_a_step_moved(config: dict[str, Any]) -> None:
    """A step's lost momentum buffers, recomputed from the weights before and after it (and, with Nesterov,
    the buffers before it), are the real ones up to float32 rounding, on a first step and later ones."""
    from engine.optim import momentum_recovered

    params, state = _updates(1, seed=7)[0], dict[str, torch.Tensor]()
    for step, grad in enumerate(_updates(3, seed=3)):
        before, prior = {k: v.clone() for k, v in params.items()}, {k: v.clone() for k, v in state.items()}
        sgd_step_(params, grad, state, **config)
        recovered = momentum_recovered(
            before,
            params,
            prior,
            list(params),
            nesterov=bool(config.get("nesterov")),
            lr=config["lr"],
            momentum=config["momentum"],
        )
        assert recovered.keys() == state.keys(), step
        for key, value in state.items():
            torch.testing.assert_close(recovered[key], value, rtol=1e-4, atol=1e-5)
