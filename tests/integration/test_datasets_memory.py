"""Large uploads stream: a 200 MB .npz spooled to disk (as Django's TemporaryFileUploadHandler leaves it) is
validated, staged and stored through the admin's form while Python's allocations (numpy's included, which
tracemalloc sees) stay under 64 MB: the file is never read whole, and shards are written one at a time."""

from __future__ import annotations

import tracemalloc
import zipfile
from typing import IO

import numpy as np
import pytest
from django.contrib.auth.models import User
from django.core.files.uploadedfile import TemporaryUploadedFile
from django.utils.datastructures import MultiValueDict

from projects.datasets import dataset_load_split, shard_load
from projects.forms import DatasetAddForm

SAMPLES, FEATURES = 64_000, 784  # x: 200.7 MB of float32
WRITE_ROWS = 1000
PEAK_BOUND = 64 * 2**20


def rows(start: int, count: int) -> np.ndarray:
    """Rows with values that tell where they came from, without ever holding the whole array."""
    index = np.arange(start * FEATURES, (start + count) * FEATURES, dtype=np.int64)
    return ((index % 251) / 251).astype(np.float32).reshape(count, FEATURES)


def write_npz(handle: IO[bytes]) -> None:
    """An uncompressed .npz as numpy.savez writes it, streamed a thousand rows at a time."""
    header = {"descr": "<f4", "fortran_order": False, "shape": (SAMPLES, FEATURES)}
    with zipfile.ZipFile(handle, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
        with archive.open("x.npy", "w", force_zip64=True) as member:
            np.lib.format.write_array_header_1_0(member, header)
            for start in range(0, SAMPLES, WRITE_ROWS):
                member.write(rows(start, WRITE_ROWS).tobytes())
        with archive.open("y.npy", "w") as member:
            np.lib.format.write_array(member, np.arange(SAMPLES, dtype=np.int64) % 10)


@pytest.fixture
def big_upload() -> TemporaryUploadedFile:
    upload = TemporaryUploadedFile("big.npz", "application/octet-stream", 0, None)
    spooled = upload.file
    assert spooled is not None
    write_npz(spooled)
    upload.size = spooled.tell()
    spooled.seek(0)
    return upload


def test_a_200_mb_upload_is_stored_within_64_mb_of_memory(
    db: None, big_upload: TemporaryUploadedFile
) -> None:
    owner = User.objects.create_user("big-data", password="big-data-pass-123")
    assert (big_upload.size or 0) > 200 * 10**6  # three times the bound
    form = DatasetAddForm({"name": "big", "format": "npz"}, MultiValueDict({"file": [big_upload]}))

    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        assert form.is_valid(), form.errors
        dataset = form.create(owner=owner)
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()

    assert peak < PEAK_BOUND, f"peak {peak / 2**20:.1f} MiB"
    assert (dataset.train_samples, dataset.test_samples) == (SAMPLES - SAMPLES // 10, SAMPLES // 10)
    assert dataset.shards.filter(split="train").count() == 58
    shard = dataset.shards.get(split="train", index=17)
    x, y = shard_load(shard=shard)
    np.testing.assert_array_equal(x, rows(17_000, 1000))
    assert y.tolist() == (np.arange(17_000, 18_000) % 10).tolist()
    test_x, _ = dataset_load_split(dataset=dataset, split="test")
    np.testing.assert_array_equal(test_x[-3:], rows(SAMPLES - 3, 3))
