"""Hostile uploads through the real admin forms (issue 9, item 4): every file that used to reach a 500 or
exhaust memory is refused with a clear form error, and nothing is saved (no Dataset, Project or Blob rows,
no file in BLOB_ROOT). A seeded random fuzz of headers, nesting, shapes and compression ratios follows.
Memory is measured in benchmarks/security/uploads.py, not here."""

from __future__ import annotations

import asyncio
import html
import json
import struct
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from asgiref.sync import async_to_sync
from django.conf import settings
from django.contrib.auth.models import User
from django.core.files.uploadedfile import SimpleUploadedFile, UploadedFile
from django.test import AsyncClient, Client, override_settings
from django.utils.datastructures import MultiValueDict

from engine.graph import MAX_ACTIVATION_BYTES, activation_memory, load_graph
from engine.presets import PRESETS, export_preset
from projects import forms
from projects.datasets import dataset_create_from_npz
from projects.models import DEFAULT_MAX_ACTIVATION_MB, Blob, Dataset, Project
from tests.integration.test_admin import ADD_URL, project_form
from tests.security import uploads as u

DATASET_URL = "/admin/projects/dataset/add/"


@pytest.fixture
def superuser(db: None) -> User:
    return User.objects.create_superuser("root", password="root-pass-123")


@pytest.fixture
def admin(client: Client, superuser: User) -> Client:
    client.force_login(superuser)
    return client


@pytest.fixture
def dataset(superuser: User) -> Dataset:
    """4 features, 2 classes: what tests.security.uploads.mlp_graph trains on."""
    return dataset_create_from_npz(owner=superuser, name="tiny", data=u.valid_npz(samples=40))


def blob_files() -> set[Path]:
    root = Path(settings.BLOB_ROOT)
    return {path for path in root.rglob("*") if path.is_file()} if root.exists() else set()


def saved() -> tuple[int, int, int, set[Path]]:
    return Dataset.objects.count(), Project.objects.count(), Blob.objects.count(), blob_files()


def post_dataset(admin: Client, name: str, data: bytes) -> Any:
    return admin.post(DATASET_URL, {"name": name, "file": SimpleUploadedFile(f"{name}.npz", data)})


def post_model(admin: Client, dataset: Dataset, graph: bytes, weights: bytes, **extra: Any) -> Any:
    files = {
        "graph_file": SimpleUploadedFile("graph.json", graph),
        "weights_file": SimpleUploadedFile("weights.safetensors", weights),
    }
    form = project_form(model_source="upload", preset="", dataset=str(dataset.pk), **files, **extra)
    return admin.post(ADD_URL, form)


def refused(response: Any, field: str, message: str) -> None:
    assert response.status_code == 200, response.status_code
    errors = response.context["adminform"].form.errors
    assert field in errors, errors
    assert message in html.unescape(" ".join(errors[field])), errors[field]


VALID_WEIGHTS = u.weights_for(u.mlp_graph())
VALID_GRAPH = json.dumps(u.mlp_graph()).encode()

NPZ_CASES: dict[str, tuple[bytes, str]] = {
    "shape (10**12, 1)": (u.huge_shape_npz(), "x.npy declares shape [1000000000000, 1]"),
    "shape (2**63, 2**63)": (u.huge_shape_npz((2**63, 2**63)), "x.npy declares shape"),
    "negative shape": (u.huge_shape_npz((-1, 4)), "x.npy declares shape [-1, 4]"),
    "zip bomb (64 MiB of zeros in 65 KB)": (u.zip_bomb(64 * 2**20), "Uncompressed"),
    "directory hides the inflated size": (
        u.lying_directory(
            u.zip_of(
                [("x.npy", u.npy_array(np.zeros((4096, 4), "f4"))), ("y.npy", u.labels(4096))], compress=True
            ),
            "x.npy",
            100,
        ),
        "The .npz file is damaged: Bad CRC-32",
    ),
    "object dtype in the header": (
        u.zip_of([("x.npy", u.npy((2, 2), "|O", b"\0" * 32)), ("y.npy", u.labels(2))]),
        "object (pickled) arrays",
    ),
    "structured dtype": (
        u.zip_of([("x.npy", u.npy_header("(2, 1)", "[('a', '<f4')]") + b"\0" * 8), ("y.npy", u.labels(2))]),
        "x has dtype",
    ),
    "subarray dtype of 2**62 elements": (
        u.zip_of(
            [("x.npy", u.npy_header("(2, 1)", "('<f4', (2147483647, 2147483647))")), ("y.npy", u.labels(2))]
        ),
        "Cannot read the .npz file",
    ),
    "shape nested 5,000 deep": (
        u.zip_of([("x.npy", u.npy_header("(" * 5000 + "1," + ")" * 5000)), ("y.npy", u.labels(2))]),
        "Cannot read the .npz file",
    ),
    "npy version 3": (
        u.zip_of([("x.npy", u.npy_header("(2, 1)", version=3) + b"\0" * 8), ("y.npy", u.labels(2))]),
        "Cannot read the .npz file",
    ),
    "more data than the shape": (
        u.zip_of([("x.npy", u.npy((2, 1), data=b"\0" * 4096)), ("y.npy", u.labels(2))]),
        "x.npy declares shape [2, 1]",
    ),
    "x twice": (
        u.zip_of([("x.npy", u.npy_array(np.zeros((2, 1), "f4")))] * 2 + [("y.npy", u.labels(2))]),
        "more than once",
    ),
    "40 members": (u.zip_of([(f"m{i}.npy", b"") for i in range(40)]), "Unexpected arrays"),
}


@pytest.mark.parametrize("case", list(NPZ_CASES))
def test_hostile_npz_is_a_form_error_and_saves_nothing(admin: Client, case: str) -> None:
    data, message = NPZ_CASES[case]
    before = saved()
    refused(post_dataset(admin, "hostile", data), "file", message)
    assert saved() == before


def test_hostile_npz_in_the_project_form_saves_nothing(admin: Client) -> None:
    before = saved()
    response = admin.post(ADD_URL, project_form(dataset_file=SimpleUploadedFile("x.npz", u.huge_shape_npz())))
    refused(response, "dataset_file", "x.npy declares shape [1000000000000, 1]")
    assert saved() == before


def test_float32_size_of_the_arrays_is_bounded(admin: Client) -> None:
    data = u.valid_npz(samples=100, features=100)  # 40 KB as float32
    limits = {**settings.CROWDTRAIN, "MAX_DATASET_ARRAY_BYTES": 20_000}
    before = saved()
    with override_settings(CROWDTRAIN=limits):
        refused(post_dataset(admin, "wide", data), "file", "the limit is 20,000 bytes")
    assert saved() == before


def test_compression_ratio_is_bounded_but_small_files_may_compress_well(admin: Client) -> None:
    refused(post_dataset(admin, "bomb", u.zip_bomb(40 * 2**20)), "file", "compressed")
    zeros = u.zip_of([("x.npy", u.npy_array(np.zeros((1000, 100), "f4"))), ("y.npy", u.labels(1000))], True)
    assert post_dataset(admin, "zeros", zeros).status_code == 302  # 400 KB from 1 KB: under the floor


GRAPH_CASES: dict[str, tuple[bytes, str]] = {
    "graph nested 100,000 deep": (u.nested_json(100_000), "nested"),
    "graph objects nested 50,000 deep": (u.nested_json(50_000, "{"), "nested"),
    "unused field nested 990 deep": (u.graph_with(u.nested_json(990)), "nested"),
    "activations of 1.5 TB per sample": (
        json.dumps(u.activation_bomb(features=4, side=153_664, classes=2)).encode(),
        "node 'outer'",
    ),
    "a number of 5,000 digits": (
        b'{"format": "crowdtrain.graph", "version": ' + b"9" * 5000 + b"}",
        "Invalid model graph",
    ),
    "Infinity as a dimension": (VALID_GRAPH.replace(b"[2, 4]", b"[2, Infinity]"), "shape must be a list"),
}


@pytest.mark.parametrize("case", list(GRAPH_CASES))
def test_hostile_graph_is_a_form_error_and_saves_nothing(admin: Client, dataset: Dataset, case: str) -> None:
    graph, message = GRAPH_CASES[case]
    weights = u.weights_for(json.loads(graph)) if case.startswith("activations") else VALID_WEIGHTS
    before = saved()
    refused(post_model(admin, dataset, graph, weights), "graph_file", message)
    assert saved() == before


def test_activation_limit_is_the_projects_setting(admin: Client, dataset: Dataset) -> None:
    graph = u.activation_bomb(features=4, side=150, classes=2)  # outer: [B, 600, 600], 1.4 MB per sample
    raw, weights = json.dumps(graph).encode(), u.weights_for(graph)
    before = saved()
    response = post_model(admin, dataset, raw, weights, max_activation_mb="1")
    refused(response, "graph_file", "node 'outer' (matmul)")
    assert "at most 1 MiB" in html.unescape(response.content.decode())
    assert saved() == before
    assert post_model(admin, dataset, raw, weights).status_code == 302  # the default allows it
    assert Project.objects.get().max_activation_mb == Project._meta.get_field("max_activation_mb").default


def test_every_preset_fits_the_default_limit_four_times_over() -> None:
    for name in PRESETS:
        memory = activation_memory(load_graph(export_preset(name)[0]))
        assert memory.train_bytes * 4 <= DEFAULT_MAX_ACTIVATION_MB * 2**20 <= MAX_ACTIVATION_BYTES, name


WEIGHTS_CASES: dict[str, tuple[bytes, str]] = {
    "header nested 100,000 deep (the issue's frame)": (
        struct.pack("<Q", 200_000) + b"[" * 100_000 + b"]" * 100_000,
        "nested",
    ),
    "header length of 89.5 MB": (struct.pack("<Q", 89_500_000) + b"{}" + bytes(1000), "header"),
    "header length of 2**64 - 1": (struct.pack("<Q", 2**64 - 1) + b"{}", "header"),
    "shape (10**12, 1) in 4 bytes": (
        u.safetensors(json.dumps({"w": u.st_entry("F32", [10**12, 1], [0, 4])}).encode(), bytes(4)),
        "tensor 'w'",
    ),
    "offsets beyond the file": (
        u.safetensors(json.dumps({"w": u.st_entry("F32", [2, 4], [0, 2**40])}).encode(), bytes(32)),
        "tensor 'w'",
    ),
    "unsupported dtype": (
        u.safetensors(json.dumps({"w": u.st_entry("U64", [2, 2], [0, 32])}).encode(), bytes(32)),
        "dtype",
    ),
    "unicode digit as block size": (
        u.safetensors(
            json.dumps(
                {
                    "__metadata__": {"codec": "int8", "block_size": "²"},
                    "w": u.st_entry("F32", [2, 4], [0, 32]),
                }
            ).encode(),
            bytes(32),
        ),
        "block_size",
    ),
}


@pytest.mark.parametrize("case", list(WEIGHTS_CASES))
def test_hostile_weights_are_a_form_error_and_save_nothing(
    admin: Client, dataset: Dataset, case: str
) -> None:
    weights, message = WEIGHTS_CASES[case]
    before = saved()
    refused(post_model(admin, dataset, VALID_GRAPH, weights), "weights_file", message)
    assert saved() == before


def test_header_size_limit_is_a_setting(admin: Client, dataset: Dataset) -> None:
    header = json.dumps({"__metadata__": {"pad": "p" * 3000}, "w": u.st_entry("F32", [2, 4], [0, 32])})
    weights = u.safetensors(header.encode(), bytes(32))
    limits = {**settings.CROWDTRAIN, "MAX_TENSOR_HEADER_BYTES": 2000}
    with override_settings(CROWDTRAIN=limits):
        refused(post_model(admin, dataset, VALID_GRAPH, weights), "weights_file", "at most 2,000")
    assert post_model(admin, dataset, VALID_GRAPH, weights).status_code == 302


@pytest.fixture
def parse_spy(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[dict[str, Any]]]:
    calls: list[dict[str, Any]] = []
    real = forms.dataset_parse_npz

    def spy(**kwargs: Any) -> Any:
        try:
            asyncio.get_running_loop()
            on_loop = True
        except RuntimeError:
            on_loop = False
        data = kwargs["data"]
        on_disk = not isinstance(data, bytes) and Path(data.name).is_file()
        calls.append({"thread": threading.get_ident(), "on_loop": on_loop, "on_disk": on_disk})
        return real(**kwargs)

    monkeypatch.setattr(forms, "dataset_parse_npz", spy)
    yield calls


def test_under_asgi_uploads_are_parsed_off_the_event_loop_from_a_file_on_disk(
    superuser: User, parse_spy: list[dict[str, Any]]
) -> None:
    """Django runs sync views (the admin) in a worker thread under ASGI (daphne): parsing never blocks the
    event loop. Files above FILE_UPLOAD_MAX_MEMORY_SIZE are spooled to disk and parsed from there."""
    client = AsyncClient()
    client.force_login(superuser)
    upload = SimpleUploadedFile("big.npz", u.valid_npz(samples=200))
    with override_settings(FILE_UPLOAD_MAX_MEMORY_SIZE=1000):
        response = async_to_sync(client.post)(DATASET_URL, {"name": "big", "file": upload})

    assert response.status_code == 302 and Dataset.objects.filter(name="big").exists()
    (call,) = parse_spy
    assert not call["on_loop"]
    assert call["on_disk"]


def fuzz_form(upload: u.Upload, owner: User, dataset: Dataset) -> forms.forms.ModelForm:
    """The admin's own form classes, bound as the admin binds them (without rendering the page)."""
    if upload.kind == u.NPZ:
        npz: MultiValueDict[str, UploadedFile] = MultiValueDict(
            {"file": [SimpleUploadedFile("f.npz", upload.data)]}
        )
        return forms.DatasetAddForm({"name": upload.name}, npz)
    graph, weights = (upload.data, VALID_WEIGHTS) if upload.kind == u.GRAPH else (VALID_GRAPH, upload.data)
    files = {
        "graph_file": SimpleUploadedFile("graph.json", graph),
        "weights_file": SimpleUploadedFile("weights.safetensors", weights),
    }
    data = project_form(name=upload.name, model_source="upload", preset="", dataset=str(dataset.pk))
    return type("Form", (forms.ProjectAddForm,), {"owner": owner})(data, files)


def test_seeded_upload_fuzz_never_crashes_and_refusals_save_nothing(
    superuser: User, dataset: Dataset
) -> None:
    """300 random hostile files (a third per form) through the admin's forms: any exception fails the
    test. Each refusal is a form error; the rare mutation that stays valid is saved like any upload."""
    refusals = 0
    for upload in u.random_uploads(seed=9, count=300):
        before = saved()
        form = fuzz_form(upload, superuser, dataset)
        if form.is_valid():
            form.create(owner=superuser)  # type: ignore[attr-defined]
            continue
        refusals += 1
        assert all(form.errors.values()), upload.name
        assert saved() == before, upload.name
    assert refusals >= 270


def test_the_fuzz_through_the_admin_pages_too(admin: Client, dataset: Dataset) -> None:
    """A sample of the fuzz end to end (multipart parsing, the admin's views): never a 500."""
    for upload in u.random_uploads(seed=10, count=30):
        before = saved()
        if upload.kind == u.NPZ:
            response = post_dataset(admin, upload.name, upload.data)
        elif upload.kind == u.GRAPH:
            response = post_model(admin, dataset, upload.data, VALID_WEIGHTS, name=upload.name)
        else:
            response = post_model(admin, dataset, VALID_GRAPH, upload.data, name=upload.name)
        assert response.status_code in (200, 302), (upload.name, response.status_code)
        if response.status_code == 200:
            assert response.context["adminform"].form.errors, upload.name
            assert saved() == before, upload.name
