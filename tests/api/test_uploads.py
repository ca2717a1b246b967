"""Resumable dataset uploads (uploads/services.py through projects/api.py): chunks at the server's offset,
resumed by a new client, wrong offsets and oversize refused, bad files refused with nothing saved."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from rest_framework.test import APIClient

from projects.models import Blob, Dataset
from tests.conftest import mnist_arrays, npz_bytes
from uploads.models import Upload

pytestmark = pytest.mark.django_db


@pytest.fixture
def digits() -> bytes:
    x, y = mnist_arrays(per_class=20)
    return npz_bytes(x=x, y=y)


def start(api: APIClient, size: int, name: str = "digits.npz") -> Any:
    return api.post("/api/uploads/", {"filename": name, "size": size}, format="json")


def put(api: APIClient, upload_id: str, data: bytes, offset: int, **extra: Any) -> Any:
    return api.generic(
        "PUT",
        f"/api/uploads/{upload_id}/",
        data,  # type: ignore[arg-type]  # the stubs say str; Django's test client takes bytes
        "application/octet-stream",
        HTTP_UPLOAD_OFFSET=str(offset),
        **extra,
    )


def test_an_upload_in_chunks_survives_an_interruption_and_resumes(api: APIClient, digits: bytes) -> None:
    upload_id = start(api, len(digits)).json()["id"]
    third = len(digits) // 3
    assert put(api, upload_id, digits[:third], 0).json() == {
        "id": upload_id,
        "offset": third,
        "size": len(digits),
    }

    # A new client (the old one died) asks where to go on. A connection cut mid-chunk: test_live.py.
    assert api.get(f"/api/uploads/{upload_id}/").json()["offset"] == third
    assert put(api, upload_id, digits[third : 2 * third], third).json()["offset"] == 2 * third
    assert put(api, upload_id, digits[2 * third :], 2 * third).json()["offset"] == len(digits)
    assert Path(Upload.objects.get(pk=upload_id).path).read_bytes() == digits

    created = api.post("/api/datasets/", {"name": "resumed", "upload": upload_id}, format="json")
    assert created.status_code == 201 and created.json()["train_samples"] == 180
    assert not Upload.objects.filter(pk=upload_id).exists()  # consumed, and its file gone


def test_a_wrong_offset_is_409_with_the_current_offset(api: APIClient, digits: bytes) -> None:
    upload_id = start(api, len(digits)).json()["id"]
    put(api, upload_id, digits[:1000], 0)
    for offset in (0, 999, 1001, 10**12):
        response = put(api, upload_id, digits[1000:2000], offset)
        assert response.status_code == 409 and response.json()["offset"] == 1000
    assert put(api, upload_id, digits[1000:2000], 1000).json()["offset"] == 2000


@pytest.mark.parametrize("header", ["", "-1", "abc", "1e3", "9" * 40])
def test_a_missing_or_garbled_offset_is_400(api: APIClient, header: str) -> None:
    upload_id = start(api, 100).json()["id"]
    response = api.generic("PUT", f"/api/uploads/{upload_id}/", "x", HTTP_UPLOAD_OFFSET=header)
    assert response.status_code == 400 and "Upload-Offset" in response.json()["detail"]


def test_oversize_is_refused_up_front(api: APIClient, settings: Any) -> None:
    settings.CROWDTRAIN = {**settings.CROWDTRAIN, "MAX_DATASET_BYTES": 10_000, "MAX_UPLOAD_CHUNK_BYTES": 1000}
    too_big = start(api, 10_001)
    assert too_big.status_code == 400 and "between 1 and 10,000 bytes" in too_big.json()["detail"]
    assert start(api, 0).status_code == 400

    upload_id = start(api, 1500).json()["id"]
    chunk = put(api, upload_id, b"x" * 1001, 0)
    assert chunk.status_code == 413 and "at most 1,000 bytes" in chunk.json()["detail"]
    assert put(api, upload_id, b"x" * 1000, 0).json()["offset"] == 1000
    beyond = put(api, upload_id, b"x" * 501, 1000)
    assert beyond.status_code == 400 and "pass the declared size" in beyond.json()["detail"]
    assert api.get(f"/api/uploads/{upload_id}/").json()["offset"] == 1000


def test_unfinished_uploads_per_user_are_limited(api: APIClient) -> None:
    for _ in range(5):
        assert start(api, 100).status_code == 201
    refused = start(api, 100)
    assert refused.status_code == 400 and "unfinished uploads" in refused.json()["detail"]


@pytest.mark.parametrize(
    ("data", "form", "message"),
    [
        (b"not a zip at all" * 10, {}, "not"),
        (npz_bytes(x=np.zeros((10, 3), np.float32), y=np.zeros(9, np.int64)), {}, "samples"),
        (b"PK\x03\x04" + b"\x00" * 200, {"format": "images"}, "zip"),
        (b"\xff\xfe\xfa" * 50, {"format": "text"}, "UTF-8"),
    ],
)
def test_a_bad_file_is_a_clear_400_nothing_is_saved_and_the_upload_is_consumed(
    api: APIClient, data: bytes, form: dict[str, str], message: str
) -> None:
    upload_id = start(api, len(data)).json()["id"]
    put(api, upload_id, data, 0)
    path = Upload.objects.get(pk=upload_id).path
    blobs, datasets = Blob.objects.count(), Dataset.objects.count()

    response = api.post("/api/datasets/", {"name": "bad", "upload": upload_id, **form}, format="json")

    assert response.status_code == 400 and message in response.json()["detail"], response.json()
    assert (Blob.objects.count(), Dataset.objects.count()) == (blobs, datasets)
    assert not Upload.objects.filter(pk=upload_id).exists() and not path.exists()


def test_an_incomplete_upload_cannot_become_a_dataset(api: APIClient, digits: bytes) -> None:
    upload_id = start(api, len(digits)).json()["id"]
    put(api, upload_id, digits[:100], 0)
    response = api.post("/api/datasets/", {"name": "early", "upload": upload_id}, format="json")
    assert response.status_code == 400 and f"100 of {len(digits):,} bytes" in response.json()["detail"]
    assert not Dataset.objects.filter(name="early").exists()


def test_an_unknown_upload_is_400(api: APIClient) -> None:
    response = api.post(
        "/api/datasets/", {"name": "x", "upload": "00000000-0000-0000-0000-000000000000"}, format="json"
    )
    assert response.status_code == 400 and response.json()["detail"] == "No such upload."
