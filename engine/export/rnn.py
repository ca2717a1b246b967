"""nn.LSTM / nn.GRU / nn.RNN unrolled over the sequence length of the example input.

Each step applies torch's cell equations (ATen's LSTMCell/GRUCell/RNN cells) with the same operations in
the same order, so the unrolled graph computes what torch computes. The input projection of every step is
one linear over the whole sequence, as torch's CPU kernels do. A zero initial state is folded away: at the
first step the hidden projection is just its bias.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.fx as fx
from torch import nn

from . import build
from .core import Bound, Exporter, Ref

GATES = {"LSTM": 4, "GRU": 3, "RNN_TANH": 1, "RNN_RELU": 1}


@dataclass(frozen=True)
class Cell:
    w_ih: Ref
    w_hh: Ref
    b_ih: Ref | None
    b_hh: Ref | None
    hidden: int
    time_dim: int  # 1 for batch_first [N, T, *], else 0 ([T, N, *])


@dataclass(frozen=True)
class State:
    h: Ref | None = None
    c: Ref | None = None


def rnn_module(e: Exporter, n: fx.Node, m: nn.RNNBase, b: Bound, what: str) -> tuple[Any, Any]:
    """(output, h_n) or, for LSTM, (output, (h_n, c_n)); getitem on them picks what the model uses."""
    if b["hx"] is not None:
        raise e.refuse(what, "hx", "a tensor", "only the zero initial state")
    if getattr(m, "proj_size", 0):
        raise e.refuse(what, "proj_size", m.proj_size)
    x_node = b["input"]
    time_dim = _time_dim(e, m, x_node, what)
    x, finals = e.ref(x_node, what), []
    for layer in range(m.num_layers):
        x, states = _layer(e, f"{n.name}:l{layer}", m, layer, x, (time_dim, e.shape(x_node)[time_dim]), what)
        finals += states
        if layer < m.num_layers - 1:  # torch drops out between layers, never after the last
            x = build.dropout(e, f"{n.name}:l{layer}:dropout", "dropout", x, m.dropout)
    h_n = _stack(e, f"{n.name}:h_n", [s.h for s in finals], time_dim)
    if m.mode != "LSTM":
        return x, h_n
    return x, (h_n, _stack(e, f"{n.name}:c_n", [s.c for s in finals], time_dim))


def _layer(
    e: Exporter, base: str, m: nn.RNNBase, layer: int, x: Ref, time: tuple[int, int], what: str
) -> tuple[Ref, list[State]]:
    """One layer, both directions (their outputs side by side, as torch concatenates them)."""
    outs, states = [], []
    for direction in range(2 if m.bidirectional else 1):
        cell = _cell(e, m, layer, direction, time[0], what)
        seq, state = unroll(e, base + ("r" if direction else ""), m.mode, x, cell, time[1], bool(direction))
        outs.append(seq)
        states.append(state)
    return (outs[0] if len(outs) == 1 else e.emit(f"{base}:both", "concat", outs, dim=2)), states


def _time_dim(e: Exporter, m: nn.RNNBase, x_node: fx.Node, what: str) -> int:
    shape, batch = e.shape(x_node), (0 if m.batch_first else 1)
    if len(shape) != 3 or e.batch_dim(x_node, what) != batch:
        raise e.refuse(
            what,
            "batch_first",
            m.batch_first,
            f"input of shape {shape} does not have its batch at dim {batch}",
        )
    return 1 - batch


def _cell(e: Exporter, m: nn.RNNBase, layer: int, direction: int, time_dim: int, what: str) -> Cell:
    suffix = f"_l{layer}" + ("_reverse" if direction else "")
    refs = [e.tensor_ref(getattr(m, f"{k}{suffix}", None), what) for k in ("weight_ih", "weight_hh")]
    biases = [e.tensor_ref(getattr(m, f"{k}{suffix}", None), what) for k in ("bias_ih", "bias_hh")]
    w_ih, w_hh = refs
    assert w_ih is not None and w_hh is not None
    return Cell(w_ih, w_hh, biases[0], biases[1], m.hidden_size, time_dim)


def unroll(
    e: Exporter, base: str, mode: str, x: Ref, cell: Cell, length: int, reverse: bool
) -> tuple[Ref, State]:
    projected = e.emit(f"{base}:x", "linear", [x, cell.w_ih, cell.b_ih])
    state, outputs = State(), {}
    for t in range(length - 1, -1, -1) if reverse else range(length):
        xt = e.emit(f"{base}:t{t}:x", "split", [projected], dim=cell.time_dim, start=t, length=1)
        state = STEPS[mode](e, f"{base}:t{t}", xt, state, cell)
        assert state.h is not None
        outputs[t] = state.h
    seq = e.emit(f"{base}:out", "concat", [outputs[t] for t in range(length)], dim=cell.time_dim)
    return seq, state


def _hidden(e: Exporter, base: str, h: Ref | None, cell: Cell) -> tuple[Ref | None, int]:
    """W_hh h + b_hh and the dim its gates lie along (a zero state leaves just the bias, 1-D)."""
    if h is None:
        return cell.b_hh, 0
    return e.emit(f"{base}:h", "linear", [h, cell.w_hh, cell.b_hh]), 2


def _gate(e: Exporter, name: str, x: Ref, dim: int, index: int, size: int) -> Ref:
    return e.emit(name, "split", [x], dim=dim, start=index * size, length=size)


def _lstm_step(e: Exporter, base: str, xt: Ref, state: State, cell: Cell) -> State:
    size = cell.hidden
    hh, _ = _hidden(e, base, state.h, cell)
    gates = xt if hh is None else e.emit(f"{base}:gates", "add", [hh, xt])
    act = e.emit(f"{base}:sigmoid", "sigmoid", [gates])
    i, o = _gate(e, f"{base}:i", act, 2, 0, size), _gate(e, f"{base}:o", act, 2, 3, size)
    g = e.emit(f"{base}:g", "tanh", [_gate(e, f"{base}:g_in", gates, 2, 2, size)])
    ig = e.emit(f"{base}:ig", "mul", [i, g])
    if state.c is None:
        c = ig  # f * 0 + i * g
    else:
        fc = e.emit(f"{base}:fc", "mul", [_gate(e, f"{base}:f", act, 2, 1, size), state.c])
        c = e.emit(f"{base}:c", "add", [fc, ig])
    h = e.emit(f"{base}:out", "mul", [o, e.emit(f"{base}:tanh_c", "tanh", [c])])
    return State(h, c)


def _gru_step(e: Exporter, base: str, xt: Ref, state: State, cell: Cell) -> State:
    size = cell.hidden
    hh, dim = _hidden(e, base, state.h, cell)
    x_rz, x_n = _gate2(e, f"{base}:x_rz", xt, 2, size), _gate(e, f"{base}:x_n", xt, 2, 2, size)
    if hh is None:
        rz, n_in = e.emit(f"{base}:rz", "sigmoid", [x_rz]), x_n
    else:
        h_rz = _gate2(e, f"{base}:h_rz", hh, dim, size)
        rz = e.emit(f"{base}:rz", "sigmoid", [e.emit(f"{base}:rz_in", "add", [h_rz, x_rz])])
        r = _gate(e, f"{base}:r", rz, 2, 0, size)
        h_n = e.emit(f"{base}:rh", "mul", [_gate(e, f"{base}:h_n", hh, dim, 2, size), r])
        n_in = e.emit(f"{base}:n_in", "add", [x_n, h_n])
    new = e.emit(f"{base}:n", "tanh", [n_in])
    z = _gate(e, f"{base}:z", rz, 2, 1, size)
    if state.h is None:  # (0 - n) * z + n
        return State(e.emit(f"{base}:out", "sub", [new, e.emit(f"{base}:zn", "mul", [z, new])]))
    diff = e.emit(f"{base}:diff", "sub", [state.h, new])
    return State(e.emit(f"{base}:out", "add", [e.emit(f"{base}:zd", "mul", [diff, z]), new]))


def _gate2(e: Exporter, name: str, x: Ref, dim: int, size: int) -> Ref:
    return e.emit(name, "split", [x], dim=dim, start=0, length=2 * size)


def _rnn_step(op: str) -> Any:
    def step(e: Exporter, base: str, xt: Ref, state: State, cell: Cell) -> State:
        hh, _ = _hidden(e, base, state.h, cell)
        pre = xt if hh is None else e.emit(f"{base}:pre", "add", [hh, xt])
        return State(e.emit(f"{base}:out", op, [pre]))

    return step


STEPS = {"LSTM": _lstm_step, "GRU": _gru_step, "RNN_TANH": _rnn_step("tanh"), "RNN_RELU": _rnn_step("relu")}


def _stack(e: Exporter, name: str, finals: list[Ref | None], time_dim: int) -> Ref:
    """Final states [N,1,H] (batch_first) or [1,N,H] of every layer and direction -> [layers*dirs, N, H]."""
    parts = [f for f in finals if f is not None]
    stacked = parts[0] if len(parts) == 1 else e.emit(f"{name}:cat", "concat", parts, dim=time_dim)
    if time_dim == 0:
        return stacked
    return e.emit(name, "transpose", [stacked], dim0=0, dim1=1)
