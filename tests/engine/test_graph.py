"""Graph loading: the documented example, canonical JSON, and every validation rule."""

from __future__ import annotations

import contextlib
import copy
import json
from collections.abc import Callable
from typing import Any

import pytest
import torch

from engine import graph, spec
from engine.graph import MAX_NODES, OP_SPECS, REQUIRED, GraphError, graph_to_json, infer_shapes, load_graph
from engine.runtime import GraphModule
from tests.engine.conftest import exported, preset_batch

DOC_EXAMPLE: dict[str, Any] = {
    "format": "crowdtrain.graph",
    "version": 1,
    "name": "mlp",
    "inputs": [{"name": "x", "shape": [-1, 784], "dtype": "float32"}],
    "targets": [{"name": "y", "shape": [-1], "dtype": "int64"}],
    "params": [
        {"name": "fc1.weight", "shape": [128, 784], "dtype": "float32"},
        {"name": "fc1.bias", "shape": [128], "dtype": "float32"},
        {"name": "fc2.weight", "shape": [10, 128], "dtype": "float32"},
        {"name": "fc2.bias", "shape": [10], "dtype": "float32"},
    ],
    "buffers": [],
    "nodes": [
        {"name": "fc1", "op": "linear", "inputs": ["x", "fc1.weight", "fc1.bias"], "attrs": {}},
        {"name": "relu1", "op": "relu", "inputs": ["fc1"], "attrs": {}},
        {"name": "fc2", "op": "linear", "inputs": ["relu1", "fc2.weight", "fc2.bias"], "attrs": {}},
    ],
    "output": "fc2",
    "loss": {"op": "cross_entropy", "inputs": ["fc2", "y"], "attrs": {}},
}


def test_doc_example_loads_and_infers_shapes() -> None:
    graph = load_graph(DOC_EXAMPLE)
    assert [n.name for n in graph.nodes] == ["fc1", "relu1", "fc2"]
    assert graph.param_count() == 784 * 128 + 128 + 128 * 10 + 10
    shapes = infer_shapes(graph, batch=5)
    assert shapes["fc1"] == (5, 128) and shapes["fc2"] == (5, 10) and shapes["y"] == (5,)


def test_roundtrip_and_canonical_json() -> None:
    graph = load_graph(DOC_EXAMPLE)
    assert load_graph(graph.to_dict()) == graph
    text = graph_to_json(graph)
    assert load_graph(text) == graph and load_graph(text.decode()) == graph
    shuffled = json.loads(text, object_pairs_hook=lambda kv: dict(reversed(kv)))
    assert graph_to_json(load_graph(shuffled)) == text
    assert text == json.dumps(json.loads(text), sort_keys=True, separators=(",", ":")).encode()


def test_default_attrs_are_filled_in() -> None:
    graph, _ = exported("cnn")
    conv = next(n for n in load_graph(graph).nodes if n.op == "conv2d")
    assert conv.attrs == {"stride": [1, 1], "padding": [1, 1], "dilation": [1, 1], "groups": 1}
    pool = next(n for n in load_graph(graph).nodes if n.op == "max_pool2d")
    assert pool.attrs["stride"] == pool.attrs["kernel_size"] == [2, 2]


@pytest.mark.parametrize("name", ["mlp", "cnn", "resnet18", "gpt"])
def test_inferred_output_shape_matches_runtime(name: str) -> None:
    graph_dict, weights = exported(name)
    graph = load_graph(graph_dict)
    module = GraphModule(graph)
    module.load_state(weights)
    module.eval()
    x, _ = preset_batch(name, batch=2)
    with torch.no_grad():
        out = module({"x": x})
    assert infer_shapes(graph, batch=2)[graph.output] == tuple(out.shape)


Mutation = Callable[[dict[str, Any]], None]


def _set(path: list[Any], value: Any) -> Mutation:
    def mutate(g: dict[str, Any]) -> None:
        target: Any = g
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    return mutate


def _many_nodes(g: dict[str, Any]) -> None:
    g["nodes"] += [{"name": f"r{i}", "op": "relu", "inputs": ["fc2"], "attrs": {}} for i in range(MAX_NODES)]


def _many_params(g: dict[str, Any]) -> None:
    g["params"] += [{"name": f"p{i}", "shape": [1], "dtype": "float32"} for i in range(500)]


CASES: list[tuple[str, Mutation, str]] = [
    ("format", _set(["format"], "onnx"), "unsupported graph format"),
    ("version", _set(["version"], 2), "version"),
    ("unknown op", _set(["nodes", 1, "op"], "fft"), "unknown op 'fft'"),
    ("duplicate node", _set(["nodes", 1, "name"], "fc1"), "duplicate name 'fc1'"),
    ("node shadows param", _set(["nodes", 1, "name"], "fc1.bias"), "duplicate name 'fc1.bias'"),
    ("forward reference", _set(["nodes", 0, "inputs", 0], "relu1"), "'relu1' is not defined before"),
    ("missing param", _set(["nodes", 2, "inputs", 1], "fc3.weight"), "'fc3.weight' is not defined"),
    ("null required input", _set(["nodes", 2, "inputs", 1], None), "may not be null"),
    ("wrong input count", _set(["nodes", 1, "inputs"], ["fc1", "fc1"]), "takes inputs"),
    (
        "missing attr",
        _set(["nodes", 1], {"name": "relu1", "op": "softmax", "inputs": ["fc1"]}),
        "missing required attr 'dim'",
    ),
    ("unknown attr", _set(["nodes", 1, "attrs"], {"inplace": True}), "unknown attrs ['inplace']"),
    (
        "bad attr type",
        _set(["nodes", 1], {"name": "relu1", "op": "softmax", "inputs": ["fc1"], "attrs": {"dim": "last"}}),
        "attr 'dim'",
    ),
    ("bad name", _set(["nodes", 1, "name"], "relu 1"), "invalid name"),
    ("long name", _set(["nodes", 1, "name"], "r" * 201), "invalid name"),
    ("shape mismatch", _set(["params", 2, "shape"], [10, 100]), "node 'fc2' (linear)"),
    ("input batch dim", _set(["inputs", 0, "shape"], [784]), "batch dimension"),
    ("param dtype", _set(["params", 0, "dtype"], "float16"), "dtype"),
    ("negative dim", _set(["params", 0, "shape"], [0, 784]), "positive"),
    ("output", _set(["output"], "nope"), "output 'nope'"),
    ("loss op", _set(["loss", "op"], "hinge"), "unknown op 'hinge'"),
    ("loss inputs", _set(["loss", "inputs"], ["relu1", "y"]), "loss: inputs"),
    ("loss target shape", _set(["targets", 0, "shape"], [-1, 3]), "loss (cross_entropy)"),
    ("loss target dtype", _set(["targets", 0, "dtype"], "float32"), "int64 class targets"),
    ("too many nodes", _many_nodes, "too many nodes"),
    ("too many params", _many_params, "too many params"),
    ("too many elements", _set(["params", 0, "shape"], [20_000, 10_001]), "parameter elements"),
    (
        "reshape -1 twice",
        _set(
            ["nodes", 1], {"name": "relu1", "op": "reshape", "inputs": ["fc1"], "attrs": {"shape": [-1, -1]}}
        ),
        "only once",
    ),
]


@pytest.mark.parametrize(("mutate", "message"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_invalid_graphs_are_rejected_with_a_clear_message(mutate: Mutation, message: str) -> None:
    graph = copy.deepcopy(DOC_EXAMPLE)
    mutate(graph)
    with pytest.raises(GraphError) as info:
        load_graph(graph)
    assert message in str(info.value)


@pytest.mark.parametrize("data", [b"\xff\x00", "not json", "[1, 2]", b"{}"])
def test_garbage_is_a_graph_error(data: str | bytes) -> None:
    with pytest.raises(GraphError):
        load_graph(data)


def test_arange_embedding_longer_than_table_is_rejected() -> None:
    graph, _ = exported("gpt")
    graph = copy.deepcopy(graph)
    graph["inputs"][0]["shape"] = [-1, 65]
    graph["targets"][0]["shape"] = [-1, 65]
    with pytest.raises(GraphError, match="arange_embedding"):
        load_graph(graph)


def test_mlp_preset_exports_to_the_documented_example_behind_a_flatten() -> None:
    """The preset takes 1x28x28 images (datasets keep their shape) and flattens them first."""
    documented = copy.deepcopy(DOC_EXAMPLE)
    documented["inputs"][0]["shape"] = [-1, 1, 28, 28]
    flatten = {"name": "flatten", "op": "flatten", "inputs": ["x"], "attrs": {"start_dim": 1, "end_dim": -1}}
    documented["nodes"] = [flatten, *documented["nodes"]]
    documented["nodes"][1]["inputs"] = ["flatten", "fc1.weight", "fc1.bias"]
    graph, _ = exported("mlp")
    assert load_graph(graph) == load_graph(documented)


def test_random_corruption_only_ever_raises_graph_error() -> None:
    """Uploaded graphs are hostile input: any corruption is a GraphError, never a crash."""
    import random

    junk: list[Any] = [
        None,
        0,
        -1,
        1.5,
        "x",
        "",
        [],
        {},
        [None],
        [-1],
        [2**70],
        True,
        {"a": 1},
        "fc1",
        [1, 2],
        10**20,
        float("nan"),
    ]
    rng = random.Random(0)
    base = [exported("mlp")[0], exported("cnn")[0]]

    def paths(obj: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        children = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else []
        return [prefix] + [p for k, v in children for p in paths(v, (*prefix, k))]

    for _ in range(300):
        graph = copy.deepcopy(rng.choice(base))
        for _ in range(rng.randint(1, 3)):
            path = rng.choice(paths(graph)[1:])
            parent: Any = graph
            for key in path[:-1]:
                parent = parent[key]
            parent[path[-1]] = rng.choice(junk)
        with contextlib.suppress(GraphError):
            load_graph(graph)


# --- hostile graphs (issue 9): nesting, absurd activations, anything else is a GraphError --------------

from engine.graph import (  # noqa: E402
    EVAL_MEMORY_BYTES,
    activation_memory,
)
from tests.security.uploads import activation_bomb, graph_with, nested_json  # noqa: E402


@pytest.mark.parametrize(
    "data",
    [
        nested_json(100_000),
        nested_json(50_000, "{"),
        graph_with(nested_json(990)),
        nested_json(100_000).decode(),
    ],
)
def test_deep_nesting_is_a_graph_error_not_a_recursion_error(data: bytes | str) -> None:
    with pytest.raises(GraphError, match="nested"):
        load_graph(data)


def test_the_issues_activation_bomb_is_refused_at_load_naming_the_node() -> None:
    graph = activation_bomb(features=784, side=784)  # outer: [B, 614656, 614656], 1.4 TiB per sample
    with pytest.raises(GraphError) as info:
        load_graph(graph)
    message = str(info.value)
    assert "node 'outer' (matmul)" in message and "at most 1,024 MiB" in message
    assert "[2, 614656, 614656]" in message and "2,882,415 MiB per training sample" in message
    assert load_graph(graph, max_activation_bytes=None).param_count() == 784 + 614656


def test_activation_memory_sums_every_node_per_sample() -> None:
    graph = load_graph(activation_bomb(features=4, side=10, classes=2))
    memory = activation_memory(graph)
    # x [4] + y (int64) + col [4, 1] + square [4, 10] + flat [40, 1] + outer [40, 40] + row [1, 40]
    # + few [1, 2] + logits [2], float32 unless said otherwise
    assert memory.forward_bytes == 4 * (4 + 2 + 4 + 40 + 40 + 1600 + 40 + 2 + 2)
    assert memory.train_bytes == 2 * memory.forward_bytes
    largest = (memory.largest_node.name, memory.largest_shape, memory.largest_bytes)
    assert largest == ("outer", (2, 40, 40), 6400)
    with pytest.raises(GraphError, match="node 'outer'"):
        memory.check(memory.train_bytes - 1)
    memory.check(memory.train_bytes)


def test_evaluation_batches_are_bounded_by_activation_memory() -> None:
    resnet = activation_memory(load_graph(exported("resnet18")[0]))
    assert resnet.batch_within(EVAL_MEMORY_BYTES, 1000) == EVAL_MEMORY_BYTES // resnet.forward_bytes < 1000
    assert activation_memory(load_graph(DOC_EXAMPLE)).batch_within(EVAL_MEMORY_BYTES, 1000) == 1000
    assert resnet.batch_within(1, 1000) == 1


@pytest.mark.parametrize(
    "mutate",
    [
        lambda g: g["loss"].update(op=[]),
        lambda g: g["loss"].update(op={}),
        lambda g: g["nodes"][0].update(inputs=[["x"], "fc1.weight", None]),
        lambda g: g.update(output=["fc2"]),
        lambda g: g["params"][0].update(shape=[10**400 and 2**31 - 1] * 6),
    ],
)
def test_unforeseen_malformations_are_graph_errors(mutate: Callable[[dict[str, Any]], Any]) -> None:
    graph = copy.deepcopy(DOC_EXAMPLE)
    mutate(graph)
    with pytest.raises(GraphError):
        load_graph(graph)


def test_the_op_table_is_the_spec_files() -> None:
    assert list(OP_SPECS) == list(spec.GRAPH["ops"])
    for op, raw in spec.GRAPH["ops"].items():
        assert OP_SPECS[op].inputs == tuple(raw["inputs"])
        attrs = {key: (a["kind"], a.get("default", REQUIRED)) for key, a in raw.get("attrs", {}).items()}
        assert {key: (a.kind, a.default) for key, a in OP_SPECS[op].attrs.items()} == attrs


def test_every_default_in_the_spec_file_is_a_valid_value_of_its_kind() -> None:
    for op, op_spec in OP_SPECS.items():
        for key, attr in op_spec.attrs.items():
            if attr.default is not REQUIRED:
                assert graph._norm_attr(attr, attr.default, f"{op}.{key}") == attr.default


def test_an_attr_kind_the_loader_cannot_check_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown attr kind 'complex'"):
        graph._attr({"kind": "complex"})


# --- int_or_none attrs and the checks of issue 11's ops ------------------------------------------------


@pytest.mark.parametrize(("value", "expected"), [(None, None), (3, 3), (-1, -1), (0, 0)])
def test_an_int_or_none_attr_is_null_or_an_int(value: Any, expected: Any) -> None:
    assert graph._norm_attr(graph.Attr("int_or_none", None), value, "a") == expected


@pytest.mark.parametrize("value", [1.5, 2.0, True, "1", [1], {}, 2**40])
def test_an_int_or_none_attr_refuses_anything_else(value: Any) -> None:
    with pytest.raises(GraphError, match="expected int_or_none"):
        graph._norm_attr(graph.Attr("int_or_none", None), value, "a")


def _embedding_graph(**attrs: Any) -> dict[str, Any]:
    """ids -> embedding (with attrs) -> mean over the sequence -> linear classifier."""
    node = lambda name, op, inputs, **a: {"name": name, "op": op, "inputs": inputs, "attrs": a}  # noqa: E731
    return {
        **{k: DOC_EXAMPLE[k] for k in ("format", "version", "targets", "buffers", "loss")},
        "inputs": [{"name": "x", "shape": [-1, 5], "dtype": "int64"}],
        "params": [
            {"name": "emb", "shape": [7, 4], "dtype": "float32"},
            {"name": "fc2.weight", "shape": [10, 4], "dtype": "float32"},
        ],
        "nodes": [
            node("e", "embedding", ["x", "emb"], **attrs),
            node("m", "reduce_mean", ["e"], dims=[1]),
            node("fc2", "linear", ["m", "fc2.weight", None]),
        ],
        "output": "fc2",
    }


def test_embedding_padding_idx_is_optional_and_checked() -> None:
    assert load_graph(_embedding_graph()).nodes[0].attrs == {"padding_idx": None}
    assert load_graph(_embedding_graph(padding_idx=-7)).nodes[0].attrs == {"padding_idx": -7}
    with pytest.raises(GraphError, match="attr 'padding_idx'"):
        load_graph(_embedding_graph(padding_idx="0"))
    for outside in (7, -8):
        with pytest.raises(GraphError, match="node 'e' \\(embedding\\): padding_idx"):
            load_graph(_embedding_graph(padding_idx=outside))


@pytest.mark.parametrize(
    ("op", "attrs", "message"),
    [
        ("group_norm", {"num_groups": 3}, "divisible"),
        ("group_norm", {"num_groups": 0}, "by zero"),  # torch's own arithmetic fails: still a GraphError
        ("dropout2d", {"p": 1.5}, "between 0 and 1"),
        ("reduce_sum", {"dims": [1, 1]}, "duplicate"),
        ("reduce_mean", {"dims": [2]}, "out of range"),
    ],
)
def test_impossible_uses_of_the_new_ops_are_graph_errors(
    op: str, attrs: dict[str, Any], message: str
) -> None:
    g = copy.deepcopy(DOC_EXAMPLE)
    g["nodes"].insert(
        1,
        {"name": "new", "op": op, "inputs": ["fc1", None, None][: len(OP_SPECS[op].inputs)], "attrs": attrs},
    )
    g["nodes"][2]["inputs"] = ["new"]
    with pytest.raises(GraphError, match=f"node 'new' \\({op}\\): .*{message}"):
        load_graph(g)


# ---- losses: inputs and attrs like a node's -----------------------------------------------------------


def _with_loss(loss: dict[str, Any], class_weights: list[int] | None = None) -> dict[str, Any]:
    g = copy.deepcopy(DOC_EXAMPLE)
    g["loss"] = loss
    g["buffers"] = [{"name": "cw", "shape": class_weights or [10], "dtype": "float32"}]
    return g


def test_loss_attrs_are_filled_in_and_class_weights_are_an_optional_buffer() -> None:
    plain = load_graph(_with_loss({"op": "cross_entropy", "inputs": ["fc2", "y"]}))
    assert plain.loss.attrs == {"label_smoothing": 0.0, "ignore_index": -100} and plain.loss.weight is None
    assert load_graph(_with_loss({"op": "cross_entropy", "inputs": ["fc2", "y", None]})) == plain
    attrs = {"label_smoothing": 0, "ignore_index": 3}
    weighted = load_graph(_with_loss({"op": "cross_entropy", "inputs": ["fc2", "y", "cw"], "attrs": attrs}))
    assert weighted.loss.inputs == ("fc2", "y", "cw") and weighted.loss.weight == "cw"
    assert weighted.loss.attrs == {"label_smoothing": 0.0, "ignore_index": 3}
    assert load_graph(graph_to_json(weighted)) == weighted


def test_l1_loss_takes_a_float_target_of_the_outputs_shape() -> None:
    g = _with_loss({"op": "l1", "inputs": ["fc2", "y"]})
    g["targets"] = [{"name": "y", "shape": [-1, 10], "dtype": "float32"}]
    assert load_graph(g).loss.attrs == {}
    g["targets"][0]["dtype"] = "int64"
    with pytest.raises(GraphError, match="l1 needs a float32 target"):
        load_graph(g)


def _ce(inputs: list[Any] | None = None, **attrs: Any) -> dict[str, Any]:
    return {"op": "cross_entropy", "inputs": inputs or ["fc2", "y"], "attrs": attrs}


LOSS_CASES: list[tuple[str, dict[str, Any], list[int] | None, str]] = [
    ("unknown attr", _ce(reduction="sum"), None, r"loss \(cross_entropy\): unknown attrs \['reduction'\]"),
    ("float ignore_index", _ce(ignore_index=1.5), None, "attr 'ignore_index'"),
    ("bool ignore_index", _ce(ignore_index=True), None, "attr 'ignore_index'"),
    ("text label_smoothing", _ce(label_smoothing="0.1"), None, "attr 'label_smoothing'"),
    ("label_smoothing above 1", _ce(label_smoothing=1.5), None, "between 0 and 1"),
    ("negative label_smoothing", _ce(label_smoothing=-0.1), None, "between 0 and 1"),
    ("weights from a param", _ce(["fc2", "y", "fc2.bias"]), None, "'fc2.bias' must be a buffer"),
    ("weights from nowhere", _ce(["fc2", "y", "nope"]), None, "'nope' must be a buffer"),
    ("weights of the wrong size", _ce(["fc2", "y", "cw"]), [9], r"class weights must have shape \[10\]"),
    ("weights of the wrong rank", _ce(["fc2", "y", "cw"]), [10, 1], r"class weights must have shape \[10\]"),
    ("four inputs", _ce(["fc2", "y", "cw", "cw"]), None, "loss: inputs"),
    ("a number for weights", _ce(["fc2", "y", 3]), None, "loss: inputs"),
    ("a list for the target", _ce(["fc2", ["y"]]), None, "loss: inputs"),
    ("mse with weights", {"op": "mse", "inputs": ["fc2", "y", "cw"]}, None, "loss: inputs"),
    (
        "mse with attrs",
        {"op": "mse", "inputs": ["fc2", "y"], "attrs": {"ignore_index": 1}},
        None,
        "unknown attrs",
    ),
    (
        "attrs not an object",
        {"op": "l1", "inputs": ["fc2", "y"], "attrs": []},
        None,
        "attrs must be an object",
    ),
]


@pytest.mark.parametrize(
    ("loss", "class_weights", "message"), [c[1:] for c in LOSS_CASES], ids=[c[0] for c in LOSS_CASES]
)
def test_invalid_losses_are_rejected_with_a_clear_message(
    loss: dict[str, Any], class_weights: list[int] | None, message: str
) -> None:
    with pytest.raises(GraphError, match=message):
        load_graph(_with_loss(loss, class_weights))


def test_trained_buffers_are_the_running_stats_batch_norm_updates() -> None:
    from torch import nn

    from engine.export import export_module

    model = nn.Sequential(nn.Flatten(), nn.Linear(4, 3), nn.BatchNorm1d(3))
    graph, _ = export_module(model, (2, 2), loss=nn.CrossEntropyLoss(weight=torch.ones(3)))
    loaded = load_graph(graph)
    assert {b.name for b in loaded.buffers} == {"2.running_mean", "2.running_var", "loss:weight"}
    assert loaded.trained_buffers() == ["2.running_mean", "2.running_var"]
