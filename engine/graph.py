"""Loading and validating model graphs (format ``crowdtrain.graph`` v1, see docs/graph-format.md).

Graphs come from users, so everything is checked before anything runs: structure, names, limits,
attributes, and shapes (by running the graph on shape-only ``meta`` tensors).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from engine import ops
from engine.codecs import MAX_JSON_DEPTH, json_loads_bounded
from engine.spec import GRAPH as GRAPH_SPEC

FORMAT: str = GRAPH_SPEC["format"]
VERSION: int = GRAPH_SPEC["version"]
MAX_NODES: int = GRAPH_SPEC["limits"]["nodes"]
MAX_PARAMS: int = GRAPH_SPEC["limits"]["params"]
MAX_PARAM_ELEMENTS: int = GRAPH_SPEC["limits"]["param_elements"]
MAX_NAME: int = GRAPH_SPEC["limits"]["name_length"]
MAX_INT: int = GRAPH_SPEC["limits"]["max_int"]
NAME_RE = re.compile(GRAPH_SPEC["name_pattern"])
SECTION_DTYPES: dict[str, tuple[str, ...]] = {k: tuple(v) for k, v in GRAPH_SPEC["dtypes"].items()}

# Activation memory per training sample (every node's output, twice for the backward pass) beyond which
# no graph loads at all; projects set a lower limit of their own (Project.max_activation_mb).
MAX_ACTIVATION_BYTES = 2**30
TRAIN_MEMORY_FACTOR = 2  # backward holds a gradient as large as each saved activation
EVAL_MEMORY_BYTES = 256 * 2**20  # forward activations of one evaluation batch (runtime.evaluate)

DTYPES = {"float32": torch.float32, "int64": torch.int64}
INFER_BATCH = 2  # shapes are checked at 2 samples: a graph that hard-codes a batch of 1 fails


class GraphError(ValueError):
    """The graph is malformed; the message names the offending part."""


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()


@dataclass(frozen=True)
class Attr:
    kind: str  # one of ATTR_KINDS
    default: Any = REQUIRED
    choices: tuple[str, ...] = ()


@dataclass(frozen=True)
class OpSpec:
    # Slot names in order; a trailing "?" marks an optional (nullable) input, "*" a variadic one.
    inputs: tuple[str, ...]
    attrs: Mapping[str, Attr] = field(default_factory=dict)


# What _norm_attr knows how to check.
ATTR_KINDS = ("int", "int_or_none", "float", "bool", "str", "ints", "pair", "pair_or_none")


def _attr(raw: Mapping[str, Any]) -> Attr:
    if raw["kind"] not in ATTR_KINDS:
        raise ValueError(f"engine/spec.json: unknown attr kind {raw['kind']!r}")
    return Attr(raw["kind"], raw.get("default", REQUIRED), tuple(raw.get("choices", ())))


def _op_spec(raw: Mapping[str, Any]) -> OpSpec:
    return OpSpec(tuple(raw["inputs"]), {name: _attr(a) for name, a in raw.get("attrs", {}).items()})


# The op table of engine/spec.json, which the browsers' graph.js reads too.
OP_SPECS: dict[str, OpSpec] = {op: _op_spec(raw) for op, raw in GRAPH_SPEC["ops"].items()}
# Losses take inputs and attrs like ops: [prediction, target, optional extras]; attrs get their defaults.
LOSS_SPECS: dict[str, OpSpec] = {op: _op_spec(raw) for op, raw in GRAPH_SPEC["losses"].items()}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}


@dataclass(frozen=True)
class Node:
    name: str
    op: str
    inputs: tuple[str | None, ...]
    attrs: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "op": self.op, "inputs": list(self.inputs), "attrs": dict(self.attrs)}


@dataclass(frozen=True)
class Loss:
    op: str
    inputs: tuple[str, ...]  # prediction (the output), target, then an optional class-weight buffer
    attrs: Mapping[str, Any] = field(default_factory=dict)

    @property
    def weight(self) -> str | None:
        return self.inputs[2] if len(self.inputs) > 2 else None

    def to_dict(self) -> dict[str, Any]:
        return {"op": self.op, "inputs": list(self.inputs), "attrs": dict(self.attrs)}


@dataclass(frozen=True)
class Graph:
    name: str
    inputs: tuple[TensorSpec, ...]
    targets: tuple[TensorSpec, ...]
    params: tuple[TensorSpec, ...]
    buffers: tuple[TensorSpec, ...]
    nodes: tuple[Node, ...]
    output: str
    loss: Loss

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "name": self.name,
            "inputs": [s.to_dict() for s in self.inputs],
            "targets": [s.to_dict() for s in self.targets],
            "params": [s.to_dict() for s in self.params],
            "buffers": [s.to_dict() for s in self.buffers],
            "nodes": [n.to_dict() for n in self.nodes],
            "output": self.output,
            "loss": self.loss.to_dict(),
        }

    def param_count(self) -> int:
        return sum(math.prod(p.shape) for p in self.params)

    def trained_buffers(self) -> list[str]:
        """Buffers an op updates while training (batch norm's running stats), in graph order. The others
        (class weights, frozen parameters) are constants: nothing a volunteer reports may change them."""
        names = [n.inputs[i] for n in self.nodes if n.op == "batch_norm" for i in (3, 4)]
        return list(dict.fromkeys(name for name in names if name is not None))


def graph_to_json(graph: Graph) -> bytes:
    """Canonical JSON (sorted keys, no whitespace): equal graphs give equal bytes and hashes."""
    return json.dumps(graph.to_dict(), sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


# ---------------------------------------------------------------- parsing helpers


def _fail(msg: str) -> GraphError:
    return GraphError(msg)


def _get(d: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if key not in d:
        raise _fail(f"{where}: missing '{key}'")
    value = d[key]
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise _fail(f"{where}: '{key}' has the wrong type ({type(value).__name__})")
    return value


def _check_name(name: Any, where: str) -> str:
    if not isinstance(name, str) or len(name) > MAX_NAME or not NAME_RE.fullmatch(name):
        raise _fail(f"{where}: invalid name {name!r} (at most {MAX_NAME} chars of [A-Za-z0-9_.:/-])")
    return name


def _is_int(v: Any) -> bool:
    # Bounded so every size and index fits the int32 that TF.js and torch kernels use.
    return isinstance(v, int) and not isinstance(v, bool) and abs(v) <= MAX_INT


def _parse_spec(raw: Any, section: str, batched: bool, dtypes: tuple[str, ...]) -> TensorSpec:
    where = section
    if not isinstance(raw, dict):
        raise _fail(f"{section}: entries must be objects")
    name = _check_name(raw.get("name"), section)
    where = f"{section} '{name}'"
    shape = _get(raw, "shape", list, where)
    if not all(_is_int(d) for d in shape):
        raise _fail(f"{where}: shape must be a list of ints")
    dims = shape[1:] if batched else shape
    if batched and (not shape or shape[0] != -1):
        raise _fail(f"{where}: the first dimension must be the batch dimension -1")
    if any(d <= 0 for d in dims):
        raise _fail(f"{where}: dimensions must be positive, got {shape}")
    dtype = raw.get("dtype", "float32")
    if dtype not in dtypes:
        raise _fail(f"{where}: dtype must be one of {list(dtypes)}, got {dtype!r}")
    return TensorSpec(name, tuple(shape), dtype)


def _parse_specs(
    data: Mapping[str, Any], section: str, batched: bool, required: bool = True
) -> tuple[TensorSpec, ...]:
    if section not in data and not required:
        return ()
    raw = _get(data, section, list, "graph")
    return tuple(_parse_spec(r, section, batched, SECTION_DTYPES[section]) for r in raw)


def _norm_attr(spec: Attr, value: Any, where: str) -> Any:
    kind = spec.kind
    if kind in ("pair_or_none", "int_or_none") and value is None:
        return None
    if kind in ("pair", "pair_or_none"):
        if _is_int(value):
            value = [value, value]
        if not (isinstance(value, list) and len(value) == 2 and all(_is_int(v) for v in value)):
            raise _fail(f"{where}: expected an int or a list of two ints, got {value!r}")
        return list(value)
    if kind == "ints":
        if not (isinstance(value, list) and all(_is_int(v) for v in value)):
            raise _fail(f"{where}: expected a list of ints, got {value!r}")
        return list(value)
    if kind in ("int", "int_or_none") and _is_int(value):
        return value
    if kind == "float" and (_is_int(value) or isinstance(value, float)) and math.isfinite(value):
        return float(value)
    if kind == "bool" and isinstance(value, bool):
        return value
    if kind == "str" and isinstance(value, str) and value in spec.choices:
        return value
    raise _fail(
        f"{where}: invalid value {value!r} (expected {kind}"
        + (f" in {list(spec.choices)})" if spec.choices else ")")
    )


def _parse_attrs(op: str, raw: Any, where: str, table: Mapping[str, OpSpec] = OP_SPECS) -> dict[str, Any]:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise _fail(f"{where}: attrs must be an object")
    specs = table[op].attrs
    unknown = sorted(set(raw) - set(specs))
    if unknown:
        raise _fail(f"{where}: unknown attrs {unknown} for op '{op}'")
    out: dict[str, Any] = {}
    for key, spec in specs.items():
        if key in raw:
            out[key] = _norm_attr(spec, raw[key], f"{where} attr '{key}'")
        elif spec.default is REQUIRED:
            raise _fail(f"{where}: missing required attr '{key}' for op '{op}'")
        else:
            out[key] = spec.default
    if "stride" in out and out["stride"] is None:
        out["stride"] = list(out["kernel_size"])  # torch's pooling default
    if op == "reshape" and out["shape"].count(-1) > 1:
        raise _fail(f"{where}: reshape may use -1 only once")
    return out


def _check_inputs(op: str, inputs: Any, defined: set[str], where: str) -> tuple[str | None, ...]:
    if not isinstance(inputs, list):
        raise _fail(f"{where}: inputs must be a list")
    slots = OP_SPECS[op].inputs
    variadic = slots[-1].endswith("*")
    if variadic and not inputs or not variadic and len(inputs) != len(slots):
        raise _fail(f"{where}: op '{op}' takes inputs {list(slots)}, got {len(inputs)}")
    for i, name in enumerate(inputs):
        slot = slots[min(i, len(slots) - 1)]
        if name is None:
            if not slot.endswith("?"):
                raise _fail(f"{where}: input '{slot.rstrip('*')}' may not be null")
            continue
        if not isinstance(name, str) or name not in defined:
            raise _fail(f"{where}: input {name!r} is not defined before this node")
    return tuple(inputs)


def _parse_node(raw: Any, index: int, defined: set[str]) -> Node:
    if not isinstance(raw, dict):
        raise _fail(f"node #{index}: must be an object")
    name = _check_name(raw.get("name"), f"node #{index}")
    op = raw.get("op")
    where = f"node '{name}'"
    if not isinstance(op, str) or op not in OP_SPECS:
        raise _fail(f"{where}: unknown op {op!r}")
    where = f"node '{name}' ({op})"
    inputs = _check_inputs(op, raw.get("inputs"), defined, where)
    return Node(name, op, inputs, _parse_attrs(op, raw.get("attrs"), where))


def _check_unique(names: list[str]) -> None:
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise _fail(f"duplicate name '{name}'")
        seen.add(name)


def _check_limits(params: tuple[TensorSpec, ...], nodes: list[Any]) -> None:
    if len(nodes) > MAX_NODES:
        raise _fail(f"too many nodes: {len(nodes)} > {MAX_NODES}")
    if len(params) > MAX_PARAMS:
        raise _fail(f"too many params: {len(params)} > {MAX_PARAMS}")
    elements = sum(math.prod(p.shape) for p in params)
    if elements > MAX_PARAM_ELEMENTS:
        raise _fail(f"too many parameter elements: {elements} > {MAX_PARAM_ELEMENTS}")


def _parse_loss(
    raw: Any, output: str, targets: tuple[TensorSpec, ...], buffers: tuple[TensorSpec, ...]
) -> Loss:
    if not isinstance(raw, dict):
        raise _fail("loss: must be an object")
    op = raw.get("op")
    if not isinstance(op, str) or op not in LOSS_SPECS:
        raise _fail(f"loss: unknown op {op!r} (expected one of {list(LOSS_SPECS)})")
    inputs = _loss_inputs(op, raw.get("inputs"), output, {t.name for t in targets})
    if inputs[2:] and inputs[2] not in {b.name for b in buffers}:
        raise _fail(f"loss: class weights {inputs[2]!r} must be a buffer")
    attrs = _parse_attrs(op, raw.get("attrs"), f"loss ({op})", LOSS_SPECS)
    if not 0.0 <= attrs.get("label_smoothing", 0.0) <= 1.0:
        raise _fail(f"loss ({op}): label_smoothing must be between 0 and 1, got {attrs['label_smoothing']}")
    return Loss(op, inputs, attrs)


def _loss_inputs(op: str, inputs: Any, output: str, target_names: set[str]) -> tuple[str, ...]:
    """[output, target] plus the loss's optional slots; an omitted or null trailing slot is dropped, so
    [out, y] and [out, y, null] are the same graph."""
    slots = LOSS_SPECS[op].inputs
    while isinstance(inputs, list) and 2 < len(inputs) <= len(slots) and inputs[-1] is None:
        inputs = inputs[:-1]
    if not (
        isinstance(inputs, list)
        and 2 <= len(inputs) <= len(slots)
        and all(isinstance(name, str) for name in inputs)
        and inputs[0] == output
        and inputs[1] in target_names
    ):
        optional = "".join(f", optional {slot.rstrip('?')}" for slot in slots[2:])
        raise _fail(f"loss: inputs must be [output '{output}', a target{optional}], got {inputs!r}")
    return tuple(inputs)


def _parse_header(data: Any) -> dict[str, Any]:
    if isinstance(data, (bytes, str)):
        try:
            data = json_loads_bounded(data, MAX_JSON_DEPTH)
        except ValueError as exc:  # includes UnicodeDecodeError
            raise _fail(f"graph is not valid JSON: {str(exc)[:300]}") from None
    if not isinstance(data, dict):
        raise _fail("graph must be a JSON object")
    if data.get("format") != FORMAT or data.get("version") != VERSION:
        raise _fail(
            f"unsupported graph format {data.get('format')!r} version "
            f"{data.get('version')!r} (expected {FORMAT!r} version {VERSION})"
        )
    return data


def load_graph(
    data: dict[str, Any] | str | bytes, max_activation_bytes: int | None = MAX_ACTIVATION_BYTES
) -> Graph:
    """Parse and fully validate a graph; raises GraphError naming the offending part.

    Also refuses graphs whose activations need more than ``max_activation_bytes`` per training sample
    (None: no bound), so nothing ever tries to run them.
    """
    try:
        graph, values = _load(data)
    except GraphError:
        raise
    except (
        ValueError,
        TypeError,
        KeyError,
        IndexError,
        AttributeError,
        OverflowError,
        RecursionError,
        MemoryError,
    ) as exc:  # hostile input the checks above did not foresee: still a clear error
        raise _fail(f"malformed graph ({type(exc).__name__}: {str(exc)[:200]})") from None
    if max_activation_bytes is not None:
        _activation_from(graph, values, INFER_BATCH).check(max_activation_bytes)
    return graph


def _load(data: dict[str, Any] | str | bytes) -> tuple[Graph, dict[str, torch.Tensor]]:
    data = _parse_header(data)
    name = _check_name(data.get("name", "model"), "graph")
    inputs = _parse_specs(data, "inputs", True)
    targets = _parse_specs(data, "targets", True)
    params = _parse_specs(data, "params", False)
    buffers = _parse_specs(data, "buffers", False, required=False)
    raw_nodes = _get(data, "nodes", list, "graph")
    if not inputs or not targets or not raw_nodes:
        raise _fail("graph needs at least one input, one target and one node")
    _check_limits(params, raw_nodes)
    _check_unique([s.name for s in (*inputs, *targets, *params, *buffers)])
    nodes = _parse_nodes(raw_nodes, {s.name for s in (*inputs, *targets, *params, *buffers)})
    output = data.get("output")
    if not isinstance(output, str) or output not in {n.name for n in nodes}:
        raise _fail(f"output {output!r} is not a node")
    loss = _parse_loss(data.get("loss"), output, targets, buffers)
    graph = Graph(name, inputs, targets, params, buffers, tuple(nodes), output, loss)
    return graph, _checked_values(graph, INFER_BATCH)


def _parse_nodes(raw_nodes: list[Any], defined: set[str]) -> list[Node]:
    nodes: list[Node] = []
    for i, raw in enumerate(raw_nodes):
        node = _parse_node(raw, i, defined)
        if node.name in defined:
            raise _fail(f"duplicate name '{node.name}'")
        defined.add(node.name)
        nodes.append(node)
    return nodes


# ---------------------------------------------------------------- shape inference


def _meta(spec: TensorSpec, batch: int) -> torch.Tensor:
    shape = [batch if d == -1 else d for d in spec.shape]
    return torch.empty(shape, dtype=DTYPES[spec.dtype], device="meta")


def _first_line(exc: BaseException) -> str:
    # torch appends C++ stack traces to some messages; users need only the first line.
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:500]


def meta_values(graph: Graph, batch: int) -> dict[str, torch.Tensor]:
    values: dict[str, torch.Tensor] = {}
    for spec in (*graph.inputs, *graph.targets, *graph.params, *graph.buffers):
        try:
            values[spec.name] = _meta(spec, batch)
        except (RuntimeError, ValueError, OverflowError) as exc:
            raise _fail(f"'{spec.name}': unusable shape {list(spec.shape)}: {_first_line(exc)}") from None
    for node in graph.nodes:
        args = [None if n is None else values[n] for n in node.inputs]
        try:
            values[node.name] = ops.run_op(node.op, args, node.attrs, False)
        except (RuntimeError, ValueError, IndexError, TypeError, ArithmeticError) as exc:
            shapes = [None if a is None else list(a.shape) for a in args]
            raise _fail(
                f"node '{node.name}' ({node.op}): {_first_line(exc)} (input shapes {shapes})"
            ) from None
    return values


def _checked_values(graph: Graph, batch: int) -> dict[str, torch.Tensor]:
    values = meta_values(graph, batch)
    pred, target = values[graph.loss.inputs[0]], values[graph.loss.inputs[1]]
    weight = None if graph.loss.weight is None else values[graph.loss.weight]
    try:
        ops.check_loss_shapes(graph.loss.op, pred, target, weight)
    except ValueError as exc:
        raise _fail(f"loss ({graph.loss.op}): {exc}") from None
    return values


def infer_shapes(graph: Graph, batch: int = INFER_BATCH) -> dict[str, tuple[int, ...]]:
    """Shape of every named value (inputs, targets, params, buffers, nodes) for ``batch`` samples.

    Runs the graph on meta tensors (no data, no compute), so the shapes are exactly torch's.
    """
    return {name: tuple(v.shape) for name, v in _checked_values(graph, batch).items()}


# ---------------------------------------------------------------- activation memory


@dataclass(frozen=True)
class ActivationMemory:
    """Bytes of activations per sample, from the inferred shapes: the interpreters (runtime.py and the
    browsers' runtime.js) keep every node's output until the step ends, so the forward pass needs their
    sum, and training about twice that (a gradient per saved activation)."""

    forward_bytes: int
    largest_node: Node
    largest_shape: tuple[int, ...]
    largest_bytes: int

    @property
    def train_bytes(self) -> int:
        return TRAIN_MEMORY_FACTOR * self.forward_bytes

    def batch_within(self, budget: int, cap: int) -> int:
        """The largest batch (1 to cap) whose forward pass fits in ``budget`` bytes."""
        return max(1, min(cap, budget // max(self.forward_bytes, 1)))

    def check(self, limit: int) -> None:
        if self.train_bytes <= limit:
            return
        node = self.largest_node
        raise _fail(
            f"activations need {_mib(self.train_bytes)} MiB per training sample (at most "
            f"{_mib(limit)} MiB); the largest is node '{node.name}' ({node.op}), "
            f"{_mib(self.largest_bytes)} MiB per sample (output shape "
            f"{list(self.largest_shape)} for a batch of {INFER_BATCH})"
        )


def _mib(size: int | float) -> str:
    return f"{size / 2**20:,.0f}" if size >= 2**20 else f"{size / 2**20:.2f}"


def _activation_from(graph: Graph, values: Mapping[str, torch.Tensor], batch: int) -> ActivationMemory:
    # Per sample = the size at `batch` divided by it: nodes that do not depend on the batch are counted
    # as if they did (slightly high, never low for the batch sizes that matter).
    sizes = {n.name: math.prod(values[n.name].shape) * values[n.name].element_size() for n in graph.nodes}
    samples = sum(
        math.prod(values[s.name].shape) * values[s.name].element_size()
        for s in (*graph.inputs, *graph.targets)
    )
    largest = max(graph.nodes, key=lambda n: sizes[n.name])
    return ActivationMemory(
        -(-(sum(sizes.values()) + samples) // batch),
        largest,
        tuple(values[largest.name].shape),
        -(-sizes[largest.name] // batch),
    )


def activation_memory(graph: Graph) -> ActivationMemory:
    """Activation memory of a loaded graph, per sample (see ActivationMemory)."""
    return _activation_from(graph, meta_values(graph, INFER_BATCH), INFER_BATCH)
