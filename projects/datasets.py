"""Datasets: validate an upload and store it as immutable safetensors shards.

Three upload formats, each parsed into the same staged arrays (a ParsedDataset), then stored shard by shard:

- `.npz` (numpy.savez / savez_compressed) holding `x`: float32, float64 or uint8 samples, shape [n, ...],
  converted to float32 *as is* (uint8 pixels stay 0..255); `y`: either integer class labels, shape [n],
  within [0, num_classes) where num_classes = max label + 1 (>= 2), or float targets of any shape [n, ...]
  (regression and dense outputs: the dataset then has no classes, and only mse or l1 losses fit it); optional
  `x_test`, `y_test` (both or neither), by the same rules. Without them the last 10% of the samples are held
  out as the test split.
- a `.zip` of image folders in torchvision's ImageFolder layout: `train/<class>/<image>` and optionally
  `test/<class>/<image>`, or only `<class>/<image>` (then a seeded tenth of the images is held out). PNG or
  JPEG, decoded with Pillow, resized to one declared [channels, height, width] and scaled to float32 in
  [0, 1]; classes are the folder names, sorted. Samples are shuffled (seed 0): work units walk the training
  split in order, and a split in folder order would hand out one class at a time.
- a UTF-8 `.txt` corpus for character- or byte-level language models: samples x [n, T] and y [n, T] (the
  next token at each position), cut from the text without overlap; the vocabulary is the 256 byte values or
  the corpus's distinct characters (kept in Dataset.labels, sorted by code point); the last 10% of the text
  is the test split.

Nothing is ever unpickled or executed, and a hostile file costs bounded memory: zip directories (size, member
count, declared sizes against an absolute limit and a compression ratio), .npy headers (version, numeric
dtype, exact byte count) and image headers (size before decoding, mode, format) are checked before anything
is allocated. Uploads are read where Django put them (on disk above FILE_UPLOAD_MAX_MEMORY_SIZE) in chunks of
about a megabyte and written, converted, to a temporary staging directory; shards are then written one at a
time. Whatever the file's size, memory holds about one chunk and one shard.
Each shard is a safetensors file with `x` (float32 [count, ...], int32 token ids for text) and `y` (int32
labels or tokens, float32 targets).
"""

from __future__ import annotations

import codecs
import io
import math
import shutil
import struct
import tempfile
import warnings
import weakref
import zipfile
from collections.abc import Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import IO, Any

import numpy as np
from django.conf import settings
from django.contrib.auth.models import User
from django.db import transaction
from PIL import Image
from safetensors.numpy import load as safetensors_load
from safetensors.numpy import save as safetensors_save

from projects.blobs import blob_put
from projects.models import Blob, Dataset, DatasetShard, WorkUnit

Kind = Dataset.Kind
ALLOWED_KEYS = ("x", "y", "x_test", "y_test")
X_DTYPES = (np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.uint8))
MAX_CLASSES = 100_000
MAX_NPY_HEADER = 10_000  # numpy's own default; a header describes one plain array
MAX_DIRECTORY = 64 * 1024  # an .npz's zip central directory: a few members need a few hundred bytes
READ_CHUNK = 1 << 20
# Small files may compress well (zeros, padding) without being a threat: only inflation beyond this is
# held to the compression ratio.
INFLATION_FLOOR = 32 * 2**20
NPY_READERS = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
HOLDOUT_FRACTION = 10  # without a test split, 1/10 of the samples become the test split
ZIP_ERRORS = (
    zipfile.BadZipFile,
    OSError,
    EOFError,
    RuntimeError,  # encrypted members
    NotImplementedError,  # compression methods
    ValueError,
    struct.error,
    OverflowError,
)

MAX_IMAGE_SIDE = 1024  # of the declared sample shape
ZIP_ENTRY_BYTES = 300  # a central directory entry with a long path name
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
IMAGE_FORMATS = ("PNG", "JPEG")
IMAGE_MODES = ("1", "L", "LA", "P", "PA", "RGB", "RGBA")  # 8 bits per channel; alpha is dropped
IGNORED_NAMES = ("__MACOSX",)  # macOS's resource forks; hidden files (".DS_Store") are skipped too
IMAGE_CHUNK = 4 * 2**20  # bytes of decoded samples written to the staging directory at once
SPLITS = ("train", "test")

# Text corpora.
MAX_BLOCK_SIZE = 4096
TOKEN_BYTES = 8  # every token is stored twice, as int32: once in x and once (shifted) in y
VOCABULARIES = ("chars", "bytes")


class DatasetError(ValueError):
    """The uploaded dataset is unusable; the message says why, in words a researcher understands."""


Source = bytes | IO[bytes]


# --- staging: arrays written to disk in chunks, read back one shard at a time --------------------------


@dataclass(frozen=True)
class Column:
    """One staged array: raw C-order data of `dtype`, each sample of `shape`."""

    path: Path
    dtype: np.dtype[Any]
    shape: tuple[int, ...]

    def read(self, handle: IO[bytes], rows: int) -> np.ndarray:
        out = np.empty((rows, *self.shape), self.dtype)
        view, position = memoryview(out.reshape(-1).view(np.uint8)), 0  # type: ignore[arg-type]
        while position < len(view):
            got = handle.readinto(view[position:])  # type: ignore[attr-defined]
            if not got:
                raise DatasetError(f"The staged {self.path.name} is shorter than expected.")
            position += got
        return out


@dataclass(frozen=True)
class StagedSplit:
    x: Column
    y: Column
    count: int


class SplitWriter:
    """Appends samples of one split to its two staged files, converted to the stored dtypes."""

    def __init__(self, staging: Staging, split: str, x: Column, y: Column) -> None:
        self.x = Column(staging.path / f"{split}-x", x.dtype, x.shape)
        self.y = Column(staging.path / f"{split}-y", y.dtype, y.shape)
        self._x_file, self._y_file = staging.open(self.x.path), staging.open(self.y.path)
        self.count = 0

    def write(self, x: np.ndarray, y: np.ndarray) -> None:
        self._x_file.write(np.ascontiguousarray(x, self.x.dtype).tobytes())
        self._y_file.write(np.ascontiguousarray(y, self.y.dtype).tobytes())
        self.count += len(x)

    def close(self) -> StagedSplit:
        self._x_file.close()
        self._y_file.close()
        return StagedSplit(self.x, self.y, self.count)


def _spec(dtype: Any, shape: tuple[int, ...] | list[int]) -> Column:
    return Column(Path(), np.dtype(dtype), tuple(int(d) for d in shape))


@dataclass
class ParsedDataset:
    """A validated upload, staged on disk until dataset_create stores it (once: the staging is then gone)."""

    kind: str
    input_shape: list[int]
    target_shape: list[int]
    num_classes: int
    train: StagedSplit
    test: StagedSplit
    staging: Staging
    labels: list[str] = field(default_factory=list)

    @property
    def train_samples(self) -> int:
        return self.train.count

    @property
    def test_samples(self) -> int:
        return self.test.count

    def discard(self) -> None:
        self.staging.cleanup()


class Staging:
    """A temporary directory for staged arrays: removed by cleanup(), or silently once garbage collected (a
    form that failed on another field never stores its upload)."""

    def __init__(self) -> None:
        self.path = Path(tempfile.mkdtemp(prefix="crowdtrain-dataset-"))
        self._files: list[IO[bytes]] = []
        self._finalizer = weakref.finalize(self, shutil.rmtree, self.path, ignore_errors=True)

    def open(self, path: Path) -> IO[bytes]:
        """A file to write, closed by cleanup() if the parse fails before closing it."""
        self._files.append(path.open("wb"))
        return self._files[-1]

    def cleanup(self) -> None:
        for handle in self._files:
            handle.close()
        self._finalizer()


@contextmanager
def _staging() -> Iterator[Staging]:
    """A staging directory, removed at once if the upload turns out bad."""
    staging = Staging()
    try:
        yield staging
    except BaseException:
        staging.cleanup()
        raise


# --- storing --------------------------------------------------------------------------------------


def dataset_create_from_npz(*, owner: User, name: str, data: Source) -> Dataset:
    """Validate an .npz upload and store it; raises DatasetError and stores nothing if it is bad."""
    return dataset_create(owner=owner, name=name, parsed=dataset_parse_npz(data=data))


@transaction.atomic
def dataset_create(*, owner: User, name: str, parsed: ParsedDataset) -> Dataset:
    """Store a validated dataset: one Dataset row, then one blob and one DatasetShard row per shard,
    written one at a time from the staged arrays (which are removed afterwards)."""
    dataset = Dataset.objects.create(
        owner=owner,
        name=name,
        kind=parsed.kind,
        input_shape=parsed.input_shape,
        target_shape=parsed.target_shape,
        num_classes=parsed.num_classes,
        labels=parsed.labels,
        train_samples=parsed.train_samples,
        test_samples=parsed.test_samples,
    )
    try:
        _store_shards(dataset=dataset, split=DatasetShard.Split.TRAIN, staged=parsed.train)
        _store_shards(dataset=dataset, split=DatasetShard.Split.TEST, staged=parsed.test)
    finally:
        parsed.discard()
    return dataset


def dataset_delete(*, dataset: Dataset) -> None:
    """Delete a dataset no project uses (its shards' blobs are left to storage's sweep of unreferenced
    blobs); raises DatasetError if a project uses it."""
    with transaction.atomic():
        locked = Dataset.objects.select_for_update().get(pk=dataset.pk)
        if locked.projects.exists():
            names = ", ".join(sorted(locked.projects.values_list("name", flat=True))[:5])
            raise DatasetError(f"Projects use this dataset ({names}): delete them first.")
        locked.delete()


def dataset_load_split(*, dataset: Dataset, split: str) -> tuple[np.ndarray, np.ndarray]:
    """All samples of one split, shards concatenated in order: (x [n, ...], y [n, ...]) as stored."""
    shards = [shard_load(shard=shard) for shard in dataset.shards.filter(split=split).select_related("blob")]
    if not shards:
        raise DatasetError(f"Dataset {dataset.pk} has no {split} shards.")
    return np.concatenate([x for x, _ in shards]), np.concatenate([y for _, y in shards])


def shard_load(*, shard: DatasetShard) -> tuple[np.ndarray, np.ndarray]:
    """A shard's arrays, read-only: they are cached, since every spot check of a work unit needs its shard."""
    return _shard_arrays(shard.blob)


@dataclass(frozen=True)
class ShardSlice:
    """Samples [offset, offset + count) of one shard."""

    shard: DatasetShard
    offset: int
    count: int


def shard_slices(*, first: DatasetShard, offset: int, count: int) -> list[ShardSlice]:
    """`count` samples of `first`'s split from `offset` in `first` on: a work unit larger than what is left
    of its shard reads on into the following shards by index, and past the split's end from its start (as
    the data cursor wraps), so a unit's size is set by its device (time, memory, download) and never by how
    the dataset was cut (SHARD_SAMPLES): every unit costs a weights download and an update upload."""
    if offset + count <= first.count:
        return [ShardSlice(first, offset, count)]
    slices, left = [ShardSlice(first, offset, first.count - offset)], count - (first.count - offset)
    for shard in _reading_order(first=first)[1:]:
        slices.append(ShardSlice(shard, 0, min(left, shard.count)))
        left -= slices[-1].count
        if left <= 0:
            return slices
    if left > offset:
        raise DatasetError(f"{count:,} samples are more than the split holds.")
    return [*slices, ShardSlice(first, 0, left)]


def _reading_order(*, first: DatasetShard) -> list[DatasetShard]:
    """`first`'s split as a unit starting in `first` reads it: `first`, the shards after it by index, then
    those before it (past the split's end from its start)."""
    split = DatasetShard.objects.filter(dataset_id=first.dataset_id, split=first.split).select_related("blob")
    shards = list(split.order_by("index"))
    at = next(i for i, shard in enumerate(shards) if shard.pk == first.pk)
    return [*shards[at:], *shards[:at]]


def work_unit_slices(*, work_unit: WorkUnit) -> list[ShardSlice]:
    return shard_slices(first=work_unit.shard, offset=work_unit.offset, count=work_unit.count)


def shard_position(*, first: DatasetShard, offset: int) -> tuple[DatasetShard, int]:
    """The shard and offset of sample `offset` counted from the start of `first` (which it may pass), on from
    the split's start past its end, as a unit reads (shard_slices): a crowd averaging unit holding most of the
    split, split to fit a device past that end, raised "more than the split holds" instead."""
    if offset < first.count:
        return first, offset
    shards = _reading_order(first=first)
    offset %= sum(shard.count for shard in shards)
    for shard in shards:
        if offset < shard.count:
            return shard, offset
        offset -= shard.count
    raise AssertionError("unreachable: the offset was taken modulo the split's samples")


def slices_load(slices: list[ShardSlice]) -> tuple[np.ndarray, np.ndarray]:
    """The samples of `slices`, in order: (x, y), copies the caller owns."""
    parts = [(shard_load(shard=s.shard), slice(s.offset, s.offset + s.count)) for s in slices]
    return np.concatenate([x[window] for (x, _), window in parts]), np.concatenate(
        [y[window] for (_, y), window in parts]
    )


@lru_cache(maxsize=8)
def _shard_arrays(blob: Blob) -> tuple[np.ndarray, np.ndarray]:
    tensors = safetensors_load(blob.read())
    for array in tensors.values():
        array.flags.writeable = False
    return tensors["x"], tensors["y"]


def _store_shards(*, dataset: Dataset, split: str, staged: StagedSplit) -> None:
    size = settings.CROWDTRAIN["SHARD_SAMPLES"]
    with staged.x.path.open("rb") as x_file, staged.y.path.open("rb") as y_file:
        for index, start in enumerate(range(0, staged.count, size)):
            count = min(size, staged.count - start)
            tensors = {"x": staged.x.read(x_file, count), "y": staged.y.read(y_file, count)}
            blob = blob_put(data=safetensors_save(tensors, metadata={"format": "crowdtrain.shard"}))
            DatasetShard.objects.create(dataset=dataset, split=split, index=index, count=count, blob=blob)


# --- zip files ------------------------------------------------------------------------------------


def _fileobj(data: Source) -> IO[bytes]:
    return io.BytesIO(data) if isinstance(data, (bytes, bytearray)) else data


def _check_size(fileobj: IO[bytes]) -> int:
    size = fileobj.seek(0, io.SEEK_END)
    limit = settings.CROWDTRAIN["MAX_DATASET_BYTES"]
    if size > limit:
        raise DatasetError(f"The file is {size:,} bytes; the limit is {limit:,} bytes.")
    fileobj.seek(0)
    return size


def _check_zip_directory(fileobj: IO[bytes], *, not_zip: str, max_directory: int, too_many: str) -> int:
    """The file's size, after the checks that need no parsing: the size limit, and a zip directory small
    enough (zipfile would otherwise build an object per listed entry)."""
    size = _check_size(fileobj)
    fileobj.seek(max(0, size - 22 - 0xFFFF))  # the end record and its comment of at most 64 KiB
    tail = fileobj.read()
    end = tail.rfind(b"PK\x05\x06")
    if end < 0 or len(tail) < end + 22:
        raise DatasetError(not_zip)
    if struct.unpack_from("<I", tail, end + 12)[0] > max_directory:
        raise DatasetError(too_many)
    fileobj.seek(0)
    return size


@contextmanager
def _zip_errors(what: str) -> Iterator[None]:
    try:
        yield
    except DatasetError:
        raise
    except ZIP_ERRORS as exc:
        raise DatasetError(f"The {what} file is damaged: {str(exc)[:200]}") from exc


def _check_inflation(total: int, size: int, what: str = "arrays") -> None:
    """Zip bombs are refused from the directory's declared sizes, before anything is inflated."""
    limits = settings.CROWDTRAIN
    if total > limits["MAX_DATASET_BYTES"]:
        raise DatasetError(
            f"Uncompressed, the {what} are larger than the limit of {limits['MAX_DATASET_BYTES']:,} bytes."
        )
    ratio = limits["MAX_DATASET_COMPRESSION_RATIO"]
    if total > max(INFLATION_FLOOR, ratio * size):
        raise DatasetError(
            f"Uncompressed, the {what} are {total:,} bytes: over {ratio} times the {size:,} bytes of the "
            "compressed file. Refused as a possible zip bomb."
        )


def _check_stored_bytes(total: int) -> None:
    """What the arrays become once stored (float32 or int32) is bounded before anything is read."""
    limit = settings.CROWDTRAIN["MAX_DATASET_ARRAY_BYTES"]
    if total > limit:
        raise DatasetError(f"As stored, the arrays take {total:,} bytes; the limit is {limit:,} bytes.")


# --- .npz -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NpyHeader:
    dtype: np.dtype[Any]
    shape: tuple[int, ...]
    fortran: bool
    offset: int  # where the data starts in the member

    @property
    def row_bytes(self) -> int:
        return self.dtype.itemsize * math.prod(self.shape[1:])


@dataclass(frozen=True)
class Member:
    """One array of the .npz: its zip entry and .npy header."""

    key: str
    info: zipfile.ZipInfo
    header: NpyHeader


def dataset_parse_npz(*, data: Source) -> ParsedDataset:
    """Check everything about an .npz upload and stage it, without saving anything (forms call this in
    clean()). `data` is the file's bytes or a seekable binary file (an upload spooled to disk is read from
    there, a chunk at a time)."""
    fileobj = _fileobj(data)
    size = _check_zip_directory(
        fileobj,
        not_zip="This is not an .npz file (numpy.savez / numpy.savez_compressed).",
        max_directory=MAX_DIRECTORY,
        too_many="The .npz file lists far too many members; allowed: x, y, x_test, y_test.",
    )
    with _zip_errors(".npz"), zipfile.ZipFile(fileobj) as archive:
        infos = _check_zip_members(archive, size)
        members = {
            key: Member(key, info, _read_npy_header(archive, info, key)) for key, info in infos.items()
        }
        _check_stored_bytes(sum(4 * math.prod(m.header.shape) for m in members.values()))
        kind = _check_npz_shapes(members)
        with _staging() as staging:
            return _stage_npz(archive, members, kind, staging)


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


def _check_npz_shapes(members: dict[str, Member]) -> str:
    """Everything the headers alone tell: dtypes, shapes, lengths, both test arrays or neither. Returns the
    dataset's kind: class labels or float targets."""
    kind = _check_split_headers(members["x"], members["y"])
    if ("x_test" in members) != ("y_test" in members):
        raise DatasetError("Provide both x_test and y_test, or neither.")
    if "x_test" in members:
        test_kind = _check_split_headers(members["x_test"], members["y_test"])
        _check_same_shapes(members, kind, test_kind)
    elif members["x"].header.shape[0] < 2:
        raise DatasetError(
            "Without x_test/y_test at least 2 samples are needed (10% are held out for testing)."
        )
    return kind


def _check_split_headers(x: Member, y: Member) -> str:
    x_shape, y_shape, y_dtype = x.header.shape, y.header.shape, y.header.dtype
    if x.header.dtype not in X_DTYPES:
        raise DatasetError(f"{x.key} has dtype {x.header.dtype}; use float32, float64 or uint8.")
    if len(x_shape) < 2 or x_shape[0] < 1 or 0 in x_shape:
        raise DatasetError(
            f"{x.key} must have shape [samples, ...] with at least one sample; got {list(x_shape)}."
        )
    floats = y_dtype.kind == "f" and len(y_shape) >= 1 and 0 not in y_shape[1:]
    labels = y_dtype.kind in "iu" and len(y_shape) == 1
    if not (floats or labels):
        raise DatasetError(
            f"{y.key} must be a 1-D array of integer class labels, or float targets of shape [samples, ...]; "
            f"got {y_dtype} {list(y_shape)}."
        )
    if y_shape[0] != x_shape[0]:
        what = "targets" if floats else "labels"
        raise DatasetError(f"{x.key} has {x_shape[0]} samples but {y.key} has {y_shape[0]} {what}.")
    return Kind.REGRESSION if floats else Kind.CLASSES


def _check_same_shapes(members: dict[str, Member], kind: str, test_kind: str) -> None:
    x, x_test = members["x"].header.shape[1:], members["x_test"].header.shape[1:]
    if x != x_test:
        raise DatasetError(f"x_test samples have shape {list(x_test)}, but x samples have shape {list(x)}.")
    if kind != test_kind:
        raise DatasetError(
            "y and y_test must both hold integer class labels or both float targets; they differ."
        )
    y, y_test = members["y"].header.shape[1:], members["y_test"].header.shape[1:]
    if y != y_test:
        raise DatasetError(f"y_test targets have shape {list(y_test)}, but y targets have shape {list(y)}.")


class RowReader:
    """The rows of one .npy member in order, inflated a chunk at a time and never past the declared size.
    A Fortran-ordered array (np.save of a transposed array) has no contiguous rows: it is read whole, which
    its header bounded already."""

    def __init__(self, archive: zipfile.ZipFile, member: Member) -> None:
        self.member = member
        self._file = archive.open(member.info)
        self._file.read(member.header.offset)
        self._whole = self._read(member.header.shape[0]) if member.header.fortran else None
        self._position = 0

    def read(self, rows: int) -> np.ndarray:
        if self._whole is None:
            return self._read(rows)
        self._position += rows
        return self._whole[self._position - rows : self._position]

    def _read(self, rows: int) -> np.ndarray:
        header = self.member.header
        flat = np.empty(rows * math.prod(header.shape[1:]), header.dtype)
        _read_exactly(self._file, flat.view(np.uint8), self.member.info.filename)
        shape = (rows, *header.shape[1:])
        return flat.reshape(shape, order="F" if header.fortran else "C")

    def close(self) -> None:
        self._file.close()


def _read_exactly(member: IO[bytes], out: np.ndarray, name: str) -> None:
    position = 0
    while position < len(out):
        chunk = member.read(min(READ_CHUNK, len(out) - position))
        if not chunk:
            raise DatasetError(f"{name} is truncated.")
        out[position : position + len(chunk)] = np.frombuffer(chunk, np.uint8)
        position += len(chunk)


@dataclass
class LabelRange:
    """The smallest and largest class label seen, over every chunk of every split."""

    low: int = 0
    high: int = 0

    def add(self, y: np.ndarray) -> None:
        if len(y):
            self.low, self.high = min(self.low, int(y.min())), max(self.high, int(y.max()))

    def num_classes(self) -> int:
        if self.low < 0:
            raise DatasetError(f"Labels must be >= 0; found {self.low}.")
        num_classes = self.high + 1
        if num_classes < 2:
            raise DatasetError("Labels must cover at least 2 classes (0 and 1).")
        if num_classes > MAX_CLASSES:
            raise DatasetError(
                f"Labels go up to {num_classes - 1}; at most {MAX_CLASSES} classes are supported."
            )
        return num_classes


def _stage_npz(
    archive: zipfile.ZipFile, members: dict[str, Member], kind: str, staging: Staging
) -> ParsedDataset:
    x, y = members["x"].header, members["y"].header
    y_dtype = np.float32 if kind == Kind.REGRESSION else np.int32
    writers = [
        SplitWriter(staging, split, _spec(np.float32, x.shape[1:]), _spec(y_dtype, y.shape[1:]))
        for split in SPLITS
    ]
    labels = LabelRange()
    if "x_test" in members:
        _copy_rows(archive, members["x"], members["y"], [(writers[0], x.shape[0])], labels)
        test_count = members["x_test"].header.shape[0]
        _copy_rows(archive, members["x_test"], members["y_test"], [(writers[1], test_count)], labels)
    else:
        n_test = max(1, x.shape[0] // HOLDOUT_FRACTION)
        sinks = [(writers[0], x.shape[0] - n_test), (writers[1], n_test)]
        _copy_rows(archive, members["x"], members["y"], sinks, labels)
    train, test = (writer.close() for writer in writers)
    classes = labels.num_classes() if kind == Kind.CLASSES else 0
    shapes = [int(d) for d in x.shape[1:]], [int(d) for d in y.shape[1:]]
    return ParsedDataset(kind, *shapes, classes, train, test, staging)


def _copy_rows(
    archive: zipfile.ZipFile,
    x_member: Member,
    y_member: Member,
    sinks: list[tuple[SplitWriter, int]],
    labels: LabelRange,
) -> None:
    """Read x and y side by side, a chunk of rows at a time, checking and staging each chunk; the first
    sink takes the first rows, the next one the rows after them."""
    step = max(1, READ_CHUNK // max(x_member.header.row_bytes, y_member.header.row_bytes, 1))
    with closing(RowReader(archive, x_member)) as xs, closing(RowReader(archive, y_member)) as ys:
        for writer, count in sinks:
            for start in range(0, count, step):
                rows = min(step, count - start)
                x = _checked_samples(xs.read(rows), x_member.key)
                writer.write(x, _checked_targets(ys.read(rows), y_member.key, labels))


def _checked_samples(x: np.ndarray, name: str) -> np.ndarray:
    with np.errstate(over="ignore"):  # float64 beyond float32's range becomes inf, rejected just below
        x32 = x.astype(np.float32, copy=False)
    if not np.isfinite(x32).all():
        raise DatasetError(f"{name} contains NaN or infinite values (after conversion to float32).")
    return x32


def _checked_targets(y: np.ndarray, name: str, labels: LabelRange) -> np.ndarray:
    if y.dtype.kind == "f":
        return _checked_samples(y, name)
    labels.add(y)
    # Out-of-range labels wrap in int32 here, but LabelRange refuses them once every chunk is read.
    return y.astype(np.int32)


# --- image folders --------------------------------------------------------------------------------


@dataclass(frozen=True)
class ImageShape:
    channels: int
    height: int
    width: int

    @property
    def dims(self) -> tuple[int, int, int]:
        return self.channels, self.height, self.width


@dataclass(frozen=True)
class ImageFolders:
    """The images of a zip, by split: (zip entry, class index) pairs; test is None when none was given."""

    classes: list[str]
    train: list[tuple[zipfile.ZipInfo, int]]
    test: list[tuple[zipfile.ZipInfo, int]] | None


def image_limit(name: str) -> int:
    return int(settings.CROWDTRAIN[name])  # MAX_DATASET_IMAGES, MAX_IMAGE_PIXELS, MAX_IMAGE_BYTES


def dataset_parse_images(*, data: Source, channels: int, height: int, width: int) -> ParsedDataset:
    """Check and stage a zip of image folders, every image resized to [channels, height, width]."""
    shape = _check_image_shape(channels, height, width)
    fileobj = _fileobj(data)
    max_images = image_limit("MAX_DATASET_IMAGES")
    size = _check_zip_directory(
        fileobj,
        not_zip="This is not a .zip file (of image folders).",
        max_directory=max_images * ZIP_ENTRY_BYTES,
        too_many=f"The zip lists too many files; at most {max_images:,} images are accepted.",
    )
    with _zip_errors("zip"), zipfile.ZipFile(fileobj) as archive:
        folders = _image_folders(archive.infolist())
        _check_image_sizes(folders, size, shape)
        with _staging() as staging:
            return _stage_images(archive, folders, shape, staging)


def _check_image_shape(channels: int, height: int, width: int) -> ImageShape:
    if channels not in (1, 3):
        raise DatasetError(f"Images have 1 (grayscale) or 3 (RGB) channels, not {channels}.")
    if not (1 <= height <= MAX_IMAGE_SIDE and 1 <= width <= MAX_IMAGE_SIDE):
        raise DatasetError(f"Height and width must be between 1 and {MAX_IMAGE_SIDE}; got {height}x{width}.")
    return ImageShape(channels, height, width)


def _image_folders(infos: list[zipfile.ZipInfo]) -> ImageFolders:
    files, folders = _image_entries(infos)
    if not files:
        raise DatasetError("The zip holds no images: use train/<class>/<image> or <class>/<image>.")
    if all(info.filename.endswith(".npy") for _, info in files):
        raise DatasetError("This is an .npz file (numpy arrays), not a zip of image folders: choose .npz.")
    files, folders = _unwrap(files, folders)
    tops = {parts[0] for parts, _ in files}
    if not tops & set(SPLITS):
        train = _class_files(files, folders, prefix=())
        return _numbered(train, None)
    if not tops <= set(SPLITS) or "train" not in tops:
        raise DatasetError(
            "Use train/<class>/<image> (and optionally test/<class>/<image>), or only <class>/<image>; "
            f"this zip's top-level folders are: {', '.join(sorted(tops)[:10])}."
        )
    by_split = {split: [(p, i) for p, i in files if p[0] == split] for split in SPLITS}
    train = _class_files(by_split["train"], folders, prefix=("train",))
    test = _class_files(by_split["test"], folders, prefix=("test",)) if by_split["test"] else None
    return _numbered(train, test)


def _image_entries(
    infos: list[zipfile.ZipInfo],
) -> tuple[list[tuple[tuple[str, ...], zipfile.ZipInfo]], set[tuple[str, ...]]]:
    """Files (by path parts) and folders of the zip, leaving out macOS's and hidden entries."""
    files, folders = [], set()
    for info in infos:
        parts = tuple(part for part in info.filename.split("/") if part)
        if not parts or any(part.startswith(".") or part in IGNORED_NAMES for part in parts):
            continue
        if info.is_dir():
            folders.add(parts)
        else:
            files.append((parts, info))
            folders.update(parts[:depth] for depth in range(1, len(parts)))
    return files, folders


def _unwrap(
    files: list[tuple[tuple[str, ...], zipfile.ZipInfo]], folders: set[tuple[str, ...]]
) -> tuple[list[tuple[tuple[str, ...], zipfile.ZipInfo]], set[tuple[str, ...]]]:
    """Zipping a folder puts everything under its name: one top-level folder around the layout is dropped."""
    tops = {parts[0] for parts, _ in files}
    if len(tops) != 1 or tops & set(SPLITS) or any(len(parts) < 3 for parts, _ in files):
        return files, folders
    return [(parts[1:], info) for parts, info in files], {f[1:] for f in folders if len(f) > 1}


def _class_files(
    files: list[tuple[tuple[str, ...], zipfile.ZipInfo]],
    folders: set[tuple[str, ...]],
    prefix: tuple[str, ...],
) -> dict[str, list[zipfile.ZipInfo]]:
    """The images of one split by class folder; every image two levels below `prefix`."""
    classes: dict[str, list[zipfile.ZipInfo]] = {
        folder[-1]: [] for folder in folders if len(folder) == len(prefix) + 1 and folder[:-1] == prefix
    }
    for parts, info in files:
        if len(parts) != len(prefix) + 2:
            where = "/".join([*prefix, "<class>", "<image>"])
            raise DatasetError(f"{info.filename[:200]}: images go in {where}; this file is at another depth.")
        if not parts[-1].lower().endswith(IMAGE_SUFFIXES):
            raise DatasetError(f"{info.filename[:200]} is not a .png or .jpg image.")
        classes.setdefault(parts[-2], []).append(info)
    for name, infos in classes.items():
        if not infos:
            raise DatasetError(f"The class folder {'/'.join([*prefix, name])[:200]} has no images.")
    return classes


def _numbered(
    train: dict[str, list[zipfile.ZipInfo]], test: dict[str, list[zipfile.ZipInfo]] | None
) -> ImageFolders:
    classes = sorted(train)
    if len(classes) < 2:
        raise DatasetError(f"At least 2 class folders are needed; found {len(classes)}.")
    unknown = sorted(set(test or {}) - set(train))
    if unknown:
        raise DatasetError(f"test/{unknown[0][:100]} is a class that train/ does not have.")
    index = {name: i for i, name in enumerate(classes)}

    def numbered(split: dict[str, list[zipfile.ZipInfo]]) -> list[tuple[zipfile.ZipInfo, int]]:
        return [(info, index[name]) for name in sorted(split) for info in sorted(split[name], key=_name)]

    return ImageFolders(classes, numbered(train), None if test is None else numbered(test))


def _name(info: zipfile.ZipInfo) -> str:
    return info.filename


def _check_image_sizes(folders: ImageFolders, size: int, shape: ImageShape) -> None:
    """Counts and sizes from the directory alone, before any image is inflated or decoded."""
    images = folders.train + (folders.test or [])
    limit, max_bytes = image_limit("MAX_DATASET_IMAGES"), image_limit("MAX_IMAGE_BYTES")
    if len(images) > limit:
        raise DatasetError(f"The zip holds {len(images):,} images; the limit is {limit:,}.")
    for info, _ in images:
        if info.file_size > max_bytes:
            raise DatasetError(
                f"{info.filename[:200]} is {info.file_size:,} bytes; an image may be at most {max_bytes:,}."
            )
    _check_inflation(sum(info.file_size for info, _ in images), size, what="images")
    _check_stored_bytes(len(images) * 4 * (math.prod(shape.dims) + 1))


def _image_splits(
    folders: ImageFolders,
) -> tuple[list[tuple[zipfile.ZipInfo, int]], list[tuple[zipfile.ZipInfo, int]]]:
    """Both splits shuffled (seed 0); without a test folder, the last tenth of the shuffled images."""
    rng = np.random.default_rng(0)
    train = [folders.train[i] for i in rng.permutation(len(folders.train))]
    if folders.test is not None:
        return train, [folders.test[i] for i in rng.permutation(len(folders.test))]
    n_test = max(1, len(train) // HOLDOUT_FRACTION)
    return train[:-n_test], train[-n_test:]


def _stage_images(
    archive: zipfile.ZipFile,
    folders: ImageFolders,
    shape: ImageShape,
    staging: Staging,
) -> ParsedDataset:
    x_spec, y_spec = _spec(np.float32, shape.dims), _spec(np.int32, ())
    splits: list[StagedSplit] = []
    for split, images in zip(SPLITS, _image_splits(folders), strict=True):
        writer = SplitWriter(staging, split, x_spec, y_spec)
        step = max(1, IMAGE_CHUNK // (4 * math.prod(shape.dims)))
        for start in range(0, len(images), step):
            chunk = images[start : start + step]
            x = np.stack([_decode_image(archive, info, shape) for info, _ in chunk])
            writer.write(x, np.array([label for _, label in chunk], np.int32))
        splits.append(writer.close())
    train, test = splits
    classes = folders.classes
    return ParsedDataset(Kind.CLASSES, list(shape.dims), [], len(classes), train, test, staging, classes)


def _decode_image(archive: zipfile.ZipFile, info: zipfile.ZipInfo, shape: ImageShape) -> np.ndarray:
    """One image as float32 [channels, height, width] in [0, 1]. Its header is checked (format, pixel count,
    mode) before anything is decoded; any failure of the decoder on a hostile file is the file's fault."""
    name = info.filename[:200]
    data = archive.read(info)  # bounded: the directory's declared size was checked, and is never exceeded
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # palette transparency notes and the like
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data), formats=IMAGE_FORMATS) as image:
                _check_image_header(image, name)
                return _image_array(image, shape)
    except DatasetError:
        raise
    except Exception as exc:  # Pillow raises many kinds on hostile input; all mean "not a usable image"
        raise DatasetError(f"Cannot decode {name}: {str(exc)[:200] or type(exc).__name__}") from None


def _check_image_header(image: Image.Image, name: str) -> None:
    width, height = image.size
    limit = image_limit("MAX_IMAGE_PIXELS")
    if width * height > limit:
        raise DatasetError(
            f"{name} is {width}x{height} pixels; an image may have at most {limit:,} pixels "
            "(refused before decoding, as a possible decompression bomb)."
        )
    if image.mode not in IMAGE_MODES:
        raise DatasetError(f"{name} has mode {image.mode}; use 8-bit grayscale, RGB(A) or palette images.")


def _image_array(image: Image.Image, shape: ImageShape) -> np.ndarray:
    mode = "L" if shape.channels == 1 else "RGB"
    if image.format == "JPEG":
        image.draft(mode, (shape.width, shape.height))  # decode large JPEGs at a reduced scale
    converted = image.convert(mode)
    if converted.size != (shape.width, shape.height):
        converted = converted.resize((shape.width, shape.height), Image.Resampling.BILINEAR)
    pixels = np.asarray(converted, dtype=np.float32) / 255
    return pixels.reshape(shape.height, shape.width, shape.channels).transpose(2, 0, 1)


# --- text -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Corpus:
    """What the first pass over a text learned: its length in tokens and, for characters, the alphabet."""

    tokens: int
    alphabet: np.ndarray  # sorted code points (characters); empty for bytes


def dataset_parse_text(*, data: Source, block_size: int, vocabulary: str = "chars") -> ParsedDataset:
    """Check and stage a UTF-8 text as next-token samples of `block_size` tokens (characters or bytes)."""
    if vocabulary not in VOCABULARIES:
        raise DatasetError(f"The vocabulary is 'chars' or 'bytes', not {vocabulary!r}.")
    if not 1 <= block_size <= MAX_BLOCK_SIZE:
        raise DatasetError(f"The block size must be between 1 and {MAX_BLOCK_SIZE}; got {block_size}.")
    fileobj = _fileobj(data)
    size = _check_size(fileobj)
    _check_stored_bytes(TOKEN_BYTES * size)
    corpus = _read_corpus(fileobj, chars=vocabulary == "chars")
    n_test = _check_corpus(corpus, block_size, vocabulary)
    with _staging() as staging:
        return _stage_text(fileobj, corpus, block_size, corpus.tokens - n_test, staging)


def _text_chunks(fileobj: IO[bytes]) -> Iterator[tuple[int, bytes]]:
    fileobj.seek(0)
    offset = 0
    while chunk := fileobj.read(READ_CHUNK):
        yield offset, chunk
        offset += len(chunk)


def _decoded(fileobj: IO[bytes]) -> Iterator[tuple[bytes, str]]:
    """Each chunk, raw and decoded (a character split between chunks is decoded with the later one). A BOM
    is dropped; anything not UTF-8 is refused with the offset of the first bad byte."""
    decoder = codecs.getincrementaldecoder("utf-8-sig")("strict")
    offset = 0
    for offset, chunk in _text_chunks(fileobj):
        yield chunk, _decode(decoder, chunk, offset)
    _decode(decoder, b"", fileobj.tell(), final=True)


def _decode(decoder: codecs.IncrementalDecoder, chunk: bytes, offset: int, final: bool = False) -> str:
    pending = len(decoder.getstate()[0])  # bytes of a character begun in the previous chunk
    try:
        return decoder.decode(chunk, final=final)
    except UnicodeDecodeError as exc:
        position = offset - pending + exc.start
        raise DatasetError(
            f"The file is not UTF-8 text: byte {position:,} cannot be decoded ({exc.reason})."
        ) from None


def _read_corpus(fileobj: IO[bytes], *, chars: bool) -> Corpus:
    tokens, alphabet = 0, set[str]()
    for chunk, text in _decoded(fileobj):
        tokens += len(text) if chars else len(chunk)
        if chars:
            alphabet.update(text)
    codes = np.array(sorted(ord(c) for c in alphabet), np.uint32) if chars else np.empty(0, np.uint32)
    return Corpus(tokens, codes)


def _check_corpus(corpus: Corpus, block_size: int, vocabulary: str) -> int:
    """The test split's length in tokens, once the text is long and varied enough."""
    unit = "characters" if vocabulary == "chars" else "bytes"
    if corpus.tokens == 0:
        raise DatasetError("The text file is empty.")
    n_test = max(corpus.tokens // HOLDOUT_FRACTION, block_size + 1)
    if corpus.tokens - n_test < block_size + 1:
        raise DatasetError(
            f"The text has {corpus.tokens:,} {unit}: too short for blocks of {block_size}. At least "
            f"{2 * (block_size + 1):,} are needed (a block and its next {unit[:-1]} to train, and one to "
            "test)."
        )
    if vocabulary == "chars" and not 2 <= len(corpus.alphabet) <= MAX_CLASSES:
        raise DatasetError(
            f"The text has {len(corpus.alphabet):,} distinct characters; between 2 and {MAX_CLASSES:,} "
            "are needed."
        )
    return n_test


class Windows:
    """Cuts a stream of token ids into samples of `block` tokens, labelled with the next token at each
    position. Samples do not overlap; the last few tokens that fill no block are dropped."""

    def __init__(self, writer: SplitWriter, block: int) -> None:
        self.writer, self.block = writer, block
        self.pending = np.empty(0, np.int32)

    def feed(self, ids: np.ndarray) -> None:
        pending = np.concatenate([self.pending, ids])
        rows = (len(pending) - 1) // self.block
        if rows > 0:
            cut = rows * self.block
            self.writer.write(pending[:cut].reshape(rows, -1), pending[1 : cut + 1].reshape(rows, -1))
            pending = pending[cut:]
        self.pending = pending


def _stage_text(
    fileobj: IO[bytes], corpus: Corpus, block: int, n_train: int, staging: Staging
) -> ParsedDataset:
    spec = _spec(np.int32, (block,))
    writers = [SplitWriter(staging, split, spec, spec) for split in SPLITS]
    train, test = (Windows(writer, block) for writer in writers)
    seen = 0
    for ids in _token_ids(fileobj, corpus):
        head = ids[: max(0, n_train - seen)]
        train.feed(head)
        test.feed(ids[len(head) :])
        seen += len(ids)
    chars = len(corpus.alphabet) > 0
    labels = [chr(code) for code in corpus.alphabet.tolist()]
    classes = len(labels) if chars else 256
    splits = [writer.close() for writer in writers]
    return ParsedDataset(Kind.TOKENS, [block], [block], classes, splits[0], splits[1], staging, labels)


def _token_ids(fileobj: IO[bytes], corpus: Corpus) -> Iterator[np.ndarray]:
    for chunk, text in _decoded(fileobj):
        if not len(corpus.alphabet):
            yield np.frombuffer(chunk, np.uint8).astype(np.int32)
            continue
        codes = np.frombuffer(text.encode("utf-32-le"), np.dtype("<u4"))
        yield np.searchsorted(corpus.alphabet, codes).astype(np.int32)
