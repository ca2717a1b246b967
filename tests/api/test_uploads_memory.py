"""A 200 MB dataset through the API, as tests/integration/test_datasets_memory.py does through the admin's
form: sent in 8 MiB chunks, written to the upload's file, then parsed and stored from it, while Python's
allocations (numpy's included, which tracemalloc sees) stay under 64 MB."""

from __future__ import annotations

import gc
import tracemalloc
from pathlib import Path

import pytest
from rest_framework.test import APIClient

from projects.models import Dataset
from tests.integration.test_datasets_memory import PEAK_BOUND, SAMPLES, write_npz

pytestmark = pytest.mark.slow
CHUNK = 8 * 2**20


@pytest.fixture
def big_file(tmp_path: Path) -> Path:
    path = tmp_path / "big.npz"
    with path.open("wb") as handle:
        write_npz(handle)
    return path


def send(api: APIClient, path: Path) -> str:
    size = path.stat().st_size
    upload_id = str(
        api.post("/api/uploads/", {"filename": "big.npz", "size": size}, format="json").json()["id"]
    )
    with path.open("rb") as handle:
        for offset in range(0, size, CHUNK):
            response = api.generic(
                "PUT", f"/api/uploads/{upload_id}/", handle.read(CHUNK),  # type: ignore[arg-type]
                "application/octet-stream",
                HTTP_UPLOAD_OFFSET=str(offset),
            )  # fmt: skip
            assert response.status_code == 200, response.content
            del response
            gc.collect()  # the test client's response and request refer to each other (daphne's do not)
    return upload_id


def test_a_200_mb_upload_through_the_api_stays_within_64_mb(api: APIClient, big_file: Path) -> None:
    assert big_file.stat().st_size > 200 * 10**6
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        upload_id = send(api, big_file)
        sent = tracemalloc.get_traced_memory()[1] - before
        response = api.post("/api/datasets/", {"name": "big", "upload": upload_id}, format="json")
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()

    assert response.status_code == 201, response.content
    assert peak < PEAK_BOUND, f"peak {peak / 2**20:.1f} MiB, {sent / 2**20:.1f} MiB while sending"
    dataset = Dataset.objects.get(pk=response.json()["id"])
    assert (dataset.train_samples, dataset.test_samples) == (SAMPLES - SAMPLES // 10, SAMPLES // 10)
