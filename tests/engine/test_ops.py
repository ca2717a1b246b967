"""Op semantics that are ours rather than a direct torch call, and the loss shape rules."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from engine import spec
from engine.graph import OP_SPECS
from engine.ops import LOSSES, OPS, check_loss_shapes, run_loss, run_op


def test_every_op_and_loss_of_the_spec_file_is_implemented_and_no_other() -> None:
    assert set(OPS) == set(spec.GRAPH["ops"]) == set(OP_SPECS)
    assert set(LOSSES) == set(spec.GRAPH["losses"]) == {"cross_entropy", "mse", "l1"}  # those run_loss knows


@pytest.mark.parametrize(
    ("op", "reference"), [("cross_entropy", F.cross_entropy), ("mse", F.mse_loss), ("l1", F.l1_loss)]
)
def test_each_loss_is_torchs(op: str, reference: Callable[[Tensor, Tensor], Tensor]) -> None:
    pred = torch.randn(4, 3)
    target = torch.randint(0, 3, (4,)) if op == "cross_entropy" else torch.randn(4, 3)
    torch.testing.assert_close(run_loss(op, pred, target), reference(pred, target))


def test_arange_embedding_is_the_first_rows_of_the_table() -> None:
    table = torch.randn(10, 4)
    ids = torch.zeros(3, 6, dtype=torch.int64)
    assert torch.equal(run_op("arange_embedding", [ids, table], {}, False), table[:6])
    with pytest.raises(RuntimeError):
        run_op("arange_embedding", [torch.zeros(1, 11, dtype=torch.int64), table], {}, False)


def test_split_is_a_slice() -> None:
    x = torch.randn(2, 7, 3)
    out = run_op("split", [x], {"dim": 1, "start": 2, "length": 4}, False)
    assert torch.equal(out, x[:, 2:6])


def test_scale_concat_and_pools() -> None:
    x = torch.randn(2, 3, 6, 6)
    assert torch.equal(run_op("scale", [x], {"factor": 0.5}, False), x * 0.5)
    assert torch.equal(run_op("concat", [x, x, x], {"dim": 1}, False), torch.cat([x, x, x], 1))
    pool = {"kernel_size": [3, 3], "stride": [2, 2], "padding": [1, 1]}
    assert torch.equal(run_op("max_pool2d", [x], pool, False), F.max_pool2d(x, 3, 2, 1))
    assert torch.equal(run_op("avg_pool2d", [x], pool, False), F.avg_pool2d(x, 3, 2, 1))


def test_batch_norm_train_updates_running_stats_with_unbiased_variance() -> None:
    x = torch.randn(8, 3, 4, 4)
    mean, var = torch.zeros(3), torch.ones(3)
    attrs = {"eps": 1e-5, "momentum": 0.1}
    run_op("batch_norm", [x, torch.ones(3), torch.zeros(3), mean, var], attrs, True)
    torch.testing.assert_close(mean, 0.1 * x.mean((0, 2, 3)))
    torch.testing.assert_close(var, 0.9 + 0.1 * x.var((0, 2, 3), unbiased=True))
    before = mean.clone()
    run_op("batch_norm", [x, torch.ones(3), torch.zeros(3), mean, var], attrs, False)
    assert torch.equal(mean, before)


def test_sequence_cross_entropy_is_the_mean_over_batch_and_positions() -> None:
    logits, target = torch.randn(2, 5, 7), torch.randint(0, 7, (2, 5))
    per_position = torch.stack([F.cross_entropy(logits[:, t], target[:, t]) for t in range(5)])
    torch.testing.assert_close(run_loss("cross_entropy", logits, target), per_position.mean())


@pytest.mark.parametrize(
    ("op", "pred", "target", "message"),
    [
        ("cross_entropy", torch.randn(4, 3), torch.zeros(4), "int64"),
        ("cross_entropy", torch.randn(4, 3), torch.zeros(4, 3, dtype=torch.int64), "targets"),
        ("cross_entropy", torch.randn(4), torch.zeros(4, dtype=torch.int64), "logits"),
        ("mse", torch.randn(4, 3), torch.randn(4, 1), "mse"),
        ("l1", torch.randn(4, 3), torch.randn(4, 1), "l1"),
        ("l1", torch.randn(4, 3), torch.zeros(4, 3, dtype=torch.int64), "float32 target"),
    ],
)
def test_loss_shape_rules(op: str, pred: torch.Tensor, target: torch.Tensor, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_loss_shapes(op, pred, target)


# --- the everyday PyTorch blocks of issue 11 -------------------------------------------------------------

from typing import Any  # noqa: E402

from torch import nn  # noqa: E402

from engine.graph import GraphError, _parse_attrs  # noqa: E402


def _attrs(op: str, raw: dict[str, Any]) -> dict[str, Any]:
    """The attrs as the graph loader hands them to the op: checked, defaults filled in."""
    return _parse_attrs(op, raw, "test")


def _forward_backward(fn: Callable[[Tensor], Tensor], x: Tensor, grad: Tensor) -> tuple[Tensor, Tensor]:
    x = x.detach().clone().requires_grad_()
    out = fn(x)
    out.backward(grad)
    assert x.grad is not None
    return out.detach(), x.grad


# x spans every branch of the piecewise activations (hardswish's -3 and 3, the sign of leaky_relu/elu).
X = 4 * torch.randn(2, 6, 5, 4, generator=torch.Generator().manual_seed(0))

ELEMENTWISE: list[tuple[str, dict[str, Any], Callable[[Tensor], Tensor]]] = [
    ("silu", {}, nn.SiLU()),
    ("hardswish", {}, nn.Hardswish()),
    ("hardsigmoid", {}, nn.Hardsigmoid()),
    ("leaky_relu", {}, nn.LeakyReLU()),
    ("leaky_relu", {"negative_slope": 0.2}, nn.LeakyReLU(0.2)),
    ("leaky_relu", {"negative_slope": -1.5}, nn.LeakyReLU(-1.5)),
    ("elu", {}, nn.ELU()),
    ("elu", {"alpha": 0.3}, nn.ELU(0.3)),
    ("elu", {"alpha": 2}, nn.ELU(2.0)),
    ("reduce_mean", {"dims": [2, -1]}, lambda x: x.mean((2, 3))),
    ("reduce_mean", {"dims": [1], "keepdim": True}, lambda x: x.mean(1, keepdim=True)),
    ("reduce_mean", {"dims": []}, lambda x: x.mean()),
    ("reduce_sum", {"dims": [0, 2]}, lambda x: x.sum((0, 2))),
    ("reduce_sum", {"dims": [-3], "keepdim": True}, lambda x: x.sum(1, keepdim=True)),
    ("reduce_sum", {"dims": [], "keepdim": True}, lambda x: x.sum().reshape(1, 1, 1, 1)),
    ("add_scalar", {"value": 2.5}, lambda x: x + 2.5),
    ("add_scalar", {"value": -3}, lambda x: x - 3),
]


@pytest.mark.parametrize(("op", "raw", "reference"), ELEMENTWISE, ids=[f"{c[0]}{c[1]}" for c in ELEMENTWISE])
def test_each_new_op_is_torchs_forward_and_gradient(
    op: str, raw: dict[str, Any], reference: Callable[[Tensor], Tensor]
) -> None:
    attrs = _attrs(op, raw)
    grad = torch.randn(reference(X).shape, generator=torch.Generator().manual_seed(1))
    want, want_grad = _forward_backward(reference, X, grad)
    got, got_grad = _forward_backward(lambda x: run_op(op, [x], attrs, True), X, grad)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_grad, want_grad)


@pytest.mark.parametrize(
    ("groups", "affine", "raw"), [(3, True, {"num_groups": 3, "eps": 1e-3}), (2, False, {"num_groups": 2})]
)
def test_group_norm_is_torchs_with_and_without_affine(groups: int, affine: bool, raw: dict[str, Any]) -> None:
    gen = torch.Generator().manual_seed(2)
    module = nn.GroupNorm(groups, 6, eps=raw.get("eps", 1e-5), affine=affine)
    if affine:
        with torch.no_grad():
            module.weight.copy_(1 + torch.randn(6, generator=gen))
            module.bias.copy_(torch.randn(6, generator=gen))
    weight = module.weight.detach().clone().requires_grad_() if affine else None
    bias = module.bias.detach().clone().requires_grad_() if affine else None
    x = (3 + X).requires_grad_()  # an offset the normalisation must remove
    grad = torch.randn(X.shape, generator=gen)
    got = run_op("group_norm", [x, weight, bias], _attrs("group_norm", raw), True)
    got.backward(grad)
    x_ref = x.detach().clone().requires_grad_()
    want = module(x_ref)
    want.backward(grad)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(x.grad, x_ref.grad)
    if affine:
        torch.testing.assert_close(weight.grad, module.weight.grad)  # type: ignore[union-attr]
        torch.testing.assert_close(bias.grad, module.bias.grad)  # type: ignore[union-attr]


def test_group_norm_needs_groups_that_divide_the_channels() -> None:
    with pytest.raises(RuntimeError, match="divisible"):
        run_op("group_norm", [X, None, None], _attrs("group_norm", {"num_groups": 4}), True)


@pytest.mark.parametrize("shape", [(4, 8, 3, 3), (4, 8, 5)])
def test_dropout2d_drops_whole_channels_as_torch_does(shape: tuple[int, ...]) -> None:
    x, p = torch.randn(shape).abs() + 0.1, 0.4
    attrs = _attrs("dropout2d", {"p": p})
    torch.manual_seed(5)
    got, got_grad = _forward_backward(lambda t: run_op("dropout2d", [t], attrs, True), x, torch.ones(shape))
    torch.manual_seed(5)
    # nn.Dropout1d on [N, C, L] is what F.dropout2d does with 3-D inputs (minus its warning).
    reference = nn.Dropout2d(p) if len(shape) == 4 else nn.Dropout1d(p)
    want, want_grad = _forward_backward(reference, x, torch.ones(shape))
    assert torch.equal(got, want) and torch.equal(got_grad, want_grad)
    planes = (got / x).flatten(2)  # per (sample, channel): all 0 or all 1 / (1 - p)
    kept = planes[:, :, 0] != 0
    torch.testing.assert_close(planes, kept[:, :, None].float().expand_as(planes) / (1 - p))
    assert kept.any() and not kept.all()


def test_dropout2d_is_the_identity_in_eval_and_zero_at_p_1() -> None:
    assert torch.equal(run_op("dropout2d", [X], _attrs("dropout2d", {"p": 0.5}), False), X)
    assert torch.equal(run_op("dropout2d", [X], _attrs("dropout2d", {"p": 0.0}), True), X)
    assert not run_op("dropout2d", [X], _attrs("dropout2d", {"p": 1}), True).any()
    with pytest.raises(ValueError, match="between 0 and 1"):
        run_op("dropout2d", [X], _attrs("dropout2d", {"p": 1.5}), False)


@pytest.mark.parametrize("padding_idx", [None, 3, -2])
def test_embedding_padding_idx_looks_the_row_up_but_never_trains_it(padding_idx: int | None) -> None:
    gen = torch.Generator().manual_seed(4)
    ids = torch.tensor([[3, 8, 3, 0], [1, 3, 8, 5]])
    reference = nn.Embedding(10, 4, padding_idx=padding_idx)
    with torch.no_grad():
        reference.weight.copy_(torch.randn(10, 4, generator=gen))  # nn.Embedding zeroed the row at init
    weight = reference.weight.detach().clone().requires_grad_()
    grad = torch.randn(2, 4, 4, generator=gen)
    got = run_op("embedding", [ids, weight], _attrs("embedding", {"padding_idx": padding_idx}), True)
    got.backward(grad)
    reference(ids).backward(grad)
    assert torch.equal(got, weight[ids])  # the padding row is looked up, not zeroed
    torch.testing.assert_close(weight.grad, reference.weight.grad)
    assert weight.grad is not None
    untrained = {r for r in range(10) if not weight.grad[r].any()}
    assert untrained == {2, 4, 6, 7, 9} | ({padding_idx % 10} if padding_idx is not None else set())


def test_embedding_padding_idx_defaults_to_none_and_must_be_in_the_table() -> None:
    assert _attrs("embedding", {}) == {"padding_idx": None}
    table, ids = torch.randn(10, 4), torch.zeros(2, 3, dtype=torch.int64)
    for bad in (10, -11):
        with pytest.raises(ValueError, match="padding_idx"):
            run_op("embedding", [ids, table], {"padding_idx": bad}, False)
    with pytest.raises(GraphError, match="attr 'padding_idx'"):
        _attrs("embedding", {"padding_idx": 1.5})


def test_expand_takes_the_batch_size_from_like() -> None:
    token, like = torch.randn(1, 1, 4), torch.zeros(5, 3, dtype=torch.int64)
    out = run_op("expand", [token, like], {"shape": [-1, 2, 4]}, False)
    assert torch.equal(out, token.expand(5, 2, 4))


def test_drop_path_zeroes_whole_samples_and_scales_the_rest() -> None:
    x = torch.randn(64, 3, 2, 2) + 5.0  # no zeros of its own
    torch.manual_seed(0)
    out = run_op("drop_path", [x], {"p": 0.25}, True)
    kept = out.flatten(1).ne(0).all(1)
    assert torch.equal(out.flatten(1).eq(0).all(1), ~kept)  # a sample is kept or dropped as a whole
    torch.testing.assert_close(out[kept], x[kept] / 0.75)
    assert 0.5 < kept.float().mean() < 0.95
    assert torch.equal(run_op("drop_path", [x], {"p": 0.25}, False), x)
    assert not run_op("drop_path", [x], {"p": 1.0}, True).any()
    with pytest.raises(ValueError, match="between 0 and 1"):
        run_op("drop_path", [x], {"p": 1.5}, True)
