"""Content-addressed blob storage on the local filesystem (MEDIA_ROOT/blobs/ab/abcdef...), and who may read
which blob."""

from __future__ import annotations

import contextlib
import enum
import hashlib
import mmap
import os
import queue
import tempfile
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Self
from urllib.parse import urlencode

import numpy as np
from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.models import AnonymousUser, User
from django.core.signing import BadSignature, SignatureExpired, TimestampSigner
from django.db import models, transaction
from django.db.models import Exists, OuterRef, Q
from django.utils import timezone
from torch import Tensor

from engine import codecs
from projects import blob_store
from projects.models import Blob, DatasetShard, ModelVersion, Project, Result, WorkUnit

Pieces = Sequence[bytes | memoryview]
WRITE_SLICE = 1 << 18
SPOOL_BYTES = 1 << 22  # from this size a blob is written by a thread of its own while it is hashed
OCTETS = "application/octet-stream"
SPOOL_DIR = "00"  # where spooled files wait for their address (any blob directory: the sweep looks there)


def blob_put(*, data: bytes | Iterable[bytes | memoryview], content_type: str = OCTETS) -> Blob:
    """Store bytes once; storing the same bytes again returns the existing blob. `data` may come in pieces
    (the blob is their concatenation), which are hashed and written one after the other, never joined; an
    iterator of pieces is consumed as it yields them (see blob_put_computed for one that works to yield).

    A large local blob is written to a temporary file by another thread while this one hashes it (both
    release the GIL: 45 MB took 25 ms to hash and 13 ms to write, one after the other), then renamed to its
    address once known, after the row is upserted.

    Safe against the garbage collector (projects/storage.py) collecting these bytes at the same moment: the
    row is upserted first, which refreshes `stored_at` (the collector spares rows stored within its grace
    period) and keeps the row locked until the caller's transaction ends (the collector skips locked rows).
    Had the collector locked the row first, the upsert waits for it to commit and inserts the row anew; the
    file, which the collector moved away before committing, is then put in place again below."""
    pieces = [data] if isinstance(data, (bytes, bytearray, memoryview)) else data
    if blob_store.remote():
        return _put_remote(pieces=list(pieces), content_type=content_type)
    if isinstance(pieces, Sequence) and sum(memoryview(p).nbytes for p in pieces) < SPOOL_BYTES:
        sha, size = _digest(pieces)
        with transaction.atomic():
            blob = _upsert(sha=sha, size=size, content_type=content_type)
            _write_file(path=_path(sha), pieces=pieces)
            return blob
    with _Spool() as spool:
        sha, size = _digest(spool.feed(pieces))
        with transaction.atomic():
            blob = _upsert(sha=sha, size=size, content_type=content_type)
            spool.place(path=_path(sha))
            return blob


def blobs_put(*, datas: Sequence[bytes]) -> list[Blob]:
    """blob_put of each of `datas`, small blobs (a batch of arriving results) with their rows upserted in one
    query; large ones, or a bucket's, one at a time as blob_put stores them."""
    if not datas or blob_store.remote() or any(len(data) >= SPOOL_BYTES for data in datas):
        return [blob_put(data=data) for data in datas]
    shas = [hashlib.sha256(data).hexdigest() for data in datas]
    # No savepoint inside the caller's transaction (results_receive's): a failure here fails the batch anyway.
    with transaction.atomic(savepoint=False):
        rows = _upserts(sizes=dict(zip(shas, map(len, datas), strict=True)), content_type=OCTETS)
        for sha, data in zip(shas, datas, strict=True):
            _write_file(path=_path(sha), pieces=[data])
    return [rows[sha] for sha in shas]


def blob_put_computed(*, pieces: Iterator[bytes | memoryview], content_type: str = OCTETS) -> Blob:
    """blob_put of `pieces`, an iterator that computes each piece before yielding it (the publish step
    changes each tensor in place, then yields its memory), which must stay unchanged once yielded: a thread
    of its own runs the iterator, handing each piece to this thread to hash as soon as it is yielded, and
    then writes them all. The computing and the writing share one core while this thread hashes on the other:
    with a third thread writing as pieces were hashed, the three competed for two cores (a ResNet-18's step,
    hash and write: 37 ms against 31, median of 10 interleaved trials on a loaded machine)."""
    if blob_store.remote():
        return _put_remote(pieces=list(pieces), content_type=content_type)
    with _Computed(pieces) as spool:
        sha, size = _digest(spool.pieces())
        with transaction.atomic():
            blob = _upsert(sha=sha, size=size, content_type=content_type)
            spool.place(path=_path(sha))
            return blob


def _put_remote(*, pieces: Pieces, content_type: str) -> Blob:
    """An S3-compatible bucket shared by several machines: the object's key is the hash, so hash first."""
    sha, size = _digest(pieces)
    with transaction.atomic():
        blob = _upsert(sha=sha, size=size, content_type=content_type)
        blob_store.upload(sha=sha, pieces=pieces)
        return blob


def _digest(pieces: Iterable[bytes | memoryview]) -> tuple[str, int]:
    digest, size = hashlib.sha256(), 0
    for piece in pieces:
        digest.update(piece)
        size += memoryview(piece).nbytes
    return digest.hexdigest(), size


def _upsert(*, sha: str, size: int, content_type: str) -> Blob:
    return _upserts(sizes={sha: size}, content_type=content_type)[sha]


def _upserts(*, sizes: Mapping[str, int], content_type: str) -> dict[str, Blob]:
    """The blobs' rows (by address: size), inserted or their stored_at refreshed, as they are now: one query
    (RETURNING), not an upsert and then a read of the rows. In address order, so that two transactions
    upserting the same blobs never wait for each other in a circle."""
    table = Blob._meta.db_table
    now = timezone.now()
    shas = sorted(sizes)
    rows = Blob.objects.raw(
        f"INSERT INTO {table} (sha256, size, content_type, created_at, stored_at) "
        f"VALUES {', '.join(['(%s, %s, %s, %s, %s)'] * len(shas))} "
        "ON CONFLICT (sha256) DO UPDATE SET stored_at = EXCLUDED.stored_at RETURNING *",
        [value for sha in shas for value in (sha, sizes[sha], content_type, now, now)],
    )
    return {row.sha256: row for row in rows}


def _path(sha: str) -> Path:
    return Path(settings.BLOB_ROOT) / sha[:2] / sha


class _Spool:
    """A temporary blob file written by a thread of its own from the pieces `feed` passes on, so that the
    caller hashes while it is written. Named .tmp-* in a blob directory: the orphan sweep removes what a
    crash leaves (projects/storage.py)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[memoryview | None] = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._tmp: str | None = None
        self._thread = threading.Thread(target=self._write, name="blob-spool", daemon=True)

    def __enter__(self) -> Self:
        self._open()
        self._thread.start()
        return self

    def _open(self) -> None:
        directory = Path(settings.BLOB_ROOT) / SPOOL_DIR
        directory.mkdir(parents=True, exist_ok=True)
        fd, self._tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-")
        self._handle = os.fdopen(fd, "wb", buffering=0)

    def feed(self, pieces: Iterable[bytes | memoryview]) -> Iterator[bytes | memoryview]:
        """`pieces`, each also queued for the writer as it is yielded."""
        for piece in pieces:
            self._queue.put(memoryview(piece).cast("B"))
            yield piece
        self._queue.put(None)

    def _write(self) -> None:
        try:
            while (view := self._queue.get()) is not None:
                _write_view(self._handle, view)
        except BaseException as exc:  # noqa: BLE001 - re-raised by place() in the caller's thread
            self._error = exc
            while self._queue.get() is not None:  # drain: the feeder never blocks, but let it finish
                pass
        finally:
            self._handle.close()

    def place(self, *, path: Path) -> None:
        """Wait for the writer, then put the file at `path` (or only touch it if the blob is there)."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._tmp is not None
        try:
            os.utime(path)  # the same bytes are there already; fresh for the orphan sweep
            return
        except FileNotFoundError:
            pass
        path.parent.mkdir(parents=True, exist_ok=True)
        os.replace(self._tmp, path)
        self._tmp = None

    def __exit__(self, *exc: object) -> None:
        if self._thread.is_alive():  # the caller failed before the end of the pieces
            self._queue.put(None)
            self._thread.join()
        if self._tmp is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._tmp)


class _Computed(_Spool):
    """A _Spool whose thread also computes the pieces (blob_put_computed): it runs their iterator, passing
    each to the caller (`pieces`) as it comes, and writes them all once the last is computed, to a file it
    creates then (off the caller's path to its first piece)."""

    def __init__(self, source: Iterator[bytes | memoryview]) -> None:
        super().__init__()
        self._source = source
        self._thread = threading.Thread(target=self._compute, name="blob-computed", daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def pieces(self) -> Iterator[memoryview]:
        """The pieces as they are computed; the iterator's exception, if it raised one."""
        while (view := self._queue.get()) is not None:
            yield view
        if self._error is not None:
            raise self._error

    def _compute(self) -> None:
        computed: list[memoryview] = []
        try:
            for piece in self._source:
                computed.append(memoryview(piece).cast("B"))
                self._queue.put(computed[-1])
        except BaseException as exc:  # noqa: BLE001 - raised again by pieces() in the caller's thread
            self._error = exc
        finally:
            self._queue.put(None)
        if self._error is None:
            self._write_all(computed)

    def _write_all(self, views: list[memoryview]) -> None:
        try:
            self._open()
            for view in views:
                _write_view(self._handle, view)
        except BaseException as exc:  # noqa: BLE001 - raised again by place() in the caller's thread
            self._error = exc
        finally:
            if self._tmp is not None:
                self._handle.close()

    def __exit__(self, *exc: object) -> None:
        self._thread.join()  # it never waits for the caller: the pieces' queue has no bound
        super().__exit__(*exc)


def _write_view(handle: Any, view: memoryview) -> None:
    # In slices: one write of 45 MB took 75 ms of CPU here, 180 writes of 256 KB 11 ms.
    for start in range(0, len(view), WRITE_SLICE):
        chunk = view[start : start + WRITE_SLICE]
        while chunk.nbytes:  # an unbuffered write may be short
            chunk = chunk[handle.write(chunk) :]


def blob_put_tensors(
    *, tensors: Mapping[str, Tensor], codec: str = "fp32", metadata: Mapping[str, str] | None = None
) -> Blob:
    """blob_put of codecs.encode(tensors, codec, metadata=metadata), without building those bytes: the
    tensors' memory is hashed and written as it is (a model's weights are tens of megabytes)."""
    return blob_put(data=codecs.encode_parts(tensors, codec, metadata=metadata))


def blob_read_buffer(*, blob: Blob) -> memoryview:
    """The blob's bytes in writable memory of the caller's own: what codecs.decode(copy=False) decodes from
    them is views of it, which the caller may change in place (Blob.read's bytes are immutable)."""
    if blob_store.remote():
        return memoryview(bytearray(blob.read()))
    with open(blob.path, "rb", buffering=0) as handle:
        size = os.fstat(handle.fileno()).st_size
        buffer = np.empty(size, dtype=np.uint8).data  # not zeroed first: every byte is read into it
        done = 0
        while done < size and (count := handle.readinto(buffer[done:])):
            done += count
    if done != size:
        raise OSError(f"blob {blob.sha256} was {size:,} bytes but {done:,} could be read")
    return buffer


def blob_view(*, blob: Blob) -> memoryview:
    """The blob's bytes, read-only, for codecs.parse: a local file is mapped (mmap) rather than read, so
    nothing is allocated or copied (an update's 11 MB cost 1-2 ms of CPU to read). Safe because blob files
    never change in place: they are written aside and renamed (_write_file) and deleted by rename too."""
    if blob_store.remote():
        return memoryview(blob.read())
    with open(blob.path, "rb") as handle:
        if not os.fstat(handle.fileno()).st_size:
            return memoryview(b"")  # mmap refuses empty files
        return memoryview(mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ))


def _write_file(*, path: Path, pieces: Pieces) -> None:
    try:
        # An existing file is touched: the orphan-file sweep (projects/storage.py) spares fresh files.
        os.utime(path)
        return
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    # Write then rename, so a reader never sees a half-written blob.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    with os.fdopen(fd, "wb", buffering=0) as handle:
        for piece in pieces:
            _write_view(handle, memoryview(piece).cast("B"))
    os.replace(tmp, path)


# --- who may download which blob (served by projects/blob_server.py) ---------------------------------
#
# Public, cached by browsers and proxies for a year: the graph and weights of a running or finished project,
# which every volunteer fetches. A dataset shard goes to the volunteer an assign message sent it to, through
# a signed URL that expires and works only while the project runs: the path is the blob's (clients cache by
# it), the grant is in the query. Shards, uploads, references and optimizer state also go to their owner and
# to superusers (the admin's links, by session). An invalid (rejected) upload goes to nobody. Blobs are
# content-addressed, so one row may play several parts: it is public only through a graph or weights
# reference, and readable through any reference that allows it.

GRANT = "grant"  # the query parameter of a shard's signed URL
MAX_GRANT_CHARS = 200  # a real one is about 60
LIVE = (Project.Status.RUNNING, Project.Status.FINISHED)


class Access(enum.Enum):
    PUBLIC = "public"  # anyone; cacheable
    GRANTED = "granted"  # the holder of a valid grant; never cached
    EXPIRED = "expired"  # a genuine grant, too old
    REFUSED = "refused"  # a forged grant, or one for a shard no longer handed out
    SESSION = "session"  # neither public nor granted: up to the session's user (blob_readable)


def _signer() -> TimestampSigner:
    return TimestampSigner(salt="crowdtrain.blobs.shard")


def shard_url(*, sha256: str, user_id: int, project_id: int) -> str:
    """The URL of a dataset shard for `user_id` working on `project_id`."""
    grant = _signer().sign(f"{sha256}:{user_id}.{project_id}")[len(sha256) + 1 :]
    return f"/blobs/{sha256}?{urlencode({GRANT: grant})}"


def _stage_signer() -> TimestampSigner:
    return TimestampSigner(salt="crowdtrain.blobs.stage")


def stage_blob_url(*, sha256: str, user_id: int, work_unit_id: int) -> str:
    """The URL of a pipeline stage unit's blob (its stage's graph or weights, its input activation or output
    gradient) for the volunteer holding the unit: activations are the project's data, never public."""
    grant = _stage_signer().sign(f"{sha256}:{user_id}.{work_unit_id}")[len(sha256) + 1 :]
    return f"/blobs/{sha256}?{urlencode({GRANT: grant})}"


def blob_access(*, sha256: str, grant: str | None) -> tuple[Blob | None, Access]:
    """The blob named `sha256` (None if unknown) and how the request may have it."""
    live_graph = Project.objects.filter(graph=OuterRef("pk"), status__in=LIVE)
    live_weights = ModelVersion.objects.filter(
        Q(weights=OuterRef("pk")) | Q(wire_weights=OuterRef("pk")) | Q(wire_delta=OuterRef("pk")),
        project__status__in=LIVE,
    )
    blobs = Blob.objects.annotate(live_graph=Exists(live_graph), live_weights=Exists(live_weights))
    blob = blobs.filter(pk=sha256).first()
    if blob is None:
        return None, Access.SESSION
    if blob.live_graph or blob.live_weights:
        return blob, Access.PUBLIC
    return blob, Access.SESSION if grant is None else _granted(sha256=sha256, grant=grant)


def _granted(*, sha256: str, grant: str) -> Access:
    if len(grant) > MAX_GRANT_CHARS:
        return Access.REFUSED
    try:
        value = _signer().unsign(f"{sha256}:{grant}", max_age=settings.CROWDTRAIN_SHARD_URL_SECONDS)
    except SignatureExpired:
        return Access.EXPIRED
    except BadSignature:
        return _stage_granted(sha256=sha256, grant=grant)
    user_id, project_id = value[len(sha256) + 1 :].split(".")  # as we signed it
    handed_out = DatasetShard.objects.filter(
        blob_id=sha256, dataset__projects__pk=project_id, dataset__projects__status=Project.Status.RUNNING
    ).exists()
    active = get_user_model().objects.filter(pk=user_id, is_active=True).exists()
    return Access.GRANTED if handed_out and active else Access.REFUSED


def _stage_granted(*, sha256: str, grant: str) -> Access:
    """A stage unit's grant: good while its volunteer holds the open unit that refers to the blob."""
    try:
        value = _stage_signer().unsign(f"{sha256}:{grant}", max_age=settings.CROWDTRAIN_SHARD_URL_SECONDS)
    except SignatureExpired:
        return Access.EXPIRED
    except BadSignature:
        return Access.REFUSED
    user_id, work_unit_id = value[len(sha256) + 1 :].split(".")  # as we signed it
    refers = Q(input_blob=sha256) | Q(grad_blob=sha256) | Q(stage_graph=sha256) | Q(stage_weights=sha256)
    held = WorkUnit.objects.filter(
        refers,
        pk=work_unit_id,
        status=WorkUnit.Status.OPEN,
        results__volunteer_id=int(user_id),
        results__status=Result.Status.IN_PROGRESS,
    )
    return Access.GRANTED if held.exists() else Access.REFUSED


# Every row that refers to a blob: (model, its field, the path to the owner of the row).
_REFERENCES: tuple[tuple[type[models.Model], str, str], ...] = (
    (DatasetShard, "blob", "dataset__owner"),
    (Project, "graph", "owner"),
    (ModelVersion, "weights", "project__owner"),
    (ModelVersion, "wire_weights", "project__owner"),
    (ModelVersion, "wire_delta", "project__owner"),
    (ModelVersion, "optimizer_state", "project__owner"),
    (WorkUnit, "reference", "project__owner"),
    (Result, "blob", "work_unit__project__owner"),
)


def blob_references() -> list[tuple[type[models.Model], str]]:
    """Every foreign key to Blob in the installed models, as (model, field name): the rows that keep a blob
    alive. Read from the models, so a reference added anywhere later protects its blobs too."""
    return sorted(
        (
            (rel.related_model, rel.field.name)
            for rel in Blob._meta.get_fields(include_hidden=True)
            if rel.auto_created and not rel.concrete and isinstance(rel, models.ForeignObjectRel)
        ),
        key=lambda pair: (pair[0]._meta.label, pair[1]),
    )


def blob_readable(*, sha256: str, user: User | AnonymousUser) -> Blob | None:
    """The blob, if `user` is active staff and it is referred to by a row they own (any row, for superusers)
    other than a rejected upload."""
    if not (user.is_active and user.is_staff):
        return None
    for model, field, owner in _REFERENCES:
        rows = model._default_manager.filter(**{field: sha256})
        if model is Result:
            rows = rows.exclude(validation=Result.Validation.INVALID)
        if not user.is_superuser:
            rows = rows.filter(**{owner: user})
        if rows.exists():
            return Blob.objects.filter(pk=sha256).first()
    return None
