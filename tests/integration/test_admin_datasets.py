"""The dataset admin's add form: one file in one of three formats (.npz, a zip of image folders, a text
corpus) with the fields each needs; good uploads create the dataset, bad ones show the reason on the form and
save nothing (no Dataset, DatasetShard or Blob rows, no file in BLOB_ROOT)."""

from __future__ import annotations

import html
import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from django.conf import settings
from django.contrib.auth.models import User
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import Client

from projects.demo import DEMO_TEXT
from projects.models import Blob, Dataset, DatasetShard, Project
from tests.integration.test_admin import ADD_URL, project_form
from tests.integration.test_datasets_images import class_images, image_bytes, zip_of

DATASET_URL = "/admin/projects/dataset/add/"


@pytest.fixture
def admin(client: Client, db: None) -> Client:
    client.force_login(User.objects.create_superuser("root", password="root-pass-123"))
    return client


def blob_files() -> set[Path]:
    root = Path(settings.BLOB_ROOT)
    return {path for path in root.rglob("*") if path.is_file()} if root.exists() else set()


def saved() -> tuple[int, int, int, set[Path]]:
    return Dataset.objects.count(), DatasetShard.objects.count(), Blob.objects.count(), blob_files()


def post(admin: Client, name: str, upload: bytes, filename: str, **fields: Any) -> Any:
    return admin.post(DATASET_URL, {"name": name, "file": SimpleUploadedFile(filename, upload), **fields})


def npz_bytes(**arrays: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)  # type: ignore[arg-type]
    return buffer.getvalue()


def test_the_add_form_offers_every_format_and_its_fields(admin: Client) -> None:
    page = admin.get(DATASET_URL).content.decode()
    for field in ("name", "format", "file", "channels", "height", "width", "block_size", "vocabulary"):
        assert f'name="{field}"' in page, field
    for value in ('value="npz"', 'value="images"', 'value="text"', 'value="bytes"', 'value="3"'):
        assert value in page
    assert "Image folders (.zip)" in page and "Text (.txt)" in page


def test_an_image_zip_becomes_a_dataset(admin: Client) -> None:
    upload = zip_of({**class_images("train/", 3), **class_images("test/", 1)})
    response = post(admin, "pets", upload, "pets.zip", format="images", channels="3", height="8", width="6")

    assert response.status_code == 302, response.content.decode()[:2000]
    dataset = Dataset.objects.get(name="pets")
    assert (dataset.kind, dataset.input_shape, dataset.labels) == (
        "classes",
        [3, 8, 6],
        ["cat", "dog", "emu"],
    )
    assert (dataset.train_samples, dataset.test_samples) == (9, 3)
    change = admin.get(f"/admin/projects/dataset/{dataset.pk}/change/").content.decode()
    assert "&#x27;cat&#x27;, &#x27;dog&#x27;, &#x27;emu&#x27;" in change


def test_the_demo_text_trains_a_gpt_project_created_in_the_admin(admin: Client) -> None:
    response = post(admin, "KJV", DEMO_TEXT.read_bytes(), "kjv.txt", format="text", block_size="64")
    assert response.status_code == 302, response.content.decode()[:2000]
    dataset = Dataset.objects.get(name="KJV")
    assert (dataset.kind, dataset.input_shape, dataset.num_classes) == ("tokens", [64], len(dataset.labels))

    form = project_form(name="KJV GPT", preset="gpt", dataset=str(dataset.pk), batch_size="16")
    response = admin.post(ADD_URL, form)
    assert response.status_code == 302, response.content.decode()[:3000]
    assert Project.objects.get(name="KJV GPT").dataset == dataset


def test_a_preset_that_does_not_fit_a_text_dataset_is_a_form_error(admin: Client) -> None:
    post(admin, "bytes", DEMO_TEXT.read_bytes()[:3000], "kjv.txt", format="text", vocabulary="bytes")
    dataset = Dataset.objects.get(name="bytes")
    response = admin.post(ADD_URL, project_form(preset="gpt", dataset=str(dataset.pk)))
    errors = response.context["adminform"].form.errors
    assert "The gpt preset has 65 outputs; the dataset has 256 tokens in its vocabulary." in errors["preset"]
    response = admin.post(ADD_URL, project_form(preset="mlp", dataset=str(dataset.pk)))
    assert "the dataset has token sequences" in response.context["adminform"].form.errors["preset"][0]
    assert not Project.objects.exists()


def test_float_targets_upload_as_an_npz(admin: Client) -> None:
    data = npz_bytes(x=np.zeros((10, 3), np.float32), y=np.ones((10, 2), np.float32))
    assert post(admin, "points", data, "points.npz", format="npz").status_code == 302
    dataset = Dataset.objects.get(name="points")
    assert (dataset.kind, dataset.num_classes, dataset.target_shape) == ("regression", 0, [2])


BAD_UPLOADS: dict[str, tuple[bytes, dict[str, str], str]] = {
    "corrupt image": (
        zip_of({**class_images("", 2), "cat/x.png": b"\x89PNG broken"}),
        {"format": "images"},
        "Cannot decode cat/x.png",
    ),
    "CMYK image": (
        zip_of({**class_images("", 2), "cat/x.jpg": image_bytes(mode="CMYK", format="JPEG")}),
        {"format": "images"},
        "has mode CMYK",
    ),
    "empty class": (zip_of(class_images("", 2), folders=("zebra/",)), {"format": "images"}, "has no images"),
    "an .npz sent as images": (
        npz_bytes(x=np.zeros((4, 2), np.float32), y=np.arange(4)),
        {"format": "images"},
        "This is an .npz file (numpy arrays), not a zip of image folders",
    ),
    "non-UTF-8 text": (b"abc\xff" * 100, {"format": "text"}, "not UTF-8 text: byte 3"),
    "text shorter than a block": (
        b"short text",
        {"format": "text", "block_size": "64"},
        "too short for blocks",
    ),
    "NaN targets": (
        npz_bytes(x=np.zeros((4, 2), np.float32), y=np.array([[0.0], [1.0], [np.nan], [2.0]])),
        {"format": "npz"},
        "y contains NaN",
    ),
    "mismatched shapes": (
        npz_bytes(x=np.zeros((4, 2)), y=np.ones((4, 3)), x_test=np.zeros((2, 2)), y_test=np.ones((2, 1))),
        {},
        "y_test targets have shape [1], but y targets have shape [3]",
    ),
}


@pytest.mark.parametrize("case", list(BAD_UPLOADS))
def test_a_bad_upload_is_a_form_error_and_saves_nothing(admin: Client, case: str) -> None:
    data, fields, message = BAD_UPLOADS[case]
    before = saved()
    response = post(admin, "bad", data, "upload.bin", **fields)

    assert response.status_code == 200
    errors = response.context["adminform"].form.errors
    assert message in html.unescape(" ".join(errors["file"])), errors
    assert saved() == before


@pytest.mark.parametrize(
    "fields, field",
    [
        ({"format": "images", "channels": "2"}, "channels"),
        ({"format": "text", "block_size": "0"}, "block_size"),
    ],
)
def test_out_of_range_settings_are_field_errors(admin: Client, fields: dict[str, str], field: str) -> None:
    response = post(admin, "bad", b"anything", "upload.bin", **fields)
    assert field in response.context["adminform"].form.errors and saved()[:3] == (0, 0, 0)
