"""Resumable uploads: create, append a chunk at the current offset, read the complete file, discard.

A chunk is copied from the request's stream (daphne spools bodies to disk above FILE_UPLOAD_MAX_MEMORY_SIZE)
to the upload's file a megabyte at a time. The row is locked while a chunk is written, so two clients sending
the same offset cannot interleave: the second sees the new offset and is refused.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import IO
from uuid import UUID

from django.conf import settings
from django.contrib.auth.models import User
from django.db import transaction
from django.utils import timezone

from uploads.models import Upload

COPY_CHUNK = 1 << 20
MAX_OPEN_UPLOADS = 5  # unfinished uploads per user: disk held is at most this many times the size limit
MAX_FILENAME = 255


class UploadError(ValueError):
    """The upload cannot take this request; the message says why."""


class OffsetMismatch(UploadError):
    def __init__(self, upload: Upload) -> None:
        super().__init__(f"Upload-Offset must be the current offset, {upload.offset}.")
        self.offset = upload.offset


def upload_create(*, owner: User, filename: str, size: int) -> Upload:
    limit = settings.CROWDTRAIN["MAX_DATASET_BYTES"]
    if not 0 < size <= limit:
        raise UploadError(f"The size must be between 1 and {limit:,} bytes; it is {size:,}.")
    uploads_expire()
    if Upload.objects.filter(owner=owner).count() >= MAX_OPEN_UPLOADS:
        raise UploadError(f"You have {MAX_OPEN_UPLOADS} unfinished uploads: finish or use one first.")
    upload = Upload.objects.create(owner=owner, filename=filename[:MAX_FILENAME], size=size)
    upload.path.parent.mkdir(parents=True, exist_ok=True)
    upload.path.touch()
    return upload


def upload_append(
    *, upload_id: UUID | str, owner: User, offset: int, length: int, stream: IO[bytes]
) -> Upload:
    """Write `length` bytes from `stream` at `offset`, which must be the upload's current offset."""
    with transaction.atomic():
        upload = Upload.objects.select_for_update().get(pk=upload_id, owner=owner)
        if offset != upload.offset:
            raise OffsetMismatch(upload)
        if length > upload.size - upload.offset:
            raise UploadError(f"{length:,} bytes would pass the declared size ({upload.size:,} bytes).")
        _copy(stream=stream, upload=upload, length=length)
        upload.offset += length
        upload.save(update_fields=["offset", "updated_at"])
    return upload


def _copy(*, stream: IO[bytes], upload: Upload, length: int) -> None:
    """Nothing counts unless all `length` bytes arrive: a client cut off mid-chunk resends it."""
    with upload.path.open("r+b") as handle:
        handle.seek(upload.offset)
        left = length
        while left > 0:
            chunk = stream.read(min(COPY_CHUNK, left))
            if not chunk:
                raise UploadError(f"The body ended {left:,} bytes short of its Content-Length.")
            handle.write(chunk)
            left -= len(chunk)
        handle.truncate(upload.offset + length)


@contextmanager
def upload_consume(*, upload_id: UUID | str, owner: User) -> Iterator[IO[bytes]]:
    """The complete upload's file, open for reading; the upload is gone afterwards, whatever happens."""
    upload = Upload.objects.filter(pk=upload_id, owner=owner).first()
    if upload is None:
        raise UploadError("No such upload.")
    try:
        if not upload.complete:
            raise UploadError(f"The upload is incomplete: {upload.offset:,} of {upload.size:,} bytes.")
        with upload.path.open("rb") as handle:
            yield handle
    finally:
        upload_discard(upload=upload)


def upload_discard(*, upload: Upload) -> None:
    upload.path.unlink(missing_ok=True)
    upload.delete()


def uploads_expire() -> int:
    """Remove uploads untouched for UPLOAD_EXPIRY_HOURS (abandoned by their clients)."""
    hours = settings.CROWDTRAIN["UPLOAD_EXPIRY_HOURS"]
    stale = list(Upload.objects.filter(updated_at__lt=timezone.now() - timedelta(hours=hours)))
    for upload in stale:
        upload_discard(upload=upload)
    return len(stale)
