"""The project add form with an uploaded graph.json + weights.safetensors instead of a preset."""

from __future__ import annotations

import html
import json
import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch
from django.conf import settings
from django.contrib.auth.models import User
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import Client, override_settings
from torch import nn

from engine import codecs
from engine.export import export_module
from projects.datasets import dataset_create_from_npz
from projects.models import Blob, Dataset, ModelVersion, Project
from projects.services import ProjectError, project_create_from_graph, version_weights
from tests.integration.test_admin import ADD_URL, npz_upload, project_form

Tensors = dict[str, torch.Tensor]


class Net(nn.Module):
    """784 -> 10 with a batch norm, so the weights hold buffers as well as params."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.fc1, self.bn, self.fc2 = nn.Linear(784, 16), nn.BatchNorm1d(16), nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


@pytest.fixture
def exported() -> tuple[dict[str, Any], Tensors]:
    return export_module(Net(), (784,))


@pytest.fixture
def superuser(db: None) -> User:
    return User.objects.create_superuser("root", password="root-pass-123")


@pytest.fixture
def dataset(superuser: User) -> Dataset:
    """Flat samples, as the uploaded graphs here take them (the presets take [1, 28, 28] images)."""
    return dataset_create_from_npz(owner=superuser, name="digits", data=npz_upload(shape=(784,)).read())


def graph_upload(graph: dict[str, Any] | bytes) -> SimpleUploadedFile:
    data = graph if isinstance(graph, bytes) else json.dumps(graph).encode()
    return SimpleUploadedFile("graph.json", data, content_type="application/json")


def weights_upload(data: Tensors | bytes) -> SimpleUploadedFile:
    raw = data if isinstance(data, bytes) else codecs.encode(data)
    return SimpleUploadedFile("weights.safetensors", raw, content_type="application/octet-stream")


def upload_form(dataset: Dataset, graph: Any, weights: Any, **overrides: Any) -> dict[str, Any]:
    files = {"graph_file": graph_upload(graph), "weights_file": weights_upload(weights)}
    return project_form(model_source="upload", preset="", dataset=str(dataset.pk), **files, **overrides)


def test_the_add_page_offers_both_model_sources(client: Client, superuser: User) -> None:
    client.force_login(superuser)
    page = client.get(ADD_URL).content.decode()
    assert 'name="model_source"' in page and 'value="upload"' in page and 'value="mlp"' in page
    assert 'name="graph_file"' in page and 'name="weights_file"' in page


def test_an_uploaded_model_becomes_the_project_version_0(
    client: Client, superuser: User, dataset: Dataset, exported: tuple[dict[str, Any], Tensors]
) -> None:
    graph, weights = exported
    client.force_login(superuser)
    response = client.post(ADD_URL, upload_form(dataset, graph, weights))

    assert response.status_code == 302, response.content.decode()[:3000]
    project = Project.objects.get(name="Digits MLP")
    assert (project.preset, project.dataset, project.owner) == ("", dataset, superuser)
    assert project.flops_per_sample > 0 and project.learning_rate == 0.05
    stored = version_weights(version=ModelVersion.objects.get(project=project, number=0))
    assert stored.keys() == weights.keys()
    assert all(torch.equal(stored[name], weights[name]) for name in weights)
    assert json.loads(project.graph.read())["nodes"] == graph["nodes"]


def test_the_preset_path_still_works_with_an_explicit_choice(client: Client, superuser: User) -> None:
    images = dataset_create_from_npz(owner=superuser, name="digit images", data=npz_upload().read())
    client.force_login(superuser)
    response = client.post(ADD_URL, project_form(model_source="preset", dataset=str(images.pk)))

    assert response.status_code == 302
    assert Project.objects.get(name="Digits MLP").preset == "mlp"


def renamed(weights: Tensors, old: str, new: str) -> Tensors:
    return {new if name == old else name: t for name, t in weights.items()}


Case = Callable[[dict[str, Any], Tensors], tuple[Any, Any]]
BAD_CASES: dict[str, tuple[Case, str, str]] = {
    "graph is not JSON": (lambda g, w: (b"{nope", w), "graph_file", "graph is not valid JSON"),
    "graph fails validation": (
        lambda g, w: ({**g, "output": "nowhere"}, w),
        "graph_file",
        "output 'nowhere' is not a node",
    ),
    "graph over 2 MB": (
        lambda g, w: (json.dumps(g).encode() + b" " * 2**21, w),
        "graph_file",
        "the limit is 2,097,152",
    ),
    "a tensor is missing": (
        lambda g, w: (g, {k: v for k, v in w.items() if k != "bn.running_var"}),
        "weights_file",
        "The weights have no tensor 'bn.running_var'",
    ),
    "a tensor has the wrong shape": (
        lambda g, w: (g, {**w, "fc2.bias": torch.zeros(11)}),
        "weights_file",
        "Tensor 'fc2.bias' has shape [11]; the graph says [10]",
    ),
    "an extra tensor": (
        lambda g, w: (g, {**w, "zzz": torch.zeros(1)}),
        "weights_file",
        "Tensor 'zzz' is not a param or buffer of the graph",
    ),
    "a NaN weight": (
        lambda g, w: (g, {**w, "fc1.bias": torch.full((16,), float("nan"))}),
        "weights_file",
        "Tensor 'fc1.bias' must hold finite float values",
    ),
    "weights that are a pickle": (
        lambda g, w: (g, pickle.dumps(w)),
        "weights_file",
        "Not a usable safetensors file",
    ),
    "weights that are a torch.save file": (
        lambda g, w: (g, _torch_save(w)),
        "weights_file",
        "Not a usable safetensors file",
    ),
    "graph for another input shape": (
        lambda g, w: export_module(nn.Sequential(nn.Flatten(), nn.Linear(100, 10)), (1, 10, 10)),
        "graph_file",
        "The graph expects samples of shape [1, 10, 10]; the dataset has [784]",
    ),
    "graph with too few classes": (
        lambda g, w: export_module(nn.Linear(784, 5), (784,)),
        "graph_file",
        "The graph predicts 5 classes; the dataset has 10",
    ),
}


def _torch_save(weights: Tensors) -> bytes:
    import io

    buffer = io.BytesIO()
    torch.save(weights, buffer)  # a zip of pickles: must never be loaded by the server
    return buffer.getvalue()


@pytest.mark.parametrize("case", list(BAD_CASES))
def test_bad_uploads_show_the_error_and_save_nothing(
    client: Client, superuser: User, dataset: Dataset, exported: tuple[dict[str, Any], Tensors], case: str
) -> None:
    make, field, message = BAD_CASES[case]
    graph, weights = make(*exported)
    blobs = Blob.objects.count()
    client.force_login(superuser)
    response = client.post(ADD_URL, upload_form(dataset, graph, weights))

    assert response.status_code == 200
    errors = response.context["adminform"].form.errors
    assert field in errors, errors
    assert message in html.unescape(response.content.decode()), errors
    assert not Project.objects.exists() and Blob.objects.count() == blobs


# .npz datasets hold one class label per sample: only a cross_entropy loss on one label per sample fits.
FITS: dict[str, tuple[Callable[[], tuple[dict[str, Any], Tensors]], str | None]] = {
    "a classifier of its samples": (lambda: export_module(Net(), (784,)), None),
    "an mse loss": (lambda: export_module(Net(), (784,), loss="mse"), "needs a cross_entropy loss"),
    "another input shape": (
        lambda: export_module(nn.Sequential(nn.Flatten(), nn.Linear(100, 10)), (1, 10, 10)),
        "expects samples of shape [1, 10, 10]",
    ),
    "too few classes": (lambda: export_module(nn.Linear(784, 5), (784,)), "predicts 5 classes"),
}


@pytest.mark.parametrize("case", list(FITS))
def test_the_form_and_the_service_judge_whether_a_graph_fits_a_dataset_alike(
    client: Client, superuser: User, dataset: Dataset, case: str
) -> None:
    make, expected = FITS[case]
    graph, weights = make()
    client.force_login(superuser)
    response = client.post(ADD_URL, upload_form(dataset, graph, weights))
    form = None if response.status_code == 302 else response.context["adminform"].form
    form_error = list(form.errors["graph_file"]) if form else None
    service_error = _service_error(owner=superuser, dataset=dataset, graph=graph, weights=weights)

    assert form_error == ([service_error] if service_error else None)
    if expected is None:
        assert service_error is None
    else:
        assert expected in str(service_error)


def _service_error(*, owner: User, dataset: Dataset, graph: dict[str, Any], weights: Tensors) -> str | None:
    try:
        project_create_from_graph(owner=owner, name="S", dataset=dataset, graph_dict=graph, weights=weights)
    except ProjectError as exc:
        return str(exc)
    return None


def test_weights_over_the_result_limit_are_refused_before_reading(
    client: Client, superuser: User, dataset: Dataset, exported: tuple[dict[str, Any], Tensors]
) -> None:
    client.force_login(superuser)
    limits = {**settings.CROWDTRAIN, "MAX_RESULT_BYTES": 1000}
    with override_settings(CROWDTRAIN=limits):
        response = client.post(ADD_URL, upload_form(dataset, *exported))

    assert response.status_code == 200 and "the limit is 1,000 bytes" in response.content.decode()
    assert not Project.objects.exists()


def test_upload_source_needs_both_files(client: Client, superuser: User, dataset: Dataset) -> None:
    client.force_login(superuser)
    form = project_form(model_source="upload", preset="", dataset=str(dataset.pk))
    response = client.post(ADD_URL, form)

    errors = response.context["adminform"].form.errors
    assert set(errors) >= {"graph_file", "weights_file"} and not Project.objects.exists()


def test_upload_with_a_new_npz_dataset_saves_nothing_when_the_model_is_bad(
    client: Client, superuser: User, exported: tuple[dict[str, Any], Tensors]
) -> None:
    graph, weights = exported
    client.force_login(superuser)
    form = project_form(
        model_source="upload",
        preset="",
        dataset_file=npz_upload(shape=(784,)),
        dataset_name="new",
        graph_file=graph_upload(graph),
        weights_file=weights_upload(pickle.dumps(weights)),
    )
    response = client.post(ADD_URL, form)

    assert response.status_code == 200 and "weights_file" in response.context["adminform"].form.errors
    assert not Dataset.objects.filter(name="new").exists() and not Project.objects.exists()
