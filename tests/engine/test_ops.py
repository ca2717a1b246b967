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
    assert set(LOSSES) == {"cross_entropy", "mse"}  # the two run_loss knows


@pytest.mark.parametrize(("op", "reference"), [("cross_entropy", F.cross_entropy), ("mse", F.mse_loss)])
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
    ],
)
def test_loss_shape_rules(op: str, pred: torch.Tensor, target: torch.Tensor, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_loss_shapes(op, pred, target)
