"""Export: every preset and a zoo of functional styles must run identically in the runtime."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.export import ExportError, export_module
from engine.graph import load_graph
from engine.presets import PRESETS
from engine.runtime import GraphModule
from tests.engine.conftest import exported, preset_batch, preset_module, reference_loss


def _runtime(graph: dict[str, object], weights: dict[str, Tensor]) -> GraphModule:
    module = GraphModule(load_graph(graph))
    module.load_state(weights)
    return module


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_forward_loss_and_gradients_match(name: str) -> None:
    graph, weights = exported(name)
    ref, ours = preset_module(name), _runtime(graph, weights)
    assert weights.keys() == {s["name"] for s in graph["params"] + graph["buffers"]}
    # Dropout draws different masks in the two models, so models with dropout compare in eval mode.
    train = not any(isinstance(m, nn.Dropout) for m in ref.modules())
    ref.train(train)
    ours.train(train)
    x, y = preset_batch(name, batch=2)
    out_ref = ref(x)
    loss_ref = reference_loss(out_ref, y)
    loss_ref.backward()
    out = ours({"x": x})
    loss = ours.loss(out, {"y": y})
    loss.backward()
    torch.testing.assert_close(out, out_ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(loss, loss_ref, atol=1e-5, rtol=0)
    grads = ours.grads()
    for pname, p in ref.named_parameters():
        assert p.grad is not None
        torch.testing.assert_close(grads[pname], p.grad, atol=1e-5, rtol=0, msg=pname)
    state = ours.state()
    for bname, b in ref.named_buffers():
        if b.is_floating_point():
            torch.testing.assert_close(state[bname], b, atol=1e-5, rtol=0, msg=bname)


class _Zoo(nn.Module):
    """Functional styles the exporter must understand."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.pool = nn.AvgPool2d(2)
        self.ln = nn.LayerNorm(8, elementwise_affine=False)
        self.fc = nn.Linear(8, 6)
        self.scale = nn.Parameter(torch.randn(9))
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(16 * 14, 5), nn.Tanh(), nn.Identity())

    def forward(self, x: Tensor) -> Tensor:
        h = self.pool(torch.relu(self.bn(self.conv(x))))  # [B, 8, 4, 4]
        h = h.view(x.size(0), 8, -1).permute(0, 2, 1).contiguous()  # [B, 16, 8]
        h = self.ln(h)
        a, b = self.fc(h).chunk(2, dim=-1)  # [B, 16, 3] twice
        left, _ = torch.split(h, [5, 3], dim=2)
        g = torch.cat([a * b, torch.sigmoid(a) - b / 4, F.gelu(b, approximate="tanh")], dim=-1)
        g = g * self.scale + F.softmax(g, dim=-1) * 0.5  # [B, 16, 9]
        att = torch.matmul(g, g.transpose(-2, -1)) / 3.0  # [B, 16, 16]
        mix = F.log_softmax(att, dim=-1) @ g  # [B, 16, 9]
        out: Tensor = self.head(torch.cat([mix, left], dim=2))
        return out


def test_functional_zoo_matches_module() -> None:
    torch.manual_seed(0)
    module = _Zoo()
    graph, weights = export_module(module, (3, 8, 8), name="zoo")
    ours = _runtime(graph, weights)
    x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 5, (4,))
    module.train()
    out_ref = module(x)
    F.cross_entropy(out_ref, y).backward()
    out = ours({"x": x})
    ours.loss(out, {"y": y}).backward()
    torch.testing.assert_close(out, out_ref, atol=1e-5, rtol=1e-5)
    grads = ours.grads()
    for name, p in module.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, atol=1e-5, rtol=1e-4, msg=name)
    ops = {n["op"] for n in graph["nodes"]}
    assert {
        "reshape",
        "permute",
        "split",
        "concat",
        "scale",
        "matmul",
        "sub",
        "mul",
        "softmax",
        "log_softmax",
        "gelu",
        "sigmoid",
        "tanh",
        "layer_norm",
        "avg_pool2d",
    } <= ops


class _Functional(nn.Module):
    """The torch.nn.functional spellings of the layer ops, plus squeeze/unsqueeze/neg."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 1, 3, 3) * 0.3)
        self.b = nn.Parameter(torch.randn(4))
        self.ln_w = nn.Parameter(torch.randn(4))

    def forward(self, x: Tensor) -> Tensor:
        h = F.conv2d(x, self.w, self.b, stride=1, padding=(1, 1), groups=2)  # [B, 4, 8, 8]
        h = F.max_pool2d(h, 2) + F.avg_pool2d(h, kernel_size=3, stride=2, padding=1)  # [B, 4, 4, 4]
        h = F.adaptive_avg_pool2d(-h, (2, 2)).flatten(2).transpose(1, 2)  # [B, 4, 4]
        h = F.layer_norm(h, (4,), self.ln_w, None, 1e-3)
        return h.unsqueeze(1).squeeze(1).flatten(1)


def test_functional_spellings_match_module() -> None:
    torch.manual_seed(0)
    module = _Functional()
    graph, weights = export_module(module, (2, 8, 8), loss="mse")
    ours = _runtime(graph, weights)
    x = torch.randn(3, 2, 8, 8)
    torch.testing.assert_close(ours({"x": x}), module(x), atol=1e-5, rtol=1e-5)
    assert graph["targets"] == [{"name": "y", "shape": [-1, 16], "dtype": "float32"}]


def test_embedding_functional_and_int_inputs() -> None:
    class Emb(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = nn.Parameter(torch.randn(11, 3))

        def forward(self, ids: Tensor) -> Tensor:
            return F.embedding(ids, self.table).flatten(1)

    module = Emb()
    graph, weights = export_module(module, (5,), input_dtype="int64")
    ids = torch.randint(0, 11, (2, 5))
    torch.testing.assert_close(_runtime(graph, weights)({"x": ids.to(torch.int32)}), module(ids))


class _Mix(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return torch.fft.fft(x).real


class _Wrapper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mix = _Mix()

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.mix(x)
        return out


class _Blocky(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.block = nn.Sequential(inner)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.block(x)
        return out


def test_unsupported_function_names_op_and_module_path() -> None:
    with pytest.raises(ExportError, match=r"unsupported operation torch\.fft\.fft at 'block\.0\.mix'"):
        export_module(_Blocky(_Wrapper()), (4,))


def test_unsupported_module_names_its_path() -> None:
    with pytest.raises(ExportError, match=r"GRU.* at 'block\.0'"):
        export_module(_Blocky(nn.GRU(4, 4)), (4,))


class _AddConst(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x + 1.0


def test_scalar_addition_is_rejected() -> None:
    with pytest.raises(ExportError, match="add with a Python scalar"):
        export_module(_AddConst(), (4,))


class _Branchy(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x if x.sum() > 0 else -x


def test_data_dependent_control_flow_is_an_export_error() -> None:
    with pytest.raises(ExportError, match="cannot trace"):
        export_module(_Branchy(), (4,))
