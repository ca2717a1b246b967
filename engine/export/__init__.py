"""Export a torch.nn.Module to a graph (docs/graph-format.md, "The exporter") via torch.fx.

Every argument and attribute of a captured call is either represented in the graph (and honoured by both
interpreters) or the export fails with an ExportError naming it: nothing is silently dropped.
tests/engine/test_export_rule.py holds every handler below to that.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from engine.graph import FORMAT, VERSION, GraphError, load_graph

from .attention import encoder_layer_module, encoder_module, mha_module
from .calls import CALLS
from .core import CallEntry, Exporter, ExportError, Handlers, ModuleHandler, Ref
from .losses import LOSS_MODULES, LOSS_WEIGHT, LossSpec, loss_spec
from .modules import MODULES
from .rnn import rnn_module

__all__ = ["CALL_HANDLERS", "LOSS_MODULES", "MODULE_HANDLERS", "ExportError", "export_module"]

MODULE_HANDLERS: dict[type, ModuleHandler] = {
    **MODULES,
    nn.MultiheadAttention: mha_module,
    nn.TransformerEncoderLayer: encoder_layer_module,
    nn.TransformerEncoder: encoder_module,
    nn.LSTM: rnn_module,
    nn.GRU: rnn_module,
    nn.RNN: rnn_module,
}
CALL_HANDLERS: dict[Any, CallEntry] = dict(CALLS)


def _spec(name: str, shape: list[int], dtype: str = "float32") -> dict[str, Any]:
    return {"name": name, "shape": shape, "dtype": dtype}


def export_module(
    module: nn.Module,
    input_shape: tuple[int, ...],
    input_dtype: str = "float32",
    loss: str | nn.Module = "cross_entropy",
    name: str = "model",
) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """Trace ``module`` into a validated graph dict and its weights (params + buffers by name).

    ``input_shape`` excludes the batch dimension. The graph's input is "x" and its target "y". ``loss`` is a
    graph loss name or a loss module (nn.CrossEntropyLoss with its weight / ignore_index / label_smoothing,
    nn.MSELoss, nn.L1Loss).
    """
    spec = loss_spec(loss)
    exporter = Exporter(module, input_shape, input_dtype, Handlers(MODULE_HANDLERS, CALL_HANDLERS))
    exporter.trace()
    exporter.convert()
    graph, weights = _assemble(exporter, spec, name)
    try:
        graph = load_graph(graph).to_dict()  # validates and fills in default attrs
    except GraphError as exc:
        raise ExportError(f"the exported graph is not valid: {exc}") from None
    return graph, weights


def _output(e: Exporter) -> tuple[Ref, list[int]]:
    """The output's graph name and shape (batch as -1); it must have one row per sample."""
    node = next(n for n in e.gm.graph.nodes if n.op == "output")
    output, shape = e.env[node], e.batch_shape(node.args[0], "output")
    if [run[node.args[0]].shape[:1] for run in e.runs] != [(2,), (3,)]:
        raise ExportError(
            f"the module's output (shape {shape} with the batch as -1) must have one row per sample first"
        )
    if output not in e.names:  # the output is the input or a weight: the graph needs a node to name it
        output = e.emit("output:identity", "reshape", [output], shape=shape)
    return output, shape


def _assemble(e: Exporter, spec: LossSpec, name: str) -> tuple[dict[str, Any], dict[str, Tensor]]:
    output, shape = _output(e)
    target = _spec("y", shape[:-1], "int64") if spec.op == "cross_entropy" else _spec("y", shape)
    used = dict(e.used) if spec.weight is None else {**e.used, LOSS_WEIGHT: spec.weight}
    graph = {
        "format": FORMAT,
        "version": VERSION,
        "name": name,
        "inputs": [_spec("x", [-1, *e.input_shape], e.input_dtype)],
        "targets": [target],
        "params": [_spec(n, list(t.shape)) for n, t in used.items() if n in e.params],
        "buffers": [_spec(n, list(t.shape)) for n, t in used.items() if n not in e.params],
        "nodes": e.nodes,
        "output": output,
        "loss": {"op": spec.op, "inputs": [output, "y", *_weight_input(spec)], "attrs": spec.attrs},
    }
    return graph, {n: t.detach().clone().float().contiguous() for n, t in used.items()}


def _weight_input(spec: LossSpec) -> list[str]:
    return [] if spec.weight is None else [LOSS_WEIGHT]
