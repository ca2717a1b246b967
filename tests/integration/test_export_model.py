"""`manage.py export_model`: a researcher's own module, from a file on their disk, to files or a project."""

from __future__ import annotations

import json
import sys
import textwrap
import uuid
from collections.abc import Iterator
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
import torch
from django.contrib.auth.models import User
from django.core.management import call_command
from django.core.management.base import CommandError

from engine import codecs
from engine.graph import load_graph
from projects.models import Dataset, ModelVersion, Project
from projects.services import version_weights

MODELS = """
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(784, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(torch.flatten(x, 1))))


class Weird(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(784, 10)

    def forward(self, x):
        return torch.cumsum(self.fc(x), dim=1)


class Conv(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.fc = nn.Linear(4 * 26 * 26, 10)

    def forward(self, x):
        return self.fc(torch.flatten(self.conv(x), 1))


class NeedsArgs(nn.Module):
    def __init__(self, width):
        super().__init__()
"""


@pytest.fixture
def models_module(tmp_path: Path) -> Iterator[str]:
    """The researcher's models file, importable under a unique name (no clash between tests)."""
    name = f"researcher_models_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(MODELS))
    sys.path.insert(0, str(tmp_path))
    yield name
    sys.path.remove(str(tmp_path))
    sys.modules.pop(name, None)


def export(*args: str) -> str:
    out = StringIO()
    call_command("export_model", *args, stdout=out, stderr=StringIO())
    return out.getvalue()


def test_writes_graph_and_weights_that_match_the_module(models_module: str, tmp_path: Path) -> None:
    output = tmp_path / "exported"
    message = export(f"{models_module}:Net", "--input-shape", "784", "--output", str(output))

    assert "graph.json" in message
    graph = load_graph((output / "graph.json").read_text())
    weights, _ = codecs.decode((output / "weights.safetensors").read_bytes())
    assert [p.name for p in graph.params] == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    torch.manual_seed(0)
    expected = torch.nn.Linear(784, 32).weight  # the module seeds itself; its first layer is this one
    assert torch.equal(weights["fc1.weight"], expected)
    assert graph.inputs[0].shape == (-1, 784) and graph.name == "Net"


def test_creates_and_starts_a_project(
    models_module: str, digits_dataset: Dataset, researcher: User, django_capture_on_commit_callbacks: Any
) -> None:
    with django_capture_on_commit_callbacks(execute=True):  # the test's transaction never commits
        message = export(
            f"{models_module}:Net",
            "--input-shape",
            "1,28,28",
            "--project-name",
            "From CLI",
            "--dataset-id",
            str(digits_dataset.pk),
            "--owner",
            researcher.username,
            "--start",
        )

    project = Project.objects.get(name="From CLI")
    assert "From CLI" in message and project.status == Project.Status.RUNNING
    assert (project.owner, project.dataset, project.preset) == (researcher, digits_dataset, "")
    version = ModelVersion.objects.get(project=project, number=0)
    assert set(version_weights(version=version)) == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
    assert project.flops_per_sample > 0
    assert project.work_units.exists()  # started: the feeder ran (Celery is eager in tests)


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("no_colon_here", "Expected module:Class"),
        ("surely_not_a_module_xyz:Net", "Cannot import module 'surely_not_a_module_xyz'"),
        ("{models}:Missing", "'Missing' in module"),
        ("{models}:torch", "is not a torch.nn.Module subclass"),
        ("{models}:NeedsArgs", "NeedsArgs() failed (it must work without arguments)"),
    ],
)
def test_bad_module_class_specs(models_module: str, tmp_path: Path, spec: str, expected: str) -> None:
    with pytest.raises(CommandError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        export(spec.format(models=models_module), "--input-shape", "784", "--output", str(tmp_path / "o"))
    assert not (tmp_path / "o").exists()


def test_unsupported_op_names_the_op_and_the_module_path(models_module: str, tmp_path: Path) -> None:
    with pytest.raises(CommandError) as info:
        export(f"{models_module}:Weird", "--input-shape", "784", "--output", str(tmp_path / "o"))
    assert "torch.cumsum" in str(info.value) and "Cannot export Weird" in str(info.value)
    assert not (tmp_path / "o").exists()


def test_shape_mismatch_with_the_dataset_creates_nothing(
    models_module: str, digits_dataset: Dataset, researcher: User
) -> None:
    expected = r"expects samples of shape \[784\]; the dataset has \[1, 28, 28\]"
    with pytest.raises(CommandError, match=expected):
        export(
            f"{models_module}:Net",
            "--input-shape",
            "784",
            "--project-name",
            "Mismatch",
            "--dataset-id",
            str(digits_dataset.pk),
            "--owner",
            researcher.username,
        )
    assert not Project.objects.filter(name="Mismatch").exists()


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--dataset-id", "1"], "--project-name needs --dataset-id and --owner"),
        (["--dataset-id", "999999", "--owner", "researcher"], "There is no dataset with id 999999"),
        (["--dataset-id", "{dataset}", "--owner", "nobody"], "There is no user 'nobody'"),
    ],
)
def test_project_arguments_are_checked(
    models_module: str, digits_dataset: Dataset, researcher: User, args: list[str], expected: str
) -> None:
    args = [arg.format(dataset=digits_dataset.pk) for arg in args]
    with pytest.raises(CommandError, match=expected):
        export(f"{models_module}:Net", "--input-shape", "784", "--project-name", "P", *args)
    assert not Project.objects.filter(name="P").exists()


@pytest.mark.parametrize("shape", ["1,x,28", "0,28", ""])
def test_bad_input_shapes(models_module: str, tmp_path: Path, shape: str) -> None:
    with pytest.raises(CommandError):
        export(f"{models_module}:Net", "--input-shape", shape, "--output", str(tmp_path / "o"))


def test_graph_json_is_readable(models_module: str, tmp_path: Path) -> None:
    export(f"{models_module}:Net", "--input-shape", "784", "--output", str(tmp_path))
    assert json.loads((tmp_path / "graph.json").read_text())["format"] == "crowdtrain.graph"
