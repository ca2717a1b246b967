"""Datasets: validate an uploaded .npz and store it as immutable safetensors shards.

Upload format: an .npz (numpy.savez / savez_compressed) holding
- `x`: float32, float64 or uint8 samples, shape [n, ...]. Converted to float32 *as is* (uint8 pixels stay
  0..255; scaling, if wanted, belongs in the model or in the file).
- `y`: integer class labels, shape [n], within [0, num_classes) where num_classes = max label + 1 (>= 2).
- optional `x_test`, `y_test` (both or neither): the same rules; without them the last 10% of the
  training samples are held out as the test split.

Nothing is ever unpickled, and a hostile file costs bounded memory: the zip's directory (its size, member
count, and declared uncompressed sizes against an absolute limit and a compression ratio) and every
member's .npy header (version, numeric dtype, shape, and exactly as many bytes as the shape needs, also
bounded as float32) are checked before any array is allocated; members are then inflated in bounded chunks
and never beyond their declared size (a lying directory ends in a CRC error).
Each shard is a safetensors file with `x` (float32 [count, ...]) and `y` (int32 [count]).
"""

from __future__ import annotations

import io
import math
import struct
import zipfile
from dataclasses import dataclass
from functools import lru_cache
from typing import IO, Any

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
MAX_NPY_HEADER = 10_000  # numpy's own default; a header describes one plain array
MAX_DIRECTORY = 64 * 1024  # zip central directory bytes: a few members need a few hundred
READ_CHUNK = 1 << 20
# Small files may compress well (zeros, padding) without being a threat: only inflation beyond this is
# held to the compression ratio.
INFLATION_FLOOR = 32 * 2**20
NPY_READERS = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
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


Source = bytes | IO[bytes]


def dataset_create_from_npz(*, owner: User, name: str, data: Source) -> Dataset:
    """Validate an .npz upload and store it; raises DatasetError and stores nothing if it is bad."""
    return dataset_create(owner=owner, name=name, parsed=dataset_parse_npz(data=data))


def dataset_parse_npz(*, data: Source) -> ParsedDataset:
    """Check everything about an upload without saving anything (forms call this in clean()).

    `data` is the file's bytes or a seekable binary file (an upload spooled to disk is read from there).
    """
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


def _read_npz(data: Source) -> dict[str, np.ndarray]:
    fileobj = io.BytesIO(data) if isinstance(data, (bytes, bytearray)) else data
    size = _check_file(fileobj)
    try:
        with zipfile.ZipFile(fileobj) as archive:
            members = _check_zip_members(archive, size)
            headers = {key: _read_npy_header(archive, info, key) for key, info in members.items()}
            _check_array_bytes(headers)
            return {key: _read_member(archive, members[key], headers[key]) for key in members}
    except DatasetError:
        raise
    except (
        zipfile.BadZipFile,
        OSError,
        EOFError,
        RuntimeError,
        NotImplementedError,
        ValueError,
        struct.error,
        OverflowError,
    ) as exc:  # RuntimeError: encrypted; NotImplementedError: method
        raise DatasetError(f"The .npz file is damaged: {str(exc)[:200]}") from exc


def _check_file(fileobj: IO[bytes]) -> int:
    """The file's size, after the checks that need no parsing: the size limit, and a zip directory small
    enough for a handful of members (zipfile would otherwise build an object per listed entry)."""
    size = fileobj.seek(0, io.SEEK_END)
    limit = settings.CROWDTRAIN["MAX_DATASET_BYTES"]
    if size > limit:
        raise DatasetError(f"The file is {size:,} bytes; the limit is {limit:,} bytes.")
    fileobj.seek(max(0, size - 22 - 0xFFFF))  # the end record and its comment of at most 64 KiB
    tail = fileobj.read()
    end = tail.rfind(b"PK\x05\x06")
    if end < 0 or len(tail) < end + 22:
        raise DatasetError("This is not an .npz file (numpy.savez / numpy.savez_compressed).")
    if struct.unpack_from("<I", tail, end + 12)[0] > MAX_DIRECTORY:
        raise DatasetError("The .npz file lists far too many members; allowed: x, y, x_test, y_test.")
    fileobj.seek(0)
    return size


def _check_zip_members(archive: zipfile.ZipFile, size: int) -> dict[str, zipfile.ZipInfo]:
    infos = archive.infolist()
    keys = [info.filename.removesuffix(".npy") for info in infos]
    unexpected = sorted(set(keys) - set(ALLOWED_KEYS))
    if unexpected:
        shown = ", ".join(name[:50] for name in unexpected[:5])
        raise DatasetError(f"Unexpected arrays {shown}; allowed: {', '.join(ALLOWED_KEYS)}.")
    if len(set(keys)) != len(keys):
        raise DatasetError("The .npz file holds an array more than once.")
    for required in ("x", "y"):
        if required not in keys:
            raise DatasetError(f"The .npz file has no array named '{required}'.")
    _check_inflation(sum(info.file_size for info in infos), size)
    return dict(zip(keys, infos, strict=True))


def _check_inflation(total: int, size: int) -> None:
    """Zip bombs are refused from the directory's declared sizes, before anything is inflated."""
    limits = settings.CROWDTRAIN
    if total > limits["MAX_DATASET_BYTES"]:
        raise DatasetError(
            f"Uncompressed, the arrays are larger than the limit of {limits['MAX_DATASET_BYTES']:,} bytes."
        )
    ratio = limits["MAX_DATASET_COMPRESSION_RATIO"]
    if total > max(INFLATION_FLOOR, ratio * size):
        raise DatasetError(
            f"Uncompressed, the arrays are {total:,} bytes: over {ratio} times the {size:,} bytes of the "
            "compressed file. Refused as a possible zip bomb."
        )


@dataclass(frozen=True)
class NpyHeader:
    dtype: np.dtype[Any]
    shape: tuple[int, ...]
    fortran: bool
    offset: int  # where the data starts in the member


def _read_npy_header(archive: zipfile.ZipFile, info: zipfile.ZipInfo, key: str) -> NpyHeader:
    with archive.open(info) as member:
        try:
            version = np.lib.format.read_magic(member)
            if version not in NPY_READERS:
                raise ValueError(f"unsupported .npy version {version}")
            shape, fortran, dtype = NPY_READERS[version](member, max_header_size=MAX_NPY_HEADER)
        except (ValueError, SyntaxError, TypeError, RecursionError, MemoryError, OverflowError) as exc:
            raise DatasetError(f"Cannot read the .npz file: {info.filename}: {str(exc)[:200]}") from None
        header = NpyHeader(dtype, shape, bool(fortran), member.tell())
    _check_npy_dtype(dtype, key)
    _check_npy_size(header, info)
    return header


def _check_array_bytes(headers: dict[str, NpyHeader]) -> None:
    """What the arrays become once stored (float32 samples, int32 labels) is bounded before reading."""
    limit = settings.CROWDTRAIN["MAX_DATASET_ARRAY_BYTES"]
    total = sum(4 * math.prod(header.shape) for header in headers.values())
    if total > limit:
        raise DatasetError(f"As float32, the arrays take {total:,} bytes; the limit is {limit:,} bytes.")


def _read_member(archive: zipfile.ZipFile, info: zipfile.ZipInfo, header: NpyHeader) -> np.ndarray:
    """The member's data, inflated in chunks straight into its array, never past the declared size."""
    flat = np.empty(math.prod(header.shape), header.dtype)
    with archive.open(info) as member:
        member.read(header.offset)
        _read_exactly(member, flat.view(np.uint8), info.filename)
    return flat.reshape(header.shape, order="F" if header.fortran else "C")


def _check_npy_dtype(dtype: np.dtype[Any], key: str) -> None:
    if dtype.hasobject:
        raise DatasetError(
            "The .npz contains object (pickled) arrays; only plain numeric arrays are accepted."
        )
    if dtype.fields is not None or dtype.subdtype is not None or dtype.kind not in "biuf":
        raise DatasetError(f"{key} has dtype {dtype}; use plain numeric arrays.")


def _check_npy_size(header: NpyHeader, info: zipfile.ZipInfo) -> None:
    """The shape must describe exactly the member's declared data: a header that promises terabytes in a
    few bytes is refused here, before anything is allocated."""
    shape, data = header.shape, info.file_size - header.offset
    declared = math.prod(shape) * header.dtype.itemsize if all(d >= 0 for d in shape) else -1
    if declared != data:
        raise DatasetError(
            f"{info.filename} declares shape {list(shape)} of {header.dtype} ({declared:,} bytes) but "
            f"holds {data:,} bytes of data."
        )


def _read_exactly(member: IO[bytes], out: np.ndarray, name: str) -> None:
    position = 0
    while position < len(out):
        chunk = member.read(min(READ_CHUNK, len(out) - position))
        if not chunk:
            raise DatasetError(f"{name} is truncated.")
        out[position : position + len(chunk)] = np.frombuffer(chunk, np.uint8)
        position += len(chunk)


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
        x32 = x.astype(np.float32, copy=False)
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
