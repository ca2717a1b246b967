"""Dataset uploads: every bad file is refused with a clear message and stores nothing; good ones shard."""

from __future__ import annotations

import io
import re
import zipfile
from typing import Any

import numpy as np
import pytest
from django.contrib.auth.models import User
from safetensors.numpy import load as safetensors_load

from projects.datasets import DatasetError, dataset_create_from_npz, dataset_load_split
from projects.models import Blob, Dataset, DatasetShard

UNPICKLED: list[str] = []


class Booby:
    """Records it if anything ever unpickles it."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (UNPICKLED.append, ("unpickled!",))


def npz(compressed: bool = False, **arrays: Any) -> bytes:
    buffer = io.BytesIO()
    (np.savez_compressed if compressed else np.savez)(buffer, **arrays)
    return buffer.getvalue()


def images(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).random((n, 1, 2, 2), dtype=np.float32)


def labels(n: int, classes: int = 3) -> np.ndarray:
    return np.arange(n) % classes


@pytest.fixture
def owner(db: None) -> User:
    return User.objects.create_user("dataset-owner", password="owner-pass-123", is_staff=True)


@pytest.fixture
def small_shards(settings: Any) -> int:
    settings.CROWDTRAIN = {**settings.CROWDTRAIN, "SHARD_SAMPLES": 4}
    return 4


def zip_with(name: str, payload: bytes) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr(name, payload)
    return buffer.getvalue()


BAD_UPLOADS = {
    "not a zip": (b"this is plain text, not numpy", "not an .npz"),
    "empty file": (b"", "not an .npz"),
    "zip of something else": (zip_with("readme.txt", b"hello"), "Unexpected arrays readme.txt"),
    "missing y": (npz(x=images(5)), "no array named 'y'"),
    "missing x": (npz(y=labels(5)), "no array named 'x'"),
    "unexpected array": (npz(x=images(5), y=labels(5), extra=np.zeros(3)), "Unexpected arrays extra"),
    "pickled objects in x": (
        npz(x=np.array([Booby(), Booby()], dtype=object), y=labels(2)),
        "object (pickled) arrays",
    ),
    "pickled objects in y": (npz(x=images(2), y=np.array([Booby(), 1], dtype=object)), "object (pickled)"),
    "x int64": (npz(x=np.ones((5, 3), dtype=np.int64), y=labels(5)), "x has dtype int64"),
    "x bool": (npz(x=np.ones((5, 3), dtype=bool), y=labels(5)), "x has dtype bool"),
    "x one-dimensional": (npz(x=np.ones(5, dtype=np.float32), y=labels(5)), "shape [samples, ...]"),
    "x without samples": (npz(x=np.ones((0, 3), dtype=np.float32), y=labels(0)), "shape [samples, ...]"),
    "y float": (npz(x=images(5), y=labels(5).astype(np.float32)), "integer class labels"),
    "y two-dimensional": (npz(x=images(5), y=labels(10).reshape(5, 2)), "integer class labels"),
    "length mismatch": (npz(x=images(5), y=labels(4)), "x has 5 samples but y has 4 labels"),
    "negative label": (npz(x=images(4), y=np.array([0, 1, -1, 1])), "Labels must be >= 0"),
    "single class": (npz(x=images(4), y=np.zeros(4, dtype=np.int64)), "at least 2 classes"),
    "too many classes": (npz(x=images(2), y=np.array([0, 10**6])), "at most 100000 classes"),
    "NaN": (npz(x=np.array([[0.0, np.nan], [1.0, 2.0]]), y=np.array([0, 1])), "NaN or infinite"),
    "inf": (npz(x=np.array([[0.0, np.inf], [1.0, 2.0]], dtype=np.float32), y=np.array([0, 1])), "NaN or inf"),
    "float64 overflow": (npz(x=np.array([[1e300], [1.0]]), y=np.array([0, 1])), "NaN or infinite"),
    "x_test without y_test": (npz(x=images(5), y=labels(5), x_test=images(2)), "both x_test and y_test"),
    "y_test without x_test": (npz(x=images(5), y=labels(5), y_test=labels(2)), "both x_test and y_test"),
    "test sample shape": (
        npz(x=images(5), y=labels(5), x_test=np.ones((2, 4), np.float32), y_test=labels(2)),
        "x_test samples have shape [4], but x samples have shape [1, 2, 2]",
    ),
    "test length mismatch": (
        npz(x=images(5), y=labels(5), x_test=images(3), y_test=labels(2)),
        "x_test has 3 samples but y_test has 2",
    ),
    "test NaN": (
        npz(x=images(5), y=labels(5), x_test=np.full((2, 1, 2, 2), np.nan, np.float32), y_test=labels(2)),
        "x_test contains NaN",
    ),
    "negative test label": (
        npz(x=images(5), y=labels(5), x_test=images(2), y_test=np.array([0, -3])),
        "Labels must be >= 0",
    ),
    "one sample, no test split": (npz(x=images(1), y=np.array([1])), "at least 2 samples"),
}


@pytest.mark.parametrize("case", list(BAD_UPLOADS))
def test_bad_upload_is_refused_and_stores_nothing(owner: User, case: str) -> None:
    data, message = BAD_UPLOADS[case]
    with pytest.raises(DatasetError, match=re.escape(message)):
        dataset_create_from_npz(owner=owner, name=case, data=data)
    assert Dataset.objects.count() == 0
    assert DatasetShard.objects.count() == 0
    assert UNPICKLED == []


def test_corrupt_npy_member_is_refused(owner: User) -> None:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("x.npy", b"\x93NUMPY garbage")
        archive.writestr("y.npy", b"not numpy at all")
    with pytest.raises(DatasetError, match="Cannot read the .npz file"):
        dataset_create_from_npz(owner=owner, name="corrupt", data=buffer.getvalue())
    assert Dataset.objects.count() == 0


def test_size_limit_is_checked_before_parsing(owner: User, settings: Any) -> None:
    settings.CROWDTRAIN = {**settings.CROWDTRAIN, "MAX_DATASET_BYTES": 100}
    with pytest.raises(DatasetError, match="the limit is 100 bytes"):
        dataset_create_from_npz(owner=owner, name="big", data=b"x" * 101)
    assert Dataset.objects.count() == 0


def test_uncompressed_size_is_limited_too(owner: User, settings: Any) -> None:
    data = npz(compressed=True, x=np.zeros((1000, 100), np.float32), y=labels(1000))
    settings.CROWDTRAIN = {**settings.CROWDTRAIN, "MAX_DATASET_BYTES": len(data) + 10}
    with pytest.raises(DatasetError, match="Uncompressed"):
        dataset_create_from_npz(owner=owner, name="bomb", data=data)
    assert Dataset.objects.count() == 0


def test_good_upload_is_sharded_and_round_trips(owner: User, small_shards: int) -> None:
    x, y = images(10), labels(10)
    x_test, y_test = images(3, seed=1), np.array([2, 0, 4])
    dataset = dataset_create_from_npz(
        owner=owner, name="tiny", data=npz(x=x, y=y, x_test=x_test, y_test=y_test)
    )

    assert (dataset.owner, dataset.name, dataset.input_shape) == (owner, "tiny", [1, 2, 2])
    assert (dataset.num_classes, dataset.train_samples, dataset.test_samples) == (5, 10, 3)
    shards = list(dataset.shards.order_by("split", "index").values_list("split", "index", "count"))
    assert shards == [("test", 0, 3), ("train", 0, 4), ("train", 1, 4), ("train", 2, 2)]

    first = safetensors_load(dataset.shards.get(split="train", index=1).blob.read())
    assert first["x"].dtype == np.float32 and first["x"].shape == (4, 1, 2, 2)
    assert first["y"].dtype == np.int32 and first["y"].tolist() == y[4:8].tolist()

    train_x, train_y = dataset_load_split(dataset=dataset, split="train")
    test_x, test_y = dataset_load_split(dataset=dataset, split="test")
    np.testing.assert_array_equal(train_x, x)
    np.testing.assert_array_equal(train_y, y)
    np.testing.assert_array_equal(test_x, x_test)
    assert test_y.dtype == np.int32 and test_y.tolist() == [2, 0, 4]


def test_uint8_is_converted_to_float32_without_scaling(owner: User) -> None:
    x = np.array([[0, 128, 255], [1, 2, 3]], dtype=np.uint8)
    dataset = dataset_create_from_npz(
        owner=owner,
        name="bytes",
        data=npz(compressed=True, x=x, y=np.array([0, 1], np.uint8), x_test=x, y_test=np.array([1, 0])),
    )
    train_x, train_y = dataset_load_split(dataset=dataset, split="train")
    assert train_x.dtype == np.float32 and train_x.tolist() == [[0.0, 128.0, 255.0], [1.0, 2.0, 3.0]]
    assert train_y.tolist() == [0, 1]


def test_without_test_split_the_last_tenth_is_held_out(owner: User, small_shards: int) -> None:
    x, y = images(25).astype(np.float64), labels(25)
    dataset = dataset_create_from_npz(owner=owner, name="holdout", data=npz(x=x, y=y))

    assert (dataset.train_samples, dataset.test_samples, dataset.num_classes) == (23, 2, 3)
    assert dataset.shards.filter(split="train").count() == 6
    test_x, test_y = dataset_load_split(dataset=dataset, split="test")
    np.testing.assert_array_equal(test_x, x[23:].astype(np.float32))
    assert test_y.tolist() == y[23:].tolist()


def test_identical_shards_share_blobs(owner: User) -> None:
    data = npz(x=images(6), y=labels(6), x_test=images(2), y_test=labels(2))
    first = dataset_create_from_npz(owner=owner, name="one", data=data)
    second = dataset_create_from_npz(owner=owner, name="two", data=data)

    assert first.pk != second.pk
    assert set(first.shards.values_list("blob", flat=True)) == set(
        second.shards.values_list("blob", flat=True)
    )
    assert Blob.objects.count() == 2
