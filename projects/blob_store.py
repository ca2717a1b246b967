"""Blob bytes in an S3-compatible bucket instead of files under BLOB_ROOT, so that web and worker processes
on several machines share them: STORAGES["blobs"] is django-storages' S3Storage once CROWDTRAIN_BLOB_BUCKET
is set (config/settings.py). The rows stay in PostgreSQL (projects.models.Blob); only the bytes move.
Readers go through Django's storage API either way (Blob.open); writers and the garbage collector keep their
local code (projects/blobs.py, projects/storage.py) and call this module when the bytes are remote.

An object store has no atomic rename, so the collector's guarantees (projects/storage.py) are kept so:
- blob_put uploads under a per-blob PostgreSQL advisory lock, held until its transaction ends; the orphan
  sweep deletes an object only under that lock and only if no committed row names it, so it never deletes
  the bytes of a blob_put whose row is about to commit.
- A collected blob's object is copied aside before its row's DELETE commits and the copy is deleted after;
  if the commit fails it is copied back (the same bytes as anything written meanwhile: content addressing).
"""

from __future__ import annotations

import io
import uuid
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from botocore.exceptions import ClientError
from django.core.files.storage import FileSystemStorage, storages
from django.db import connection, transaction

from projects.models import Blob

Pieces = Sequence[bytes | memoryview]
TRASH = ".gc-"  # objects moved aside by the collector: <sha>.gc-<random>, as files are locally
LOCK_SPACE = 0x6374  # the advisory locks' first key ("ct"); the second is 28 bits of the blob's SHA-256


def remote() -> bool:
    """Whether blob bytes live in a bucket (not under BLOB_ROOT)."""
    return not isinstance(storages["blobs"], FileSystemStorage)


def bucket_name() -> str:
    return str(_storage().bucket_name)


def bucket_ensure() -> bool:
    """Create the blobs' bucket unless it exists (a new SeaweedFS or MinIO has none; the release step runs
    this before any process stores a blob): True if it was created."""
    bucket = bucket_name()
    try:
        _client().head_bucket(Bucket=bucket)
        return False
    except ClientError as exc:
        if not _missing(exc):
            raise  # e.g. 403: it exists and these keys may not see it, which creating would not mend
    _client().create_bucket(Bucket=bucket)
    return True


def _missing(exc: ClientError) -> bool:
    return exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound", "NoSuchBucket")


def _storage() -> Any:  # django-storages' S3Storage (untyped)
    return storages["blobs"]


def _key(name: str) -> str:
    """The object key of a storage name: below the storage's prefix (CROWDTRAIN_BLOB_PREFIX)."""
    prefix = _storage().location.strip("/")
    return f"{prefix}/{name}" if prefix else name


def _client() -> Any:
    return _storage().connection.meta.client


def _lock(sha: str, *, wait: bool = True) -> bool:
    """This transaction's lock on one blob's object (PostgreSQL; released when the transaction ends)."""
    if connection.vendor != "postgresql":
        return True  # SQLite: one machine, and its writes are serialized anyway
    function = "pg_advisory_xact_lock" if wait else "pg_try_advisory_xact_lock"
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT {function}(%s, %s)", [LOCK_SPACE, int(sha[:7], 16)])
        row = cursor.fetchone()
    return wait or bool(row and row[0])


def upload(*, sha: str, pieces: Pieces) -> None:
    """Store a blob's bytes, unless the object is there already. Call inside blob_put's transaction: the
    lock keeps the orphan sweep away from the object until the row commits."""
    _lock(sha)
    storage, name = _storage(), Blob.storage_name(sha)
    if storage.exists(name):
        return
    reader = io.BufferedReader(_PiecesReader(pieces), buffer_size=2**20)
    storage.bucket.Object(_key(name)).upload_fileobj(reader, Config=storage.transfer_config)


class _PiecesReader(io.RawIOBase):
    """The concatenation of `pieces`, read without joining them (weights are tens of megabytes)."""

    def __init__(self, pieces: Pieces) -> None:
        self._pieces = [memoryview(piece).cast("B") for piece in pieces]
        self._index = self._offset = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while self._index < len(self._pieces):
            rest = self._pieces[self._index][self._offset :]
            if rest.nbytes:
                count = min(len(buffer), rest.nbytes)
                memoryview(buffer).cast("B")[:count] = rest[:count]
                self._offset += count
                return count
            self._index, self._offset = self._index + 1, 0
        return 0


# --- the garbage collector's moves (projects/storage.py) ----------------------------------------------


def move_aside(*, sha: str) -> str:
    """Copy the object where no reader looks and delete it; the copy's name (nothing is copied if there was
    no object)."""
    name = Blob.storage_name(sha)
    trash = f"{name}{TRASH}{uuid.uuid4().hex[:8]}"
    if _copy(name, trash):
        _storage().delete(name)
    return trash


def move_back(*, sha: str, trash: str) -> None:
    if _copy(trash, Blob.storage_name(sha)):
        _storage().delete(trash)


def discard(*, trash: str) -> None:
    _storage().delete(trash)


def _copy(source: str, target: str) -> bool:
    """Server-side copy (multipart for large objects); False if there was nothing to copy."""
    bucket = bucket_name()
    try:
        _client().copy({"Bucket": bucket, "Key": _key(source)}, bucket, _key(target))
    except ClientError as exc:
        if _missing(exc):
            return False
        raise
    return True


def orphans_remove(*, before: datetime) -> tuple[int, int]:
    """Delete objects last written before `before` that no row names (uploaded by a transaction that rolled
    back) and the collector's leftovers (it was stopped between its two steps): (count, bytes)."""
    count = size = 0
    for summary in _storage().bucket.objects.filter(Prefix=_key("")):
        if summary.last_modified < before and _remove_if_orphan(summary.key, before):
            count, size = count + 1, size + summary.size
    return count, size


def _remove_if_orphan(key: str, before: datetime) -> bool:
    sha = key.rsplit("/", 1)[-1].split(TRASH)[0]
    if len(sha) != 64:
        return False  # not ours
    with transaction.atomic():
        if not _lock(sha, wait=False):
            return False  # a blob_put of these bytes is uploading: its row may be about to commit
        if TRASH not in key and Blob.objects.filter(pk=sha).exists():
            return False
        head = _head(key)
        if head is None or head["LastModified"] >= before:
            return False  # gone, or written again since it was listed
        _client().delete_object(Bucket=bucket_name(), Key=key)
    return True


def _head(key: str) -> dict[str, Any] | None:
    try:
        return dict(_client().head_object(Bucket=bucket_name(), Key=key))
    except ClientError as exc:
        if _missing(exc):
            return None
        raise
