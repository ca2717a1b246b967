"""Dataset uploads (.npz): every bad file is refused with a clear message and stores nothing; good ones shard,
class labels and float targets alike, read a chunk at a time."""

from __future__ import annotations

import io
import re
import tempfile
import zipfile
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from django.contrib.auth.models import User
from safetensors.numpy import load as safetensors_load

from engine.export import export_module
from projects import datasets
from projects.datasets import DatasetError, dataset_create_from_npz, dataset_load_split
from projects.forms import preset_mismatch
from projects.models import Blob, Dataset, DatasetShard, Project
from projects.services import ProjectError, project_create, project_create_from_graph, version_evaluate

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
    "y bool": (npz(x=images(5), y=np.ones(5, bool)), "integer class labels, or float targets"),
    "y two-dimensional": (npz(x=images(5), y=labels(10).reshape(5, 2)), "integer class labels"),
    "float y without values": (npz(x=images(5), y=np.ones((5, 0), np.float32)), "float targets of shape"),
    "NaN targets": (npz(x=images(2), y=np.array([[0.5], [np.nan]], np.float32)), "y contains NaN"),
    "infinite test targets": (
        npz(x=images(3), y=np.ones((3, 2)), x_test=images(2), y_test=np.array([[1.0, np.inf], [0, 0]])),
        "y_test contains NaN or infinite",
    ),
    "float64 targets beyond float32": (npz(x=images(2), y=np.array([1e300, 1.0])), "y contains NaN"),
    "targets length mismatch": (npz(x=images(5), y=np.ones((4, 2))), "x has 5 samples but y has 4 targets"),
    "float y, integer y_test": (
        npz(x=images(3), y=np.ones(3), x_test=images(2), y_test=labels(2)),
        "y and y_test must both hold integer class labels or both float targets",
    ),
    "mismatched target shapes": (
        npz(x=images(3), y=np.ones((3, 2)), x_test=images(2), y_test=np.ones((2, 3))),
        "y_test targets have shape [3], but y targets have shape [2]",
    ),
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


def test_a_slice_longer_than_its_shard_reads_on_into_the_next_ones(owner: User, small_shards: int) -> None:
    x, y = images(10), labels(10)
    dataset = dataset_create_from_npz(
        owner=owner, name="tiny", data=npz(x=x, y=y, x_test=x[:2], y_test=y[:2])
    )
    first = dataset.shards.get(split="train", index=0)

    slices = datasets.shard_slices(first=first, offset=3, count=6)
    assert [(s.shard.index, s.offset, s.count) for s in slices] == [(0, 3, 1), (1, 0, 4), (2, 0, 1)]
    got_x, got_y = datasets.slices_load(slices)
    np.testing.assert_array_equal(got_x, x[3:9])
    np.testing.assert_array_equal(got_y, y[3:9])
    assert datasets.shard_slices(first=first, offset=1, count=3) == [datasets.ShardSlice(first, 1, 3)]

    assert [(s.index, o) for s, o in [datasets.shard_position(first=first, offset=o) for o in (3, 4, 9)]] == [
        (0, 3),
        (1, 0),
        (2, 1),
    ]
    # On from the split's start past its end, as the unit reads (a split of a unit that wraps raised).
    second = dataset.shards.get(split="train", index=1)
    positions = [datasets.shard_position(first=second, offset=o) for o in (6, 7, 9, 10, 13)]
    assert [(s.index, o) for s, o in positions] == [(0, 0), (0, 1), (0, 3), (1, 0), (1, 3)]
    wrapped = datasets.shard_slices(first=first, offset=3, count=10)  # on from the split's start
    assert [(s.shard.index, s.offset, s.count) for s in wrapped] == [
        (0, 3, 1),
        (1, 0, 4),
        (2, 0, 2),
        (0, 0, 3),
    ]
    np.testing.assert_array_equal(datasets.slices_load(wrapped)[0], np.concatenate([x[3:], x[:3]]))
    with pytest.raises(DatasetError, match="more than the split holds"):
        datasets.shard_slices(first=first, offset=3, count=11)


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


# --- float targets (regression, dense outputs) ---------------------------------------------------


def test_float_targets_make_a_dataset_without_classes(owner: User, small_shards: int) -> None:
    x, y = images(10), np.random.default_rng(2).normal(size=(10, 3, 2)).astype(np.float64)
    dataset = dataset_create_from_npz(owner=owner, name="dense", data=npz(x=x, y=y))

    assert (dataset.kind, dataset.num_classes, dataset.target_shape) == ("regression", 0, [3, 2])
    assert (dataset.train_samples, dataset.test_samples, dataset.labels) == (9, 1, [])
    first = safetensors_load(dataset.shards.get(split="train", index=0).blob.read())
    assert first["y"].dtype == np.float32 and first["y"].shape == (4, 3, 2)
    train_y = dataset_load_split(dataset=dataset, split="train")[1]
    np.testing.assert_array_equal(train_y, y[:9].astype(np.float32))


def regression_dataset(owner: User) -> Dataset:
    x, y = images(20), np.random.default_rng(3).random((20, 2), dtype=np.float32)
    return dataset_create_from_npz(owner=owner, name="points", data=npz(x=x, y=y))


FLAT = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 2))
GRAPHS_ON_FLOAT_TARGETS: dict[str, tuple[Callable[[], Any], str | None]] = {
    "mse on [2] outputs": (lambda: export_module(FLAT, (1, 2, 2), loss="mse"), None),
    "l1 on [2] outputs": (lambda: export_module(FLAT, (1, 2, 2), loss="l1"), None),
    "a classifier": (
        lambda: export_module(FLAT, (1, 2, 2)),
        "The dataset has float targets and no classes: the graph needs an mse or l1 loss",
    ),
    "mse on [3] outputs": (
        lambda: export_module(
            torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 3)), (1, 2, 2), loss="mse"
        ),
        "float32 targets of shape [-1, 2]",
    ),
}


@pytest.mark.parametrize("case", list(GRAPHS_ON_FLOAT_TARGETS))
def test_only_regression_losses_fit_float_targets(owner: User, case: str) -> None:
    make, expected = GRAPHS_ON_FLOAT_TARGETS[case]
    graph, weights = make()
    dataset = regression_dataset(owner)
    if expected is None:
        project = project_create_from_graph(
            owner=owner, name=case, dataset=dataset, graph_dict=graph, weights=weights
        )
        metrics = version_evaluate(version_id=project.current_version().pk)
        assert set(metrics) == {"test_loss"} and metrics["test_loss"] > 0  # no accuracy without classes
        return
    with pytest.raises(ProjectError, match=re.escape(expected)):
        project_create_from_graph(owner=owner, name=case, dataset=dataset, graph_dict=graph, weights=weights)
    assert not Project.objects.exists()


def test_presets_do_not_fit_float_targets(owner: User) -> None:
    x, y = np.zeros((4, 1, 28, 28), np.float32), np.ones((4, 10), np.float32)
    dataset = dataset_create_from_npz(owner=owner, name="28x28 points", data=npz(x=x, y=y))
    with pytest.raises(ProjectError, match="needs an mse or l1 loss"):
        project_create(owner=owner, name="cnn", dataset=dataset, preset="cnn")
    assert preset_mismatch(preset="cnn", input_shape=[1, 2, 2], num_classes=0, kind="regression") == (
        "The cnn preset needs one class label per sample; the dataset has float targets (a model with an mse "
        "or l1 loss fits them: upload one)."
    )


def test_a_class_dataset_refuses_a_regression_graph(owner: User) -> None:
    dataset = dataset_create_from_npz(owner=owner, name="labels", data=npz(x=images(6), y=labels(6)))
    graph, weights = export_module(FLAT, (1, 2, 2), loss="mse")
    with pytest.raises(ProjectError, match="needs a cross_entropy loss on one class label per sample"):
        project_create_from_graph(owner=owner, name="reg", dataset=dataset, graph_dict=graph, weights=weights)


# --- streaming ------------------------------------------------------------------------------------


def test_arrays_are_read_a_chunk_at_a_time_across_splits(
    owner: User, monkeypatch: Any, small_shards: int
) -> None:
    """Chunks of 3 rows (a 48-byte READ_CHUNK over 16-byte rows) that straddle the held-out boundary,
    and a Fortran-ordered x, which is read whole: the stored samples are exactly the file's."""
    monkeypatch.setattr(datasets, "READ_CHUNK", 48)
    x = np.asfortranarray(np.arange(25 * 4, dtype=np.float32).reshape(25, 4))
    y = labels(25)
    for name, data in (
        ("c-order", npz(x=np.ascontiguousarray(x), y=y)),
        ("fortran", npz(compressed=True, x=x, y=y)),
    ):
        dataset = dataset_create_from_npz(owner=owner, name=name, data=data)
        train_x, train_y = dataset_load_split(dataset=dataset, split="train")
        test_x, test_y = dataset_load_split(dataset=dataset, split="test")
        np.testing.assert_array_equal(np.concatenate([train_x, test_x]), x)
        assert np.concatenate([train_y, test_y]).tolist() == y.tolist() and len(test_y) == 2


def test_a_label_out_of_range_in_a_late_chunk_is_found(owner: User, monkeypatch: Any) -> None:
    monkeypatch.setattr(datasets, "READ_CHUNK", 16)
    y = labels(40)
    y[37] = -2
    with pytest.raises(DatasetError, match="Labels must be >= 0; found -2"):
        dataset_create_from_npz(owner=owner, name="late", data=npz(x=images(40), y=y))
    assert Dataset.objects.count() == 0


def test_staging_is_removed_once_stored_or_refused(owner: User, tmp_path: Any, monkeypatch: Any) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dataset_create_from_npz(owner=owner, name="ok", data=npz(x=images(5), y=labels(5)))
    with pytest.raises(DatasetError):
        dataset_create_from_npz(owner=owner, name="bad", data=npz(x=images(5), y=-labels(5)))
    assert list(tmp_path.iterdir()) == []
