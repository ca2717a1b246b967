"""Capture: torch.fx tracing, the example runs, and the conversion loop every handler works through.

The module is traced symbolically (in train and in eval mode, which must agree) and then run on example
batches of 2 and 3 samples: the recorded values give every shape, and comparing the two runs tells which
dimension is the batch (written -1 in reshapes), so modules may use literal sizes or ``x.size(0)`` alike.
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import Tensor, nn
from torch.fx._symbolic_trace import _maybe_revert_all_patches
from torch.fx.node import _get_qualified_name

from engine.layers import PositionalEmbedding

Ref = str  # the graph name of a tensor value
Bound = dict[str, Any]  # a call's arguments by parameter name, defaults filled in


class Const:
    """Marks fx values that are not tensors (sizes, ints); their values come from the runs."""


CONST = Const()


@dataclass(frozen=True)
class Refused:
    """A value the graph cannot carry (e.g. attention weights): an export error once something uses it."""

    message: str


@dataclass(frozen=True)
class Deferred:
    """A tensor that does not depend on the input: a parameter, a buffer, or something computed from them or
    from constants. It becomes graph nodes only when a graph op uses it, so masks and position tables that a
    handler reads by value never have to be expressible in the graph."""

    node: fx.Node


class ExportError(ValueError):
    """The module uses something the graph format cannot express; names the op, argument and module path."""


ModuleHandler = Callable[["Exporter", fx.Node, Any, Bound, str], Any]
CallHandler = Callable[["Exporter", fx.Node, Bound, str], Any]
CallEntry = tuple[Callable[..., Any], CallHandler]  # (signature used to bind the arguments, handler)


@dataclass(frozen=True)
class Handlers:
    modules: Mapping[type, ModuleHandler]
    calls: Mapping[Any, CallEntry]


# Arguments whose value may legitimately differ between the train-mode and eval-mode traces: they follow
# self.training, and the graph op they map to follows the interpreter's mode the same way.
MODE_ARGS = frozenset({"training", "dropout_p"})
# Calls that return (part of) their input's storage: an in-place op on one of them overwrites the others.
VIEW_METHODS = frozenset(
    {"view", "reshape", "transpose", "permute", "flatten", "squeeze", "unsqueeze", "contiguous", "t"}
    | {"split", "chunk", "narrow", "expand", "unflatten", "view_as", "reshape_as"}
)
VIEW_FUNCTIONS = frozenset(
    {torch.reshape, torch.transpose, torch.permute, torch.flatten, torch.squeeze, torch.unsqueeze}
    | {torch.split, torch.chunk, torch.narrow, operator.getitem}
)
# Non-tensor results that may be read from a tensor: its shape, never its values.
SIZE_METHODS = frozenset({"size", "dim", "ndimension", "numel", "nelement"})


def describe(target: Any) -> str:
    """How the user spelled a call target: torch.nn.functional.relu, Tensor.view, operator.getitem."""
    if isinstance(target, str):
        return f"Tensor.{target}"
    name = getattr(target, "__name__", "")
    spaces = (
        ("torch", torch),
        ("torch.nn.functional", F),
        ("torch.fft", torch.fft),
        ("torch.linalg", torch.linalg),
        ("torch.special", torch.special),
    )
    for space_name, space in spaces:
        for candidate in (name, name.split("_", 1)[-1]):
            if candidate and getattr(space, candidate, None) is target:
                return f"{space_name}.{candidate}"
    return _get_qualified_name(target)


def bind(signature: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Bound:
    bound = inspect.signature(signature).bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def pair(v: Any) -> list[int]:
    return [int(v), int(v)] if isinstance(v, int) else [int(a) for a in v]


def holds_tensor(value: Any) -> bool:
    if isinstance(value, (tuple, list)):
        return any(holds_tensor(v) for v in value)
    return isinstance(value, Tensor)


def is_data(value: Any) -> bool:
    """Whether an env value is (or holds) a graph tensor computed from the input."""
    if isinstance(value, (tuple, list)):
        return any(is_data(v) for v in value)
    return isinstance(value, (str, Refused))


class Tracer(fx.Tracer):
    """fx's default leaves (every torch.nn module but Sequential) plus our PositionalEmbedding.

    Python control flow on sizes (``assert t <= block_size``) is decided by running what was traced so far
    on the example batches (``decide``): the graph's shapes are fixed, so the branch is too."""

    def __init__(self, decide: Callable[[fx.Graph, fx.Node], bool]) -> None:
        super().__init__()
        self.decide = decide
        # Buffers read in forward (e.g. a causal mask sliced to the sequence length) become graph values.
        self.proxy_buffer_attributes = True

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return isinstance(m, PositionalEmbedding) or super().is_leaf_module(m, module_qualified_name)

    def to_bool(self, obj: fx.Proxy) -> bool:
        return self.decide(self.graph, obj.node)


class Recorder(fx.Interpreter):
    """Runs the traced graph, keeping every node's value."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.values: dict[fx.Node, Any] = {}

    def run_node(self, n: fx.Node) -> Any:
        self.values[n] = result = super().run_node(n)
        return result


class _Modes:
    """Saves every submodule's train/eval flag (they may differ, e.g. a frozen batchnorm) to restore it."""

    def __init__(self, module: nn.Module) -> None:
        self.modes = [(m, m.training) for m in module.modules()]

    def restore(self) -> None:
        for m, mode in self.modes:
            m.training = mode


def path_of(node: fx.Node) -> str:
    if node.op == "call_module":
        return str(node.target)
    stack = node.meta.get("nn_module_stack") or {}
    return str(next(reversed(stack))) if stack else "<root>"


class Exporter:
    def __init__(
        self, module: nn.Module, input_shape: tuple[int, ...], input_dtype: str, handlers: Handlers
    ) -> None:
        self.module, self.handlers = module, handlers
        self.input_shape, self.input_dtype = tuple(input_shape), input_dtype
        self.param_names = {id(p): n for n, p in module.named_parameters()}
        self.buffer_names = {id(b): n for n, b in module.named_buffers()}
        self.trainable = {id(p) for p in module.parameters() if p.requires_grad}
        self.nodes: list[dict[str, Any]] = []
        self.names: set[str] = set()
        self.used: dict[str, Tensor] = {}  # param/buffer name -> tensor, in first-use order
        self.params: set[str] = set()  # the used names that are trained (the rest are buffers)
        self.env: dict[fx.Node, Any] = {}  # fx node -> Ref | CONST | Deferred | Refused | tuple of those
        self.eval_of: dict[fx.Node, fx.Node] = {}  # train-mode trace node -> the eval-mode trace's
        self.path = "<root>"

    # ------------------------------------------------------------ tracing and example runs

    def trace(self) -> None:
        self.check_dtypes()
        train, evaluation = self.trace_in(True), self.trace_in(False)
        self.check_mode_independent(train, evaluation)
        self.gm = fx.GraphModule(self.module, train)
        self.order = {n: i for i, n in enumerate(self.gm.graph.nodes)}
        self.runs = self.record_runs(self.gm)

    def check_dtypes(self) -> None:
        for name, p in self.module.named_parameters():
            if p.dtype != torch.float32:
                raise ExportError(f"parameter '{name}' has dtype={p.dtype}; parameters must be float32")

    def trace_in(self, training: bool) -> fx.Graph:
        modes = _Modes(self.module)
        self.module.train(training)
        try:
            return Tracer(self.decide).trace(self.module)
        except ExportError:
            raise
        except Exception as exc:  # fx raises many kinds (TraceError, TypeError, ...)
            raise ExportError(f"cannot trace the module: {exc}") from None
        finally:
            modes.restore()

    def check_mode_independent(self, train: fx.Graph, evaluation: fx.Graph) -> None:
        """Python code reading self.training is resolved while tracing: the graph can follow the mode only
        through ops that do so themselves (dropout), so the two traces may differ only in such arguments."""
        a, b = [n for n in train.nodes if not _counts_batches(n)], list(evaluation.nodes)
        if len(a) != len(b):
            raise ExportError(
                "the forward pass reads self.training: train and eval mode trace to different programs, "
                "which one graph cannot express"
            )
        for x, y in zip(a, b, strict=True):
            self.eval_of[x] = y
            if not self._same_call(x, y):
                raise ExportError(
                    f"the forward pass reads self.training at '{path_of(x)}' ({describe(x.target)}): train "
                    "and eval mode trace differently there, which one graph cannot express (only arguments "
                    f"{sorted(MODE_ARGS)} of a call may follow the mode)"
                )

    def _same_call(self, x: fx.Node, y: fx.Node) -> bool:
        if (x.op, x.target) != (y.op, y.target):
            return False
        if _args_text(x) == _args_text(y):
            return True
        entry = self.call_entry(x)
        if entry is None:
            return False
        try:
            bx = bind(entry[0], tuple(x.args), dict(x.kwargs))
            by = bind(entry[0], tuple(y.args), dict(y.kwargs))
        except TypeError:
            return False
        return {k for k in bx if _text(bx[k]) != _text(by[k])} <= MODE_ARGS

    def example(self, batch: int) -> Tensor:
        if self.input_dtype == "int64":
            return torch.zeros((batch, *self.input_shape), dtype=torch.int64)
        # A private generator: exporting must not disturb the caller's random stream.
        return torch.randn((batch, *self.input_shape), generator=torch.Generator().manual_seed(batch))

    def decide(self, graph: fx.Graph, node: fx.Node) -> bool:
        """The value of a traced condition, which may read sizes but not the values of tensors."""
        copy, nodes = fx.Graph(), {}  # type: ignore[var-annotated]
        copy.graph_copy(graph, nodes)
        copy.output(nodes[node])
        # While tracing, fx patches nn.Module.__call__ (a called layer would add nodes to the trace and return
        # a Proxy): the example runs must call the real layers.
        with _maybe_revert_all_patches():
            runs = self.record_runs(fx.GraphModule(self.module, copy))
        if not _reads_sizes_only(nodes[node], runs[0]):
            raise ExportError(
                f"cannot trace the module: control flow depends on tensor values at {node.name}"
            )
        if runs[0][nodes[node]] != runs[1][nodes[node]]:
            raise ExportError(
                f"cannot trace the module: control flow depends on the batch size at {node.name}"
            )
        return bool(runs[0][nodes[node]])

    def record_runs(self, gm: fx.GraphModule) -> list[dict[fx.Node, Any]]:
        # Eval mode, and buffers restored afterwards: looking must not update batchnorm's running stats.
        modes, saved = _Modes(self.module), {n: b.detach().clone() for n, b in self.module.named_buffers()}
        self.module.eval()
        try:
            with torch.random.fork_rng(devices=[]), torch.no_grad():
                return [self.record(gm, batch) for batch in (2, 3)]
        finally:
            modes.restore()
            with torch.no_grad():
                for n, b in self.module.named_buffers():
                    b.copy_(saved[n])

    def record(self, gm: fx.GraphModule, batch: int) -> dict[fx.Node, Any]:
        recorder = Recorder(gm)
        try:
            recorder.run(self.example(batch))
        except Exception as exc:
            raise ExportError(f"running the module on an example batch failed: {exc}") from None
        return recorder.values

    # ------------------------------------------------------------ helpers for handlers

    def fail(self, what: str, detail: str = "") -> ExportError:
        extra = f" ({detail})" if detail else ""
        return ExportError(f"unsupported operation {what} at '{self.path}'{extra}")

    def refuse(self, what: str, arg: str, value: Any, why: str = "") -> ExportError:
        """An argument (or module attribute) the graph cannot honour; the message names it."""
        extra = f": {why}" if why else ""
        return ExportError(f"unsupported argument {arg}={value!r} of {what} at '{self.path}'{extra}")

    def sub(self, node: fx.Node | str, part: str) -> str:
        """The name of a node an expansion adds; ':' appears in no torch name, so it cannot collide."""
        return f"{node.name if isinstance(node, fx.Node) else node}:{part}"

    def emit(self, name: str, op: str, inputs: Sequence[Ref | None], **attrs: Any) -> Ref:
        if name in self.names:
            raise ExportError(f"internal error: node name '{name}' emitted twice")
        self.names.add(name)
        self.nodes.append({"name": name, "op": op, "inputs": list(inputs), "attrs": attrs})
        return name

    def tensor_ref(self, tensor: Tensor | None, what: str) -> Ref | None:
        """A parameter or buffer of the module; frozen parameters (requires_grad=False) become buffers."""
        if tensor is None:
            return None
        name = self.param_names.get(id(tensor)) or self.buffer_names.get(id(tensor))
        if name is None:
            raise self.fail(what, "the tensor is not a parameter or buffer of the module")
        if tensor.dtype != torch.float32:
            raise self.fail(what, f"'{name}' has dtype={tensor.dtype}; graph tensors are float32")
        self.used.setdefault(name, tensor)
        if id(tensor) in self.trainable:
            self.params.add(name)
        return name

    def value(self, arg: Any) -> Any:
        """The env value of an fx argument, converting a Deferred tensor now that something needs it."""
        if not isinstance(arg, fx.Node):
            return arg
        value = self.env.get(arg)
        return self.materialize(arg) if isinstance(value, Deferred) else value

    def ref(self, arg: Any, what: str) -> Ref:
        value = self.value(arg)
        if isinstance(value, Refused):
            raise ExportError(value.message)
        if not isinstance(value, str):
            raise self.fail(what, f"expected a tensor argument, got {arg!r}")
        return value

    def opt_ref(self, arg: Any, what: str) -> Ref | None:
        return None if arg is None else self.ref(arg, what)

    def is_tensor(self, arg: Any) -> bool:
        return isinstance(arg, fx.Node) and isinstance(self.runs[0].get(arg), Tensor)

    def const(self, arg: Any, what: str) -> Any:
        """A non-tensor argument's value; it must not depend on the batch size."""
        if isinstance(arg, (list, tuple)):
            return type(arg)(self.const(a, what) for a in arg)
        if isinstance(arg, slice):
            return slice(self.const(arg.start, what), self.const(arg.stop, what), self.const(arg.step, what))
        if not isinstance(arg, fx.Node):
            return arg
        first, second = (run[arg] for run in self.runs)
        if isinstance(first, Tensor) or first != second:
            raise self.fail(what, f"argument {arg.name} depends on the batch or is a tensor")
        return list(first) if isinstance(first, torch.Size) else first

    def constant_tensor(self, arg: Any, what: str, name: str) -> Tensor:
        """The value of a tensor argument that must not depend on the input (e.g. an attention mask)."""
        if not isinstance(arg, fx.Node) or is_data(self.env.get(arg)):
            raise self.refuse(what, name, arg, "only a tensor that does not depend on the input")
        first, second = (run[arg] for run in self.runs)
        if first.shape != second.shape or not torch.equal(first, second):
            raise self.refuse(what, name, arg, "the tensor depends on the batch")
        return first  # type: ignore[no-any-return]

    def eval_const(self, node: fx.Node, signature: Callable[..., Any], name: str, what: str) -> Any:
        """A call's argument as the eval-mode trace has it (arguments in MODE_ARGS may differ)."""
        other = self.eval_of[node]
        value = bind(signature, tuple(other.args), dict(other.kwargs))[name]
        if isinstance(value, fx.Node):
            raise self.fail(what, f"argument {name} is computed in eval mode; it must be a constant")
        return value

    def shape(self, node: fx.Node) -> list[int]:
        return list(self.runs[0][node].shape)

    def batch_dims(self, node: fx.Node) -> list[int]:
        small, big = (list(run[node].shape) for run in self.runs)
        return [i for i, (a, b) in enumerate(zip(small, big, strict=True)) if a != b]

    def batch_dim(self, node: fx.Node, what: str) -> int | None:
        varying = self.batch_dims(node)
        if len(varying) > 1:
            raise self.fail(what, "more than one dimension depends on the batch size")
        return varying[0] if varying else None

    def batch_shape(self, node: fx.Node, what: str) -> list[int]:
        """The node's output shape with its batch-dependent dimension written -1."""
        dim = self.batch_dim(node, what)
        return [-1 if i == dim else d for i, d in enumerate(self.shape(node))]

    def check_inplace(self, node: fx.Node, target: Any, what: str) -> None:
        """In-place is harmless unless the overwritten tensor (or a view of it) is read afterwards."""
        if not isinstance(target, fx.Node):
            return
        later = [
            u
            for alias in self._aliases(target)
            for u in alias.users
            if u is not node and self.order[u] > self.order[node]
        ]
        if later:
            raise self.refuse(
                what, "inplace", True, f"the overwritten input is read again by {later[0].name}"
            )

    def _aliases(self, node: fx.Node) -> set[fx.Node]:
        seen, todo = set(), [node]
        while todo:
            n = todo.pop()
            if n in seen:
                continue
            seen.add(n)
            if _is_view(n) and isinstance(n.args[0], fx.Node):
                todo.append(n.args[0])
            todo.extend(u for u in n.users if _is_view(u) and u.args and u.args[0] is n)
        return seen

    # ------------------------------------------------------------ conversion

    def convert(self) -> None:
        for node in self.gm.graph.nodes:
            self.path = path_of(node)
            self.env[node] = self.convert_node(node)

    def convert_node(self, node: fx.Node) -> Any:
        if node.op == "placeholder":
            if any(n.op == "placeholder" for n in self.env):
                raise self.fail(f"second input '{node.target}'", "modules must take one tensor")
            return "x"
        if node.op == "output":
            return self.ref(node.args[0], "output")
        if node.op == "get_attr":
            return Deferred(node)
        reads_data = any(is_data(self.env.get(a)) for a in node.all_input_nodes)
        if not holds_tensor(self.runs[0][node]):
            if reads_data and not _reads_shape_only(node) and not self._picks_from_tuple(node):
                raise self.fail(_what(node), "reading tensor values into Python is not supported")
            return CONST  # sizes and Python arithmetic on them; read via const()
        return self.convert_op(node) if reads_data else Deferred(node)

    def _picks_from_tuple(self, node: fx.Node) -> bool:
        """getitem on a returned tuple (e.g. the None of need_weights=False) reads no tensor's values."""
        source = node.args[0] if node.args else None
        if (
            node.op != "call_function"
            or node.target is not operator.getitem
            or not isinstance(source, fx.Node)
        ):
            return False
        return isinstance(self.runs[0].get(source), (tuple, list))

    def materialize(self, node: fx.Node) -> Any:
        saved, self.path = self.path, path_of(node)
        try:
            if node.op == "get_attr":
                value: Any = self.tensor_ref(self.runs[0][node], f"attribute {node.target}")
            else:
                value = self.convert_op(node)
        finally:
            self.path = saved
        self.env[node] = value
        return value

    def convert_op(self, node: fx.Node) -> Any:
        if node.op == "call_module":
            return self.convert_module(node, self.module.get_submodule(str(node.target)))
        return self.convert_call(node)

    def module_handler(self, m: nn.Module) -> ModuleHandler | None:
        # The nearest registered class in the MRO, so subclasses (e.g. UpsamplingNearest2d) reuse it.
        return next((self.handlers.modules[c] for c in type(m).__mro__ if c in self.handlers.modules), None)

    def convert_module(self, node: fx.Node, m: nn.Module) -> Any:
        what = f"{type(m).__module__}.{type(m).__qualname__}"
        handler = self.module_handler(m)
        if handler is None:
            raise self.fail(what)
        try:
            bound = bind(m.forward, tuple(node.args), dict(node.kwargs))
        except TypeError as exc:
            raise self.fail(what, str(exc)) from None
        return handler(self, node, m, bound, what)

    def call_entry(self, node: fx.Node) -> CallEntry | None:
        """By the function (or method name); functions of packages the engine does not import (e.g.
        torchvision's fx-wrapped stochastic_depth) by their qualified name."""
        if node.op != "call_function":
            return self.handlers.calls.get(("method", node.target))
        entry = self.handlers.calls.get(node.target)
        if entry is not None or isinstance(node.target, str):
            return entry
        return self.handlers.calls.get(("function", _get_qualified_name(node.target)))

    def convert_call(self, node: fx.Node) -> Any:
        what = _what(node)
        entry = self.call_entry(node)
        if entry is None:
            raise self.fail(what)
        signature, handler = entry
        try:
            bound = bind(signature, tuple(node.args), dict(node.kwargs))
        except TypeError as exc:
            raise self.fail(what, str(exc)) from None
        return handler(self, node, bound, what)


def _what(node: fx.Node) -> str:
    return describe(node.target)


def _reads_shape_only(node: fx.Node) -> bool:
    if node.op == "call_method":
        return node.target in SIZE_METHODS
    return node.op == "call_function" and node.target is getattr


def _reads_sizes_only(node: fx.Node, values: Mapping[fx.Node, Any]) -> bool:
    """Whether every path from ``node`` back to a tensor passes a size query first."""
    todo, seen = [node], set()
    while todo:
        n = todo.pop()
        if n in seen or _reads_shape_only(n):
            continue
        seen.add(n)
        if isinstance(values.get(n), Tensor):
            return False
        todo.extend(n.all_input_nodes)
    return True


def _counts_batches(node: fx.Node) -> bool:
    """A batch norm's `num_batches_tracked.add_(1)` while training, with its result unused (timm's
    BatchNormAct2d spells it out). The counter matters only for momentum=None, whose factor reads it (so
    the pattern no longer holds) and which the batch_norm handlers refuse."""
    if node.op == "get_attr":
        return _is_counter(node) and bool(node.users) and all(_counts_batches(u) for u in node.users)
    source = node.args[0] if node.op == "call_method" and node.args else None
    return node.target == "add_" and not node.users and isinstance(source, fx.Node) and _is_counter(source)


def _is_counter(node: fx.Node) -> bool:
    return node.op == "get_attr" and str(node.target).split(".")[-1] == "num_batches_tracked"


def _is_view(node: fx.Node) -> bool:
    if node.op == "call_method":
        return node.target in VIEW_METHODS
    return node.op == "call_function" and node.target in VIEW_FUNCTIONS


def _text(value: Any) -> str:
    return repr(fx.node.map_arg(value, lambda n: n.name))


def _args_text(node: fx.Node) -> str:
    return _text((node.args, node.kwargs))
