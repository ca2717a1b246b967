"""projects/blobs.py's blob_put on local files: a large blob is written by a thread of its own while the
caller hashes it, from an iterator of pieces consumed as they come; blob_put_computed runs an iterator that
computes its pieces (the publish step's) in a thread of its own, which then writes them."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.db import connection
from django.test.utils import CaptureQueriesContext

from projects import blobs
from projects.blobs import blob_put, blob_put_computed
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


class Hashed:
    """hashlib.sha256 for blobs, telling when a piece of `size` bytes is hashed."""

    def __init__(self, size: int) -> None:
        self.size, self.done = size, threading.Event()

    def sha256(self) -> Any:
        digest, outer = hashlib.sha256(), self

        class Digest:
            def update(self, piece: bytes | memoryview) -> None:
                digest.update(piece)
                if memoryview(piece).nbytes == outer.size:
                    outer.done.set()

            def hexdigest(self) -> str:
                return digest.hexdigest()

        return Digest()


def test_computed_pieces_are_hashed_as_another_thread_computes_them_and_then_written(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The second piece is computed only once the first is hashed, in a thread other than the caller's: a
    blob_put_computed that computed everything before hashing would wait forever (here: fail after 10 s)."""
    first, second = b"f" * PIECE, b"g" * (PIECE + 1)
    hashed, computing = Hashed(PIECE), []
    monkeypatch.setattr(blobs, "hashlib", hashed)

    def pieces() -> Iterator[bytes]:
        computing.append(threading.current_thread())
        yield first
        assert hashed.done.wait(10), "the first piece was not hashed while the rest was computed"
        assert not spooled()  # the file is created once they are all computed, off the way to the first
        yield second

    blob = blob_put_computed(pieces=pieces())
    assert computing != [threading.current_thread()]
    assert blob.sha256 == hashlib.sha256(first + second).hexdigest() and blob.size == 2 * PIECE + 1
    assert Path(blob.path).read_bytes() == first + second
    assert not spooled()


def test_a_failure_computing_the_pieces_is_raised_and_leaves_no_file_and_no_row() -> None:
    def pieces() -> Iterator[bytes]:
        yield b"h" * PIECE
        raise RuntimeError("the step failed")

    with pytest.raises(RuntimeError, match="the step failed"):
        blob_put_computed(pieces=pieces())
    assert not spooled() and not Blob.objects.exists()


def test_storing_bytes_again_returns_the_row_as_stored_in_one_query() -> None:
    """The row comes back from the upsert itself (RETURNING): as first stored (its created_at and
    content_type), with stored_at refreshed for the garbage collector."""
    first = blob_put(data=b"json bytes", content_type="application/json")
    with CaptureQueriesContext(connection) as queries:
        again = blob_put(data=b"json bytes")
    on_blobs = [q["sql"] for q in queries.captured_queries if Blob._meta.db_table in q["sql"]]
    assert len(on_blobs) == 1 and on_blobs[0].startswith("INSERT")
    assert (again.pk, again.created_at, again.content_type) == (
        first.pk,
        first.created_at,
        "application/json",
    )
    assert again.stored_at > first.stored_at
    assert Blob.objects.get(pk=first.pk).stored_at == again.stored_at
