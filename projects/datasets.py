"""Datasets: validate an uploaded .npz and store it as immutable safetensors shards.

Upload format: an .npz (numpy.savez / savez_compressed) holding
- `x`: float32, float64 or uint8 samples, shape [n, ...]. Converted to float32 *as is* (uint8 pixels stay
  0..255; scaling, if wanted, belongs in the model or in the file).
- `y`: integer class labels, shape [n], within [0, num_classes) where num_classes = max label + 1 (>= 2).
- optional `x_test`, `y_test` (both or neither): the same rules; without them the last 10% of the
  training samples are held out as the test split.

The file is read with numpy's `allow_pickle=False`: object arrays are rejected, nothing is ever unpickled.
Each shard is a safetensors file with `x` (float32 [count, ...]) and `y` (int32 [count]).
"""

from __future__ import annotations

import io
import zipfile
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from django.conf import settings
from django.contrib.auth.models import User
from django.db import transaction
from safetensors.numpy import load as safetensors_load
from safetensors.numpy import save as safetensors_save

from projects.blobs import blob_put
from projects.models import Blob, Dataset, DatasetShard

ALLOWED_KEYS = ("x", "y", "x_test", "y_test")
X_DTYPES = (np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.uint8))
MAX_CLASSES = 100_000
HOLDOUT_FRACTION = 10  # without a test split, 1/10 of the samples (the last ones) become the test split


class DatasetError(ValueError):
    """The uploaded dataset is unusable; the message says why, in words a researcher understands."""


@dataclass(frozen=True)
class ParsedDataset:
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int

    @property
    def input_shape(self) -> list[int]:
        return [int(dim) for dim in self.x_train.shape[1:]]


def dataset_create_from_npz(*, owner: User, name: str, data: bytes) -> Dataset:
    """Validate an .npz upload and store it; raises DatasetError and stores nothing if it is bad."""
    return dataset_create(owner=owner, name=name, parsed=dataset_parse_npz(data=data))


def dataset_parse_npz(*, data: bytes) -> ParsedDataset:
    """Check everything about an upload without saving anything (forms call this in clean())."""
    arrays = _read_npz(data)
    x_train, y_train = _check_split(arrays["x"], arrays["y"], split="train")
    if ("x_test" in arrays) != ("y_test" in arrays):
        raise DatasetError("Provide both x_test and y_test, or neither.")
    if "x_test" in arrays:
        x_test, y_test = _check_split(arrays["x_test"], arrays["y_test"], split="test")
        _check_same_sample_shape(x_train, x_test)
    else:
        x_train, y_train, x_test, y_test = _hold_out(x_train, y_train)
    num_classes = _num_classes(y_train, y_test)
    return ParsedDataset(x_train, y_train.astype(np.int32), x_test, y_test.astype(np.int32), num_classes)


@transaction.atomic
def dataset_create(*, owner: User, name: str, parsed: ParsedDataset) -> Dataset:
    """Store a validated dataset: one Dataset row, one blob and one DatasetShard row per shard."""
    dataset = Dataset.objects.create(
        owner=owner,
        name=name,
        input_shape=parsed.input_shape,
        num_classes=parsed.num_classes,
        train_samples=len(parsed.x_train),
        test_samples=len(parsed.x_test),
    )
    _store_shards(dataset=dataset, split=DatasetShard.Split.TRAIN, x=parsed.x_train, y=parsed.y_train)
    _store_shards(dataset=dataset, split=DatasetShard.Split.TEST, x=parsed.x_test, y=parsed.y_test)
    return dataset


def dataset_load_split(*, dataset: Dataset, split: str) -> tuple[np.ndarray, np.ndarray]:
    """All samples of one split, shards concatenated in order: (x float32 [n, ...], y int32 [n])."""
    shards = [shard_load(shard=shard) for shard in dataset.shards.filter(split=split).select_related("blob")]
    if not shards:
        raise DatasetError(f"Dataset {dataset.pk} has no {split} shards.")
    return np.concatenate([x for x, _ in shards]), np.concatenate([y for _, y in shards])


def shard_load(*, shard: DatasetShard) -> tuple[np.ndarray, np.ndarray]:
    """A shard's arrays, read-only: they are cached, since every spot check of a work unit needs its shard."""
    return _shard_arrays(shard.blob)


@lru_cache(maxsize=8)
def _shard_arrays(blob: Blob) -> tuple[np.ndarray, np.ndarray]:
    tensors = safetensors_load(blob.read())
    for array in tensors.values():
        array.flags.writeable = False
    return tensors["x"], tensors["y"]


def _store_shards(*, dataset: Dataset, split: str, x: np.ndarray, y: np.ndarray) -> None:
    size = settings.CROWDTRAIN["SHARD_SAMPLES"]
    for index, start in enumerate(range(0, len(x), size)):
        window = slice(start, start + size)
        tensors = {"x": np.ascontiguousarray(x[window]), "y": np.ascontiguousarray(y[window])}
        blob = blob_put(data=safetensors_save(tensors, metadata={"format": "crowdtrain.shard"}))
        DatasetShard.objects.create(
            dataset=dataset, split=split, index=index, count=len(tensors["y"]), blob=blob
        )


def _read_npz(data: bytes) -> dict[str, np.ndarray]:
    limit = settings.CROWDTRAIN["MAX_DATASET_BYTES"]
    if len(data) > limit:
        raise DatasetError(f"The file is {len(data):,} bytes; the limit is {limit:,} bytes.")
    if not zipfile.is_zipfile(io.BytesIO(data)):
        raise DatasetError("This is not an .npz file (numpy.savez / numpy.savez_compressed).")
    try:
        _check_zip_members(zipfile.ZipFile(io.BytesIO(data)), limit)
        with np.load(io.BytesIO(data), allow_pickle=False) as npz:
            return {key: npz[key] for key in npz.files}
    except DatasetError:
        raise
    except ValueError as exc:  # numpy's message for object arrays mentions allow_pickle
        raise DatasetError(_load_error_message(exc)) from exc
    except (OSError, EOFError, zipfile.BadZipFile) as exc:
        raise DatasetError(f"The .npz file is damaged: {exc}") from exc


def _check_zip_members(archive: zipfile.ZipFile, limit: int) -> None:
    keys = {info.filename.removesuffix(".npy") for info in archive.infolist()}
    unexpected = sorted(keys - set(ALLOWED_KEYS))
    if unexpected:
        raise DatasetError(f"Unexpected arrays {', '.join(unexpected)}; allowed: {', '.join(ALLOWED_KEYS)}.")
    for required in ("x", "y"):
        if required not in keys:
            raise DatasetError(f"The .npz file has no array named '{required}'.")
    if sum(info.file_size for info in archive.infolist()) > limit:
        raise DatasetError(f"Uncompressed, the arrays are larger than the limit of {limit:,} bytes.")


def _load_error_message(exc: ValueError) -> str:
    if "allow_pickle" in str(exc) or "pickle" in str(exc).lower():
        return "The .npz contains object (pickled) arrays; only plain numeric arrays are accepted."
    return f"Cannot read the .npz file: {exc}"


def _check_split(x: np.ndarray, y: np.ndarray, *, split: str) -> tuple[np.ndarray, np.ndarray]:
    x_name, y_name = ("x", "y") if split == "train" else ("x_test", "y_test")
    if x.dtype not in X_DTYPES:
        raise DatasetError(f"{x_name} has dtype {x.dtype}; use float32, float64 or uint8.")
    if x.ndim < 2 or x.shape[0] < 1 or 0 in x.shape:
        raise DatasetError(
            f"{x_name} must have shape [samples, ...] with at least one sample; got {list(x.shape)}."
        )
    if y.dtype.kind not in "iu" or y.ndim != 1:
        raise DatasetError(
            f"{y_name} must be a 1-D array of integer class labels; got {y.dtype} {list(y.shape)}."
        )
    if len(y) != len(x):
        raise DatasetError(f"{x_name} has {len(x)} samples but {y_name} has {len(y)} labels.")
    with np.errstate(over="ignore"):  # float64 beyond float32's range becomes inf, rejected just below
        x32 = x.astype(np.float32)
    if not np.isfinite(x32).all():
        raise DatasetError(f"{x_name} contains NaN or infinite values (after conversion to float32).")
    return x32, y


def _check_same_sample_shape(x_train: np.ndarray, x_test: np.ndarray) -> None:
    if x_train.shape[1:] != x_test.shape[1:]:
        raise DatasetError(
            f"x_test samples have shape {list(x_test.shape[1:])}, "
            f"but x samples have shape {list(x_train.shape[1:])}."
        )


def _hold_out(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    if len(x) < 2:
        raise DatasetError(
            "Without x_test/y_test at least 2 samples are needed (10% are held out for testing)."
        )
    n_train = len(x) - max(1, len(x) // HOLDOUT_FRACTION)
    return x[:n_train], y[:n_train], x[n_train:], y[n_train:]


def _num_classes(y_train: np.ndarray, y_test: np.ndarray) -> int:
    labels = np.concatenate([y_train.astype(np.int64), y_test.astype(np.int64)])
    if labels.min() < 0:
        raise DatasetError(f"Labels must be >= 0; found {labels.min()}.")
    num_classes = int(labels.max()) + 1
    if num_classes < 2:
        raise DatasetError("Labels must cover at least 2 classes (0 and 1).")
    if num_classes > MAX_CLASSES:
        raise DatasetError(f"Labels go up to {num_classes - 1}; at most {MAX_CLASSES} classes are supported.")
    return num_classes
