"""Export: every preset and a zoo of functional styles must run identically in the runtime."""

from __future__ import annotations

from typing import Any

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
    with pytest.raises(ExportError, match=r"PReLU.* at 'block\.0'"):
        export_module(_Blocky(nn.PReLU()), (4,))


class _Scalars(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return (x + 1.0) * (1.0 - x) - 2 + x / 4 + 3 * x


def test_arithmetic_with_python_numbers_matches() -> None:
    graph, weights = export_module(_Scalars(), (4,), loss="mse")
    x = torch.randn(3, 4)
    torch.testing.assert_close(_runtime(graph, weights)({"x": x}), _Scalars()(x), atol=1e-6, rtol=1e-6)
    assert {n["op"] for n in graph["nodes"]} == {"add_scalar", "scale", "mul", "add"}


class _Reciprocal(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return 2.0 / x


def test_a_number_divided_by_a_tensor_is_refused() -> None:
    with pytest.raises(ExportError, match="dividing a Python number by a tensor"):
        export_module(_Reciprocal(), (4,), loss="mse")


class _Branchy(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x if x.sum() > 0 else -x


def test_data_dependent_control_flow_is_an_export_error() -> None:
    with pytest.raises(ExportError, match="cannot trace"):
        export_module(_Branchy(), (4,))


# ---------------------------------------------------------------- issue 11: exported, trained differently


class _Tokens(nn.Module):
    def __init__(self, **embedding: Any) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 3, **embedding)

    def forward(self, ids: Tensor) -> Tensor:
        return self.emb(ids).flatten(1)


def test_embedding_padding_idx_is_exported_and_its_row_never_trained() -> None:
    torch.manual_seed(0)
    module = _Tokens(padding_idx=-2)
    graph, weights = export_module(module, (5,), input_dtype="int64", loss="mse")
    assert graph["nodes"][0]["attrs"] == {"padding_idx": 8}  # normalised as torch does
    ours = _runtime(graph, weights)
    ids = torch.tensor([[8, 1, 8, 2, 3], [8, 8, 4, 5, 6]])
    ours.loss(ours({"x": ids}), {"y": torch.randn(2, 15)}).backward()
    grad = ours.grads()["emb.weight"]
    assert not grad[8].any() and grad[1].any()


@pytest.mark.parametrize("arg", ["scale_grad_by_freq", "sparse", "max_norm"])
def test_embedding_options_the_graph_cannot_honour_are_refused(arg: str) -> None:
    value = 1.0 if arg == "max_norm" else True
    with pytest.raises(ExportError, match=rf"argument {arg}=.* at 'emb'"):
        export_module(_Tokens(**{arg: value}), (5,), input_dtype="int64", loss="mse")


class _FunctionalDropout(nn.Module):
    def __init__(self, training: bool | None) -> None:
        super().__init__()
        self.fixed = training

    def forward(self, x: Tensor) -> Tensor:
        training = self.training if self.fixed is None else self.fixed
        return F.dropout(x, 0.5, training=training, inplace=False) * 2.0


@pytest.mark.parametrize(
    ("training", "exported_in_eval", "dropout_nodes"), [(False, False, 0), (True, False, 1), (None, True, 1)]
)
def test_functional_dropout_follows_its_training_argument(
    training: bool | None, exported_in_eval: bool, dropout_nodes: int
) -> None:
    """training=False is the identity; True (or self.training, whatever mode the module is exported in) is
    dropout that the interpreter applies while it trains."""
    module = _FunctionalDropout(training)
    module.train(not exported_in_eval)
    graph, _ = export_module(module, (4,), loss="mse")
    assert [n["op"] for n in graph["nodes"]].count("dropout") == dropout_nodes
    assert module.training is not exported_in_eval  # the caller's mode is restored


class _ModeDependent(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x * 2.0 if self.training else x


def test_forward_reading_self_training_is_refused() -> None:
    with pytest.raises(ExportError, match="reads self.training"):
        export_module(_ModeDependent(), (4,), loss="mse")


class _InplaceReused(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        h = x * 2.0
        view = h.view(-1, 2, 2)
        y = F.relu(h, inplace=True)
        return y + view.flatten(1)


def test_inplace_on_a_tensor_read_afterwards_is_refused() -> None:
    with pytest.raises(ExportError, match=r"argument inplace=True of torch\.nn\.functional\.relu"):
        export_module(_InplaceReused(), (4,), loss="mse")


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x: Tensor) -> Tensor:
        out, weights = self.attn(x, x, x)
        return out.mean(-1) + weights.mean(-1)


def test_used_attention_weights_are_refused() -> None:
    with pytest.raises(ExportError, match=r"need_weights=True of .*MultiheadAttention at 'attn'"):
        export_module(_Attention(), (5, 8), loss="mse")


def test_causal_attention_dropout_is_refused() -> None:
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.1, batch_first=True)
    mask = nn.Transformer.generate_square_subsequent_mask(5)

    class Causal(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = layer

        def forward(self, x: Tensor) -> Tensor:
            return self.layer(x, src_mask=mask, is_causal=True)

    with pytest.raises(ExportError, match="argument dropout=0.1 .* attention dropout with a causal mask"):
        export_module(Causal(), (5, 8), loss="mse")


# ---------------------------------------------------------------- losses


class _Logits(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(x)


def test_cross_entropy_module_becomes_the_graph_loss() -> None:
    torch.manual_seed(0)
    weight = torch.tensor([0.5, 1.0, 2.0, 1.5])
    criterion = nn.CrossEntropyLoss(weight=weight, label_smoothing=0.1, ignore_index=2)
    module = _Logits()
    graph, weights = export_module(module, (6,), loss=criterion)
    assert graph["loss"] == {
        "op": "cross_entropy",
        "inputs": [graph["output"], "y", "loss:weight"],
        "attrs": {"label_smoothing": 0.1, "ignore_index": 2},
    }
    assert {"name": "loss:weight", "shape": [4], "dtype": "float32"} in graph["buffers"]
    torch.testing.assert_close(weights["loss:weight"], weight)
    x, y = torch.randn(8, 6), torch.tensor([0, 1, 2, 3, 2, 1, 0, 3])
    ours = _runtime(graph, weights)
    torch.testing.assert_close(ours.loss(ours({"x": x}), {"y": y}), criterion(module(x), y))


@pytest.mark.parametrize(
    ("loss", "message"),
    [
        (nn.CrossEntropyLoss(reduction="sum"), "reduction='sum'"),
        (nn.MSELoss(size_average=False), "reduction='sum'.*size_average"),
        (nn.NLLLoss(), "unsupported loss module NLLLoss"),
        ("hinge", "unknown loss 'hinge'"),
    ],
)
def test_losses_the_graph_cannot_compute_are_refused(loss: Any, message: str) -> None:
    with pytest.raises(ExportError, match=message):
        export_module(_Logits(), (6,), loss=loss)


def test_l1_loss_module() -> None:
    graph, _ = export_module(_Logits(), (6,), loss=nn.L1Loss())
    assert graph["loss"]["op"] == "l1" and graph["targets"][0]["shape"] == [-1, 4]


# ---------------------------------------------------------------- capture


class _Frozen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(6)
        self.fc = nn.Linear(6, 4)
        self.fc.weight.requires_grad_(False)
        self.bn.eval()  # a frozen batchnorm inside a training model

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(self.bn(x))


def test_export_changes_neither_buffers_nor_modes_nor_the_random_stream() -> None:
    module = _Frozen()
    assert module.bn.running_mean is not None
    stats = module.bn.running_mean.clone()
    torch.manual_seed(3)
    graph, _ = export_module(module, (6,))
    after = torch.rand(1)
    torch.manual_seed(3)
    assert torch.equal(after, torch.rand(1))
    assert torch.equal(module.bn.running_mean, stats)
    assert module.training and not module.bn.training
    # A frozen parameter is a buffer: the graph never trains it.
    assert "fc.weight" in {b["name"] for b in graph["buffers"]}
    assert "fc.weight" not in {p["name"] for p in graph["params"]}


class _SizeChecks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        batch, length, dim = x.size()
        assert length <= 8, "sequence too long"
        if dim == 4:
            x = self.fc(x)
        return x.mean(1)


def test_control_flow_on_sizes_is_decided_at_export() -> None:
    graph, _ = export_module(_SizeChecks(), (5, 4), loss="mse")
    assert [n["op"] for n in graph["nodes"]] == ["linear", "reduce_mean"]
    with pytest.raises(ExportError, match="cannot trace the module: AssertionError|sequence too long"):
        export_module(_SizeChecks(), (9, 4), loss="mse")


class _BatchBranch(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x if x.size(0) > 2 else -x


def test_control_flow_on_the_batch_size_is_refused() -> None:
    with pytest.raises(ExportError, match="control flow depends on the batch size"):
        export_module(_BatchBranch(), (4,), loss="mse")


class _TimeMajor(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.transpose(0, 1)


def test_output_without_the_batch_first_is_refused() -> None:
    with pytest.raises(ExportError, match="one row per sample first"):
        export_module(_TimeMajor(), (5, 4), loss="mse")


def test_unrolling_past_the_node_limit_is_an_export_error() -> None:
    class Long(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn = nn.LSTM(2, 2, batch_first=True)

        def forward(self, x: Tensor) -> Tensor:
            return self.rnn(x)[0][:, -1]

    with pytest.raises(ExportError, match="too many nodes"):
        export_module(Long(), (200, 2), loss="mse")


def test_timm_drop_path_with_a_rate_is_refused_and_without_one_exports() -> None:
    """timm's DropPath is Python reading self.training (not a leaf like torchvision's stochastic_depth)."""
    from tests.engine.zoo import timm

    with pytest.raises(ExportError, match="self.training"):
        export_module(timm.create_model("convnext_atto", num_classes=3, drop_path_rate=0.1), (3, 32, 32))
    export_module(timm.create_model("convnext_atto", num_classes=3), (3, 32, 32))


class _SizeCheckAfterALayer(nn.Module):
    """MobileViT's pattern: a condition on the size of what a layer returned."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.fc = nn.Conv2d(3, 4, 3), nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        x = self.conv(x)
        if x.shape[-1] % 2:
            x = x * 2.0
        return self.fc(x.mean((2, 3)))


def test_a_size_condition_after_a_layer_runs_the_real_layer() -> None:
    """fx patches nn.Module.__call__ while tracing; deciding the branch must not meet a Proxy."""
    model = _SizeCheckAfterALayer()
    graph, weights = export_module(model, (3, 7, 7), loss="mse")  # 5x5 after the conv: odd, doubled
    assert [n["op"] for n in graph["nodes"]] == ["conv2d", "scale", "reduce_mean", "linear"]
    x = torch.randn(2, 3, 7, 7)
    torch.testing.assert_close(_runtime(graph, weights)({"x": x}), model(x))


class _SpelledOutBatchNorm(nn.BatchNorm2d):
    """timm's BatchNormAct2d without the activation: F.batch_norm with self.training, counting batches."""

    num_batches_tracked: Tensor

    def forward(self, x: Tensor) -> Tensor:
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
        factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        return F.batch_norm(
            x, self.running_mean, self.running_var, self.weight, self.bias, self.training, factor, self.eps
        )


def test_functional_batch_norm_with_self_training_trains_like_torch() -> None:
    torch.manual_seed(0)
    model = _SpelledOutBatchNorm(3, momentum=0.3)
    graph, weights = export_module(model, (3, 4, 4), loss="mse")
    assert [n["op"] for n in graph["nodes"]] == ["batch_norm"]
    ours, x = _runtime(graph, weights), torch.randn(5, 3, 4, 4)
    ours.train()
    torch.testing.assert_close(ours({"x": x}), model.train()(x))
    state = ours.state()
    torch.testing.assert_close(state["running_var"], model.running_var)
    torch.testing.assert_close(state["running_mean"], model.running_mean)


def test_functional_batch_norm_with_a_cumulative_average_is_refused() -> None:
    """momentum=None reads num_batches_tracked into Python (as timm does), which the graph cannot keep."""
    with pytest.raises(ExportError, match="cannot trace the module|momentum"):
        export_module(_SpelledOutBatchNorm(3, momentum=None), (3, 4, 4), loss="mse")
