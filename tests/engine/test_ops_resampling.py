"""interpolate and conv_transpose2d: torch's semantics (forward and gradients) and the attrs the graph
loader refuses."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.graph import GraphError, _parse_attrs, load_graph
from engine.ops import run_op


def _attrs(op: str, raw: dict[str, Any]) -> dict[str, Any]:
    """The attrs as the graph loader hands them to the op: checked, defaults filled in."""
    return _parse_attrs(op, raw, "test")


def _grads(out: Tensor, inputs: list[Tensor], seed: int) -> list[Tensor]:
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    return list(torch.autograd.grad(out, inputs, grad))


def _leaf(shape: tuple[int, ...], seed: int) -> Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).requires_grad_()


INTERPOLATIONS = [
    ({"size": [9, 4]}, nn.Upsample(size=(9, 4), mode="nearest")),
    ({"size": 11, "mode": "nearest"}, nn.Upsample(size=(11, 11), mode="nearest")),
    ({"size": [9, 4], "mode": "bilinear"}, nn.Upsample(size=(9, 4), mode="bilinear", align_corners=False)),
    (
        {"size": [3, 13], "mode": "bilinear", "align_corners": True},
        nn.Upsample((3, 13), None, "bilinear", True),
    ),
    (
        {"size": [1, 1], "mode": "bilinear", "align_corners": True},
        nn.Upsample((1, 1), None, "bilinear", True),
    ),
]


@pytest.mark.parametrize(("raw", "reference"), INTERPOLATIONS, ids=[str(c[0]) for c in INTERPOLATIONS])
def test_interpolate_is_torchs_upsample_forward_and_backward(
    raw: dict[str, Any], reference: nn.Module
) -> None:
    x = _leaf((2, 3, 6, 7), seed=0)
    got = run_op("interpolate", [x], _attrs("interpolate", raw), True)
    want = reference(x)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(_grads(got, [x], 1), _grads(want, [x], 1))


def test_interpolate_nearest_takes_floor_of_dst_times_in_over_out() -> None:
    # Not half-pixel: output i reads input floor(i * in / out), so 2 -> 3 reads rows 0, 0, 1.
    x = torch.arange(4.0).reshape(1, 1, 2, 2)
    got = run_op("interpolate", [x], _attrs("interpolate", {"size": [3, 3]}), False)
    assert torch.equal(got, x[:, :, [0, 0, 1]][:, :, :, [0, 0, 1]])


def test_interpolate_bilinear_uses_half_pixel_centers_unless_align_corners() -> None:
    x = torch.tensor([[[[0.0, 4.0]]]])  # one row, two columns
    half = run_op("interpolate", [x], _attrs("interpolate", {"size": [1, 4], "mode": "bilinear"}), False)
    assert half.flatten().tolist() == [0.0, 1.0, 3.0, 4.0]  # sources -0.25 (clamped), 0.25, 0.75, 1.25
    raw = {"size": [1, 5], "mode": "bilinear", "align_corners": True}
    corners = run_op("interpolate", [x], _attrs("interpolate", raw), False)
    assert corners.flatten().tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_interpolate_defaults_and_refusals() -> None:
    assert _attrs("interpolate", {"size": [2, 3]}) == {
        "size": [2, 3],
        "mode": "nearest",
        "align_corners": False,
    }
    with pytest.raises(GraphError, match="attr 'mode'"):
        _attrs("interpolate", {"size": [2, 3], "mode": "bicubic"})
    with pytest.raises(GraphError, match="missing required attr 'size'"):
        _attrs("interpolate", {})
    x = torch.randn(2, 3, 4, 4)
    with pytest.raises(ValueError, match="align_corners"):
        run_op("interpolate", [x], {"size": [8, 8], "mode": "nearest", "align_corners": True}, False)
    with pytest.raises(ValueError, match="4-D"):
        run_op("interpolate", [x[0]], {"size": [8, 8], "mode": "bilinear", "align_corners": False}, False)


TRANSPOSED = [
    ({}, dict(stride=1, padding=0, output_padding=0)),
    (
        {"stride": [2, 2], "padding": [1, 1], "output_padding": [1, 1]},
        dict(stride=2, padding=1, output_padding=1),
    ),
    (
        {"stride": [3, 2], "padding": [0, 2], "output_padding": [2, 0]},
        dict(stride=(3, 2), padding=(0, 2), output_padding=(2, 0)),
    ),
    ({"stride": 2, "padding": 4}, dict(stride=2, padding=4)),  # padding beyond kernel - 1 crops
]


@pytest.mark.parametrize(("raw", "kwargs"), TRANSPOSED, ids=[str(c[0]) for c in TRANSPOSED])
@pytest.mark.parametrize("bias", [True, False])
def test_conv_transpose2d_is_torchs_module(raw: dict[str, Any], kwargs: dict[str, Any], bias: bool) -> None:
    torch.manual_seed(0)
    module = nn.ConvTranspose2d(3, 4, (3, 5), bias=bias, **kwargs)
    x = _leaf((2, 3, 5, 6), seed=1)
    args = [x, module.weight, module.bias]
    got = run_op("conv_transpose2d", args, _attrs("conv_transpose2d", raw), True)
    want = module(x)
    torch.testing.assert_close(got, want)
    params = [t for t in args if t is not None]
    torch.testing.assert_close(_grads(got, params, 2), _grads(want, params, 2))


def test_conv_transpose2d_is_the_adjoint_of_conv2d() -> None:
    # <conv_transpose(y), x> == <y, conv2d(x)>: the defining property, independent of torch's module.
    gen = torch.Generator().manual_seed(3)
    w, x = torch.randn(4, 3, 3, 3, generator=gen), torch.randn(2, 3, 10, 9, generator=gen)
    y = F.conv2d(x, w, stride=2, padding=1)
    t = torch.randn(y.shape, generator=gen)
    attrs = {"stride": [2, 2], "padding": [1, 1], "output_padding": [1, 0]}  # back to 10 x 9
    back = run_op("conv_transpose2d", [t, w, None], attrs, False)
    assert back.shape == x.shape
    torch.testing.assert_close((back * x).sum(), (t * y).sum())


GRAPH: dict[str, Any] = {
    "format": "crowdtrain.graph",
    "version": 1,
    "inputs": [{"name": "x", "shape": [-1, 3, 5, 5], "dtype": "float32"}],
    "targets": [{"name": "y", "shape": [-1, 4, 10, 10], "dtype": "float32"}],
    "params": [{"name": "w", "shape": [3, 4, 3, 3]}, {"name": "b", "shape": [4]}],
    "nodes": [
        {
            "name": "up",
            "op": "conv_transpose2d",
            "inputs": ["x", "w", "b"],
            "attrs": {"stride": [2, 2], "padding": [1, 1], "output_padding": [1, 1]},
        }
    ],
    "output": "up",
    "loss": {"op": "mse", "inputs": ["up", "y"]},
}


def _with(path: list[Any], value: Any) -> dict[str, Any]:
    graph = copy.deepcopy(GRAPH)
    target = graph
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return graph


def test_conv_transpose2d_graph_loads_with_torchs_output_shape() -> None:
    loaded = load_graph(GRAPH)
    assert loaded.nodes[0].attrs == {"stride": [2, 2], "padding": [1, 1], "output_padding": [1, 1]}


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        (["nodes", 0, "attrs", "output_padding"], [2, 1], "smaller than the stride"),
        (["nodes", 0, "attrs", "padding"], [-1, 0], "padding >= 0"),
        (["nodes", 0, "attrs", "stride"], [0, 1], "stride >= 1"),
        (["nodes", 0, "attrs", "output_padding"], [0, -1], "output_padding >= 0"),
        (["nodes", 0, "attrs", "groups"], 2, "unknown attrs"),
        (["params", 0, "shape"], [4, 4, 3, 3], "weight"),
        (["params", 1, "shape"], [3], "bias must have shape"),
        (["inputs", 0, "shape"], [-1, 3, 5], "x"),
        (["nodes", 0, "attrs", "padding"], [9, 9], "too small"),
    ],
)
def test_conv_transpose2d_refusals_are_graph_errors(path: list[Any], value: Any, message: str) -> None:
    with pytest.raises(GraphError, match=message):
        load_graph(_with(path, value))


def test_interpolate_refusals_are_graph_errors() -> None:
    node = {
        "name": "up",
        "op": "interpolate",
        "inputs": ["x"],
        "attrs": {"size": [10, 10], "align_corners": True},
    }
    graph = {**_with(["nodes"], [node]), "params": [], "targets": [{"name": "y", "shape": [-1, 3, 10, 10]}]}
    with pytest.raises(GraphError, match="node 'up' \\(interpolate\\): align_corners"):
        load_graph(graph)
    node["attrs"] = {"size": [10, 0], "mode": "bilinear"}
    with pytest.raises(GraphError, match="node 'up'"):
        load_graph(graph)
    node["attrs"] = {"size": [10, 10], "mode": "bilinear", "align_corners": True}
    assert load_graph(graph).nodes[0].attrs["align_corners"] is True
