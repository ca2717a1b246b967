"""Export a torch.nn.Module to a graph (docs/graph-format.md) via torch.fx symbolic tracing.

The module is traced once and then run on example batches of 2 and 3 samples: the recorded
values give every shape, and comparing the two runs tells which reshape dimension is the batch
(written -1), so modules may use literal sizes or ``x.size(0)`` alike.
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import Tensor, nn
from torch.fx.node import _get_qualified_name

from engine.graph import FORMAT, VERSION, load_graph
from engine.layers import PositionalEmbedding

Ref = str  # the graph name of a tensor value


class _Const:
    """Marks fx values that are not tensors (sizes, ints); their values come from the runs."""


_CONST = _Const()


class ExportError(ValueError):
    """The module uses something the graph format cannot express; names the op and module path."""


class _Tracer(fx.Tracer):
    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return isinstance(m, PositionalEmbedding) or super().is_leaf_module(m, module_qualified_name)


class _Recorder(fx.Interpreter):
    """Runs the traced graph, keeping every node's value."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.values: dict[fx.Node, Any] = {}

    def run_node(self, n: fx.Node) -> Any:
        self.values[n] = result = super().run_node(n)
        return result


def _describe(target: Any) -> str:
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


def _bind(signature: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    bound = inspect.signature(signature).bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


# Python signatures of the supported functions/methods, used only to bind fx args by name.
def _s_x(input: Any, inplace: bool = False) -> None: ...
def _s_gelu(input: Any, approximate: str = "none") -> None: ...
def _s_softmax(input: Any, dim: Any = None, _stacklevel: int = 3, dtype: Any = None) -> None: ...
def _s_dropout(input: Any, p: float = 0.5, training: bool = True, inplace: bool = False) -> None: ...
def _s_flatten(input: Any, start_dim: int = 0, end_dim: int = -1) -> None: ...
def _s_var(input: Any, *sizes: Any) -> None: ...
def _s_transpose(input: Any, dim0: int, dim1: int) -> None: ...
def _s_contiguous(input: Any, memory_format: Any = None) -> None: ...
def _s_addsub(input: Any, other: Any, alpha: Any = 1) -> None: ...
def _s_div(input: Any, other: Any, rounding_mode: Any = None) -> None: ...
def _s_ab(input: Any, other: Any) -> None: ...
def _s_cat(tensors: Any, dim: int = 0) -> None: ...
def _s_linear(input: Any, weight: Any, bias: Any = None) -> None: ...
def _s_split(input: Any, split_size_or_sections: Any, dim: int = 0) -> None: ...
def _s_chunk(input: Any, chunks: int, dim: int = 0) -> None: ...
def _s_squeeze(input: Any, dim: Any = None) -> None: ...
def _s_conv2d(
    input: Any,
    weight: Any,
    bias: Any = None,
    stride: Any = 1,
    padding: Any = 0,
    dilation: Any = 1,
    groups: int = 1,
) -> None: ...
def _s_max_pool2d(
    input: Any,
    kernel_size: Any,
    stride: Any = None,
    padding: Any = 0,
    dilation: Any = 1,
    ceil_mode: bool = False,
    return_indices: bool = False,
) -> None: ...
def _s_avg_pool2d(
    input: Any,
    kernel_size: Any,
    stride: Any = None,
    padding: Any = 0,
    ceil_mode: bool = False,
    count_include_pad: bool = True,
    divisor_override: Any = None,
) -> None: ...
def _s_adaptive(input: Any, output_size: Any) -> None: ...
def _s_layer_norm(
    input: Any, normalized_shape: Any, weight: Any = None, bias: Any = None, eps: float = 1e-5
) -> None: ...
def _s_embedding(
    input: Any,
    weight: Any,
    padding_idx: Any = None,
    max_norm: Any = None,
    norm_type: float = 2.0,
    scale_grad_by_freq: bool = False,
    sparse: bool = False,
) -> None: ...
def _s_sdpa(
    query: Any,
    key: Any,
    value: Any,
    attn_mask: Any = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Any = None,
    enable_gqa: bool = False,
) -> None: ...


class _Exporter:
    def __init__(self, module: nn.Module, input_shape: tuple[int, ...], input_dtype: str) -> None:
        self.module = module
        self.input_shape, self.input_dtype = tuple(input_shape), input_dtype
        self.param_names = {id(p): n for n, p in module.named_parameters()}
        self.buffer_names = {id(b): n for n, b in module.named_buffers()}
        self.nodes: list[dict[str, Any]] = []
        self.used: dict[str, Tensor] = {}  # param/buffer name -> tensor, in first-use order
        self.env: dict[fx.Node, Any] = {}  # fx node -> Ref | constant | tuple of Refs
        self.path = "<root>"

    # ------------------------------------------------------------ tracing and example runs

    def trace(self) -> None:
        try:
            graph = _Tracer().trace(self.module)
        except Exception as exc:  # fx raises many kinds (TraceError, TypeError, ...)
            raise ExportError(f"cannot trace the module: {exc}") from None
        self.gm = fx.GraphModule(self.module, graph)
        self.runs = [self._record(batch) for batch in (2, 3)]

    def example(self, batch: int) -> Tensor:
        if self.input_dtype == "int64":
            return torch.zeros((batch, *self.input_shape), dtype=torch.int64)
        # A private generator: exporting must not disturb the caller's random stream.
        return torch.randn((batch, *self.input_shape), generator=torch.Generator().manual_seed(batch))

    def _record(self, batch: int) -> dict[fx.Node, Any]:
        recorder = _Recorder(self.gm)
        was_training = self.module.training
        self.module.eval()  # eval: batchnorm must not update running stats while we look
        try:
            with torch.no_grad():
                recorder.run(self.example(batch))
        except Exception as exc:
            raise ExportError(f"running the module on an example batch failed: {exc}") from None
        finally:
            self.module.train(was_training)
        return recorder.values

    # ------------------------------------------------------------ helpers

    def fail(self, what: str, detail: str = "") -> ExportError:
        extra = f" ({detail})" if detail else ""
        return ExportError(f"unsupported operation {what} at '{self.path}'{extra}")

    def emit(self, name: str, op: str, inputs: Sequence[Ref | None], **attrs: Any) -> Ref:
        self.nodes.append({"name": name, "op": op, "inputs": list(inputs), "attrs": attrs})
        return name

    def tensor_ref(self, tensor: Tensor | None, what: str) -> Ref | None:
        if tensor is None:
            return None
        name = self.param_names.get(id(tensor)) or self.buffer_names.get(id(tensor))
        if name is None or tensor.dtype != torch.float32:
            raise self.fail(what, "tensor is not a float32 parameter or buffer of the module")
        self.used.setdefault(name, tensor)
        return name

    def ref(self, arg: Any, what: str) -> Ref:
        value = self.env.get(arg) if isinstance(arg, fx.Node) else None
        if not isinstance(value, str):
            raise self.fail(what, f"expected a tensor argument, got {arg!r}")
        return value

    def const(self, arg: Any, what: str) -> Any:
        """A non-tensor argument's value; it must not depend on the batch size."""
        if isinstance(arg, (list, tuple)):
            return type(arg)(self.const(a, what) for a in arg)
        if not isinstance(arg, fx.Node):
            return arg
        first, second = (run[arg] for run in self.runs)
        if isinstance(first, Tensor) or first != second:
            raise self.fail(what, f"argument {arg.name} depends on the batch or is a tensor")
        return list(first) if isinstance(first, torch.Size) else first

    def shapes(self, node: fx.Node) -> tuple[list[int], list[int]]:
        return list(self.runs[0][node].shape), list(self.runs[1][node].shape)

    def batch_shape(self, node: fx.Node, what: str) -> list[int]:
        """The node's output shape with its batch-dependent dimension written -1."""
        small, big = self.shapes(node)
        varying = [i for i, (a, b) in enumerate(zip(small, big, strict=True)) if a != b]
        if len(varying) > 1:
            raise self.fail(what, "more than one dimension depends on the batch size")
        return [-1 if i in varying else d for i, d in enumerate(small)]

    # ------------------------------------------------------------ conversion

    def convert(self) -> None:
        for node in self.gm.graph.nodes:
            stack = node.meta.get("nn_module_stack") or {}
            self.path = (
                node.target if node.op == "call_module" else (next(reversed(stack)) if stack else "<root>")
            )
            self.env[node] = self.convert_node(node)

    def convert_node(self, node: fx.Node) -> Any:
        if node.op == "placeholder":
            if any(n.op == "placeholder" for n in self.env):
                raise self.fail(f"second input '{node.target}'", "modules must take one tensor")
            return "x"
        if node.op == "output":
            return self.ref(node.args[0], "output")
        if node.op == "get_attr":
            return self.tensor_ref(self.runs[0][node], f"attribute {node.target}")
        value = self.runs[0][node]
        split_like = isinstance(value, (tuple, list)) and value and isinstance(value[0], Tensor)
        if not isinstance(value, Tensor) and not split_like:
            return _CONST  # sizes and Python arithmetic on them; read via const()
        if node.op == "call_module":
            return self.convert_module(node, self.module.get_submodule(str(node.target)))
        return self.convert_call(node)

    def convert_module(self, node: fx.Node, m: nn.Module) -> Any:
        what = f"{type(m).__module__}.{type(m).__qualname__}"
        handler = _MODULES.get(type(m))
        if handler is None:
            for cls, fn in _MODULES.items():
                if isinstance(m, cls):
                    handler = fn
        if handler is None or len(node.args) != 1 or node.kwargs:
            raise self.fail(what)
        return handler(self, node, m, self.ref(node.args[0], what), what)

    def convert_call(self, node: fx.Node) -> Any:
        what = _describe(node.target)
        key = node.target if node.op == "call_function" else ("method", node.target)
        entry = _CALLS.get(key)
        if entry is None:
            raise self.fail(what)
        signature, handler = entry
        try:
            bound = _bind(signature, tuple(node.args), dict(node.kwargs))
        except TypeError as exc:
            raise self.fail(what, str(exc)) from None
        return handler(self, node, bound, what)


# ---------------------------------------------------------------- module handlers

ModuleHandler = Callable[[_Exporter, fx.Node, Any, Ref, str], Any]


def _m_linear(e: _Exporter, n: fx.Node, m: nn.Linear, x: Ref, what: str) -> Ref:
    return e.emit(n.name, "linear", [x, e.tensor_ref(m.weight, what), e.tensor_ref(m.bias, what)])


def _m_conv2d(e: _Exporter, n: fx.Node, m: nn.Conv2d, x: Ref, what: str) -> Ref:
    if isinstance(m.padding, str) or m.padding_mode != "zeros":
        raise e.fail(what, "only explicit zero padding is supported")
    return e.emit(
        n.name,
        "conv2d",
        [x, e.tensor_ref(m.weight, what), e.tensor_ref(m.bias, what)],
        stride=list(m.stride),
        padding=list(m.padding),
        dilation=list(m.dilation),
        groups=m.groups,
    )


def _m_batch_norm(e: _Exporter, n: fx.Node, m: nn.BatchNorm2d, x: Ref, what: str) -> Ref:
    if not (m.affine and m.track_running_stats) or m.momentum is None:
        raise e.fail(what, "needs affine=True, track_running_stats=True and a fixed momentum")
    refs = [e.tensor_ref(t, what) for t in (m.weight, m.bias, m.running_mean, m.running_var)]
    return e.emit(n.name, "batch_norm", [x, *refs], eps=m.eps, momentum=m.momentum)


def _m_layer_norm(e: _Exporter, n: fx.Node, m: nn.LayerNorm, x: Ref, what: str) -> Ref:
    return e.emit(
        n.name,
        "layer_norm",
        [x, e.tensor_ref(m.weight, what), e.tensor_ref(m.bias, what)],
        normalized_shape=list(m.normalized_shape),
        eps=m.eps,
    )


def _m_embedding(e: _Exporter, n: fx.Node, m: nn.Embedding, x: Ref, what: str) -> Ref:
    if m.max_norm is not None:
        raise e.fail(what, "max_norm is not supported")
    return e.emit(n.name, "embedding", [x, e.tensor_ref(m.weight, what)])


def _m_pool(op: str) -> ModuleHandler:
    def handler(e: _Exporter, n: fx.Node, m: Any, x: Ref, what: str) -> Ref:
        plain = (
            not m.ceil_mode
            and getattr(m, "dilation", 1) in (1, (1, 1))
            and not getattr(m, "return_indices", False)
            and getattr(m, "count_include_pad", True)
            and getattr(m, "divisor_override", None) is None
        )
        if not plain:
            raise e.fail(what, "ceil_mode/dilation/return_indices/divisor are not supported")
        stride = m.stride if m.stride is not None else m.kernel_size
        return e.emit(
            n.name, op, [x], kernel_size=_pair(m.kernel_size), stride=_pair(stride), padding=_pair(m.padding)
        )

    return handler


def _pair(v: Any) -> list[int]:
    return [int(v), int(v)] if isinstance(v, int) else [int(a) for a in v]


def _m_adaptive(e: _Exporter, n: fx.Node, m: nn.AdaptiveAvgPool2d, x: Ref, what: str) -> Ref:
    size = m.output_size
    if size is None or not isinstance(size, int) and None in size:
        raise e.fail(what, "output_size with None is not supported")
    return e.emit(n.name, "adaptive_avg_pool2d", [x], output_size=_pair(size))


def _m_simple(op: str, **attr_getters: Callable[[Any], Any]) -> ModuleHandler:
    def handler(e: _Exporter, n: fx.Node, m: Any, x: Ref, what: str) -> Ref:
        return e.emit(n.name, op, [x], **{k: get(m) for k, get in attr_getters.items()})

    return handler


def _m_softmax(op: str) -> ModuleHandler:
    def handler(e: _Exporter, n: fx.Node, m: Any, x: Ref, what: str) -> Ref:
        if m.dim is None:
            raise e.fail(what, "an explicit dim is required")
        return e.emit(n.name, op, [x], dim=m.dim)

    return handler


_MODULES: dict[type, ModuleHandler] = {
    nn.Linear: _m_linear,
    nn.Conv2d: _m_conv2d,
    nn.BatchNorm2d: _m_batch_norm,
    nn.BatchNorm1d: _m_batch_norm,
    nn.LayerNorm: _m_layer_norm,
    nn.Embedding: _m_embedding,
    nn.ReLU: _m_simple("relu"),
    nn.Tanh: _m_simple("tanh"),
    nn.Sigmoid: _m_simple("sigmoid"),
    nn.GELU: _m_simple("gelu", approximate=lambda m: m.approximate),
    nn.Softmax: _m_softmax("softmax"),
    nn.LogSoftmax: _m_softmax("log_softmax"),
    nn.Dropout: _m_simple("dropout", p=lambda m: float(m.p)),
    nn.MaxPool2d: _m_pool("max_pool2d"),
    nn.AvgPool2d: _m_pool("avg_pool2d"),
    nn.AdaptiveAvgPool2d: _m_adaptive,
    nn.Flatten: _m_simple("flatten", start_dim=lambda m: m.start_dim, end_dim=lambda m: m.end_dim),
    nn.Identity: lambda e, n, m, x, what: x,
    PositionalEmbedding: lambda e, n, m, x, what: e.emit(
        n.name, "arange_embedding", [x, e.tensor_ref(m.weight, what)]
    ),
}


# ---------------------------------------------------------------- function/method handlers

Bound = dict[str, Any]
CallHandler = Callable[[_Exporter, fx.Node, Bound, str], Any]


def _c_unary(op: str) -> CallHandler:
    return lambda e, n, b, what: e.emit(n.name, op, [e.ref(b["input"], what)])


def _c_gelu(e: _Exporter, n: fx.Node, b: Bound, what: str) -> Ref:
    return e.emit(n.name, "gelu", [e.ref(b["input"], what)], approximate=e.const(b["approximate"], what))


def _c_softmax(op: str) -> CallHandler:
    def handler(e: _Exporter, n: fx.Node, b: Bound, what: str) -> Ref:
        dim = e.const(b["dim"], what)
        if dim is None or b["dtype"] is not None:
            raise e.fail(what, "needs an explicit dim and no dtype")
        return e.emit(n.name, op, [e.ref(b["input"], what)], dim=dim)

    return handler


def _c_dropout(e: _Exporter, n: fx.Node, b: Bound, what: str) -> Ref:
    return e.emit(n.name, "dropout", [e.ref(b["input"], what)], p=float(e.const(b["p"], what)))


def _c_flatten(start_default: int) -> CallHandler:
    def handler(e: _Exporter, n: fx.Node, b: Bound, what: str) -> Ref:
        # torch.flatten/Tensor.flatten default to start_dim 0; the graph op defaults to 1.
        start = e.const(b["start_dim"], what)
        return e.emit(
            n.name,
            "flatten",
            [e.ref(b["input"], what)],
            start_dim=start_default if start is None else start,
            end_dim=e.const(b["end_dim"], what),
        )

    return handler


def _c_reshape(e: _Exporter, n: fx.Node, b: Bound, what: str) -> Ref:
    return e.emit(n.name, "reshape", [e.ref(b["input"], what)], shape=e.batch_shape(n, what))


def _c_permute(e: _Exporter, n: fx.Node, b: Bound, what: str) -> Ref:
    sizes = e.const(b["sizes"], what)
    dims = list(sizes[0]) if len(sizes) == 1 and isinstance(sizes[0], (list, tuple)) else list(sizes)
    return e.emit(n.name, "permute", [e.ref(b["input"], what)], dims=dims)


def _c_transpose(e: _Exporter, n: fx.Node, b: Bound, what: str) -> Ref:
    return e.emit(
        n.name,
        "transpose",
        [e.ref(b["input"], what)],
        dim0=e.const(b["dim0"], what),
        dim1=e.const(b["dim1"], what),
    )


def _c_identity(e: _Exporter, n: fx.Node, b: Bound, what: str) -> Ref:
    return e.ref(b["input"], what)


def _is_tensor_arg(e: _Exporter, arg: Any) -> bool:
    return isinstance(arg, fx.Node) and isinstance(e.env.get(arg), str)


def _c_arith(op: str) -> CallHandler:
    def handler(e: _Exporter, n: fx.Node, b: Bound, what: str) -> Ref:
        if e.const(b.get("alpha", 1), what) != 1 or b.get("rounding_mode") is not None:
            raise e.fail(what, "alpha/rounding_mode are not supported")
        a, c = b["input"], b["other"]
        if _is_tensor_arg(e, a) and _is_tensor_arg(e, c):
            return e.emit(n.name, op, [e.ref(a, what), e.ref(c, what)])
        return _scalar_arith(e, n, op, a, c, what)

    return handler


def _scalar_arith(e: _Exporter, n: fx.Node, op: str, a: Any, c: Any, what: str) -> Ref:
    tensor, scalar = (a, c) if _is_tensor_arg(e, a) else (c, a)
    factor = e.const(scalar, what)
    if not isinstance(factor, (int, float)) or isinstance(factor, bool):
        raise e.fail(what, "tensor operands must come from the traced graph")
    if op == "mul" or op == "div" and tensor is a:
        # Division by a constant becomes a scale by its reciprocal (rounds within 1 ulp).
        return e.emit(
            n.name,
            "scale",
            [e.ref(tensor, what)],
            factor=float(factor) if op == "mul" else 1.0 / float(factor),
        )
    raise e.fail(what, f"{op} with a Python scalar is not supported")


def _c_matmul(e: _Exporter, n: fx.Node, b: Bound, what: str) -> Ref:
    return e.emit(n.name, "matmul", [e.ref(b["input"], what), e.ref(b["other"], what)])


def _c_cat(e: _Exporter, n: fx.Node, b: Bound, what: str) -> Ref:
    parts = [e.ref(t, what) for t in b["tensors"]]
    return e.emit(n.name, "concat", parts, dim=e.const(b["dim"], what))


def _c_linear(e: _Exporter, n: fx.Node, b: Bound, what: str) -> Ref:
    bias = None if b["bias"] is None else e.ref(b["bias"], what)
    return e.emit(n.name, "linear", [e.ref(b["input"], what), e.ref(b["weight"], what), bias])


def _c_sdpa(e: _Exporter, n: fx.Node, b: Bound, what: str) -> Ref:
    if (
        b["attn_mask"] is not None
        or e.const(b["dropout_p"], what) != 0.0
        or b["scale"] is not None
        or b["enable_gqa"]
    ):
        raise e.fail(what, "attn_mask, dropout_p, scale and enable_gqa are not supported")
    qkv = [e.ref(b[k], what) for k in ("query", "key", "value")]
    return e.emit(
        n.name, "scaled_dot_product_attention", list(qkv), is_causal=bool(e.const(b["is_causal"], what))
    )


def _c_split(e: _Exporter, n: fx.Node, b: Bound, what: str) -> tuple[Ref, ...]:
    """split/chunk: one graph `split` slice per piece, read back by getitem."""
    x = e.ref(b["input"], what)
    dim = e.const(b["dim"], what)
    pieces = e.runs[0][n]
    if dim == 0 or dim == -len(pieces[0].shape):
        raise e.fail(what, "cannot split along the batch dimension")
    refs, start = [], 0
    for i, piece in enumerate(pieces):
        length = piece.shape[dim]
        refs.append(e.emit(f"{n.name}.{i}", "split", [x], dim=dim, start=start, length=length))
        start += length
    return tuple(refs)


def _c_getitem(e: _Exporter, n: fx.Node, b: Bound, what: str) -> Ref:
    container = e.env.get(b["input"]) if isinstance(b["input"], fx.Node) else None
    if not isinstance(container, tuple):
        raise e.fail(what, "tensor indexing/slicing is not supported")
    return str(container[e.const(b["other"], what)])


def _opt_ref(e: _Exporter, arg: Any, what: str) -> Ref | None:
    return None if arg is None else e.ref(arg, what)


def _c_neg(e: _Exporter, n: fx.Node, b: Bound, what: str) -> Ref:
    return e.emit(n.name, "scale", [e.ref(b["input"], what)], factor=-1.0)


def _c_conv2d(e: _Exporter, n: fx.Node, b: Bound, what: str) -> Ref:
    padding = e.const(b["padding"], what)
    if isinstance(padding, str):
        raise e.fail(what, "only explicit zero padding is supported")
    inputs = [e.ref(b["input"], what), e.ref(b["weight"], what), _opt_ref(e, b["bias"], what)]
    return e.emit(
        n.name,
        "conv2d",
        inputs,
        stride=_pair(e.const(b["stride"], what)),
        padding=_pair(padding),
        dilation=_pair(e.const(b["dilation"], what)),
        groups=e.const(b["groups"], what),
    )


def _c_pool(op: str) -> CallHandler:
    def handler(e: _Exporter, n: fx.Node, b: Bound, what: str) -> Ref:
        odd = {
            k: e.const(b[k], what)
            for k in ("dilation", "ceil_mode", "return_indices", "count_include_pad", "divisor_override")
            if k in b
        }
        if "dilation" in odd and _pair(odd["dilation"]) == [1, 1]:
            odd["dilation"] = 1
        if odd not in (
            {"dilation": 1, "ceil_mode": False, "return_indices": False},
            {"ceil_mode": False, "count_include_pad": True, "divisor_override": None},
        ):
            raise e.fail(what, "ceil_mode/dilation/return_indices/divisor are not supported")
        kernel = _pair(e.const(b["kernel_size"], what))
        stride = e.const(b["stride"], what)
        return e.emit(
            n.name,
            op,
            [e.ref(b["input"], what)],
            kernel_size=kernel,
            stride=kernel if stride is None or stride == [] else _pair(stride),
            padding=_pair(e.const(b["padding"], what)),
        )

    return handler


def _c_adaptive(e: _Exporter, n: fx.Node, b: Bound, what: str) -> Ref:
    size = e.const(b["output_size"], what)
    if size is None or not isinstance(size, int) and None in size:
        raise e.fail(what, "output_size with None is not supported")
    return e.emit(n.name, "adaptive_avg_pool2d", [e.ref(b["input"], what)], output_size=_pair(size))


def _c_layer_norm(e: _Exporter, n: fx.Node, b: Bound, what: str) -> Ref:
    shape = e.const(b["normalized_shape"], what)
    inputs = [e.ref(b["input"], what), _opt_ref(e, b["weight"], what), _opt_ref(e, b["bias"], what)]
    return e.emit(
        n.name,
        "layer_norm",
        inputs,
        eps=float(e.const(b["eps"], what)),
        normalized_shape=[shape] if isinstance(shape, int) else list(shape),
    )


def _c_embedding(e: _Exporter, n: fx.Node, b: Bound, what: str) -> Ref:
    if b["max_norm"] is not None:
        raise e.fail(what, "max_norm is not supported")
    return e.emit(n.name, "embedding", [e.ref(b["input"], what), e.ref(b["weight"], what)])


def _method(*names: str) -> list[tuple[str, str]]:
    return [("method", name) for name in names]


def _entries(
    keys: Iterable[Any], signature: Callable[..., Any], handler: CallHandler
) -> dict[Any, tuple[Callable[..., Any], CallHandler]]:
    return {key: (signature, handler) for key in keys}


_CALLS: dict[Any, tuple[Callable[..., Any], CallHandler]] = {
    **_entries([F.relu, torch.relu, *_method("relu")], _s_x, _c_unary("relu")),
    **_entries([torch.tanh, F.tanh, *_method("tanh")], _s_x, _c_unary("tanh")),
    **_entries([torch.sigmoid, F.sigmoid, *_method("sigmoid")], _s_x, _c_unary("sigmoid")),
    **_entries([F.gelu], _s_gelu, _c_gelu),
    **_entries([F.softmax, torch.softmax, *_method("softmax")], _s_softmax, _c_softmax("softmax")),
    **_entries(
        [F.log_softmax, torch.log_softmax, *_method("log_softmax")], _s_softmax, _c_softmax("log_softmax")
    ),
    **_entries([F.dropout], _s_dropout, _c_dropout),
    **_entries([torch.flatten, *_method("flatten")], _s_flatten, _c_flatten(0)),
    **_entries([torch.reshape, *_method("view", "reshape")], _s_var, _c_reshape),
    **_entries([torch.squeeze, torch.unsqueeze, *_method("squeeze", "unsqueeze")], _s_squeeze, _c_reshape),
    **_entries([operator.neg, torch.neg, *_method("neg")], _s_x, _c_neg),
    **_entries([F.conv2d], _s_conv2d, _c_conv2d),
    **_entries([F.max_pool2d], _s_max_pool2d, _c_pool("max_pool2d")),
    **_entries([F.avg_pool2d], _s_avg_pool2d, _c_pool("avg_pool2d")),
    **_entries([F.adaptive_avg_pool2d], _s_adaptive, _c_adaptive),
    **_entries([F.layer_norm], _s_layer_norm, _c_layer_norm),
    **_entries([F.embedding], _s_embedding, _c_embedding),
    **_entries([torch.permute, *_method("permute")], _s_var, _c_permute),
    **_entries([torch.transpose, *_method("transpose")], _s_transpose, _c_transpose),
    **_entries(_method("contiguous"), _s_contiguous, _c_identity),
    **_entries([operator.add, torch.add, *_method("add")], _s_addsub, _c_arith("add")),
    **_entries([operator.sub, torch.sub, *_method("sub")], _s_addsub, _c_arith("sub")),
    **_entries([operator.mul, torch.mul, *_method("mul")], _s_ab, _c_arith("mul")),
    **_entries([operator.truediv, torch.div, *_method("div")], _s_div, _c_arith("div")),
    **_entries([operator.matmul, torch.matmul, torch.bmm, *_method("matmul", "bmm")], _s_ab, _c_matmul),
    **_entries([torch.cat, torch.concat], _s_cat, _c_cat),
    **_entries([F.linear], _s_linear, _c_linear),
    **_entries([F.scaled_dot_product_attention], _s_sdpa, _c_sdpa),
    **_entries([torch.split, *_method("split")], _s_split, _c_split),
    **_entries([torch.chunk, *_method("chunk")], _s_chunk, _c_split),
    **_entries([operator.getitem], _s_ab, _c_getitem),
}


# ---------------------------------------------------------------- entry point


def _spec(name: str, shape: list[int], dtype: str = "float32") -> dict[str, Any]:
    return {"name": name, "shape": shape, "dtype": dtype}


def export_module(
    module: nn.Module,
    input_shape: tuple[int, ...],
    input_dtype: str = "float32",
    loss: str = "cross_entropy",
    name: str = "model",
) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """Trace ``module`` into a validated graph dict and its weights (params + buffers by name).

    ``input_shape`` excludes the batch dimension. The graph's input is "x" and its target "y".
    """
    exporter = _Exporter(module, input_shape, input_dtype)
    exporter.trace()
    exporter.convert()
    output_node = next(n for n in exporter.gm.graph.nodes if n.op == "output")
    output = exporter.env[output_node]
    out_shape = exporter.batch_shape(output_node.args[0], "output")
    target = _spec("y", out_shape) if loss == "mse" else _spec("y", out_shape[:-1], "int64")
    param_names = {n for n, _ in module.named_parameters()}
    used = exporter.used
    graph = {
        "format": FORMAT,
        "version": VERSION,
        "name": name,
        "inputs": [_spec("x", [-1, *input_shape], input_dtype)],
        "targets": [target],
        "params": [_spec(n, list(t.shape)) for n, t in used.items() if n in param_names],
        "buffers": [_spec(n, list(t.shape)) for n, t in used.items() if n not in param_names],
        "nodes": exporter.nodes,
        "output": output,
        "loss": {"op": loss, "inputs": [output, "y"], "attrs": {}},
    }
    graph = load_graph(graph).to_dict()  # validates and fills in default attrs
    weights = {n: t.detach().clone().float().contiguous() for n, t in used.items()}
    return graph, weights
