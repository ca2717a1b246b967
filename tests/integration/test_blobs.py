"""projects/blobs.py's blob_put on local files: a large blob is written by a thread of its own while the
caller hashes it, from an iterator of pieces consumed as they come (the publish step's)."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.conf import settings

from projects import blobs
from projects.blobs import blob_put
from projects.models import Blob

pytestmark = pytest.mark.django_db(transaction=True)
PIECE = 3 << 20


def spooled() -> list[Path]:
    return list((Path(settings.BLOB_ROOT) / blobs.SPOOL_DIR).glob(".tmp-*"))


def test_pieces_are_written_while_they_are_hashed() -> None:
    """The second piece is yielded only once the first is on disk: a blob_put that hashed everything
    before writing anything would wait forever (here: fail after 10 s)."""
    first, second = b"a" * PIECE, b"b" * PIECE

    def pieces() -> Iterator[bytes]:
        yield first
        deadline = time.monotonic() + 10
        while not any(path.stat().st_size >= PIECE for path in spooled()):
            assert time.monotonic() < deadline, "the first piece was not written while the rest was hashed"
            time.sleep(0.01)
        yield second

    blob = blob_put(data=pieces())
    assert blob.sha256 == hashlib.sha256(first + second).hexdigest() and blob.size == 2 * PIECE
    assert Path(blob.path).read_bytes() == first + second
    assert not spooled()


def test_a_failure_in_the_middle_of_the_pieces_leaves_no_file_and_no_row() -> None:
    def pieces() -> Iterator[bytes]:
        yield b"c" * PIECE
        raise RuntimeError("the step failed")

    with pytest.raises(RuntimeError, match="the step failed"):
        blob_put(data=pieces())
    assert not spooled() and not Blob.objects.exists()


def test_storing_a_large_blob_again_keeps_one_file() -> None:
    data = [memoryview(b"d" * PIECE), memoryview(b"e" * PIECE)]
    first, again = blob_put(data=data), blob_put(data=iter(data))
    assert first.pk == again.pk and Path(first.path).read_bytes() == b"d" * PIECE + b"e" * PIECE
    assert not spooled() and Blob.objects.count() == 1
