"""Blobs in an S3-compatible bucket (projects/blob_store.py, STORAGES["blobs"] = django-storages' S3Storage)
against a real S3-compatible server in its own process: SeaweedFS (devstack/s3.py). Stored, read, served
by daphne's blob server, read by another process with another BLOB_ROOT (another machine), collected and
swept like local files, and never swept while a blob_put of the same bytes is uploading."""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from botocore.exceptions import ClientError
from django.conf import settings
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection, transaction
from django.test import override_settings
from django.utils import timezone

from devstack.s3 import S3Server
from devstack.stack import ROOT, free_port
from projects import blob_store, storage
from projects.blobs import blob_put, blob_read_buffer
from projects.models import Blob
from tests.integration.test_blob_server import fetch, public_put

pytestmark = pytest.mark.django_db(transaction=True)  # the blob server and the lock use other connections


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    with S3Server(tmp_path_factory.mktemp("seaweedfs") / "s3.log") as server:
        yield server


@pytest.fixture
def bucket(s3: S3Server) -> Iterator[str]:
    name = s3.create_bucket(f"crowdtrain-{uuid.uuid4().hex[:12]}")
    with override_settings(STORAGES={**settings.STORAGES, "blobs": s3.storage_option(name)}):
        assert blob_store.remote()
        yield name


def objects(s3: S3Server, bucket: str) -> dict[str, bytes]:
    client = s3.client()
    listed = client.list_objects_v2(Bucket=bucket).get("Contents", [])
    return {item["Key"]: client.get_object(Bucket=bucket, Key=item["Key"])["Body"].read() for item in listed}


def key(sha: str) -> str:
    return f"blobs/{sha[:2]}/{sha}"


def test_blobs_are_stored_in_the_bucket_not_on_disk(s3: S3Server, bucket: str) -> None:
    pieces: list[bytes | memoryview] = [b"header", memoryview(b"x" * 3_000_000), b"tail"]  # never joined
    data = b"".join(pieces)
    blob = blob_put(data=pieces)
    assert blob.sha256 == hashlib.sha256(data).hexdigest() and blob.size == len(data)
    assert objects(s3, bucket) == {key(blob.sha256): data}
    assert not blob.path.exists()
    assert blob.read() == data
    buffer = blob_read_buffer(blob=blob)
    assert bytes(buffer) == data and not buffer.readonly
    assert blob_put(data=data).pk == blob.pk and len(objects(s3, bucket)) == 1  # stored once


def test_the_blob_server_streams_from_the_bucket(bucket: str) -> None:
    data = b"weights!" * 200_000  # more than one chunk
    blob = public_put(data)
    response = fetch(f"/blobs/{blob.sha256}")
    assert response["status"] == 200 and response["body"] == data
    blob_store.discard(trash=Blob.storage_name(blob.sha256))  # the object lost behind the row's back
    assert fetch(f"/blobs/{blob.sha256}")["status"] == 404


def test_another_machine_reads_the_blob(tmp_path: Path, bucket: str, s3: S3Server) -> None:
    """A process with its own (empty) BLOB_ROOT, as on another machine, reads what this one stored."""
    data = os.urandom(50_000)
    blob = blob_put(data=data)
    env = {
        **os.environ,
        "CROWDTRAIN_VAR_DIR": str(tmp_path),
        "MEDIA_ROOT": str(tmp_path / "media"),
        "DATABASE_URL": _database_url(),
        **s3.env(bucket),
    }
    code = (
        "import django, hashlib; django.setup(); from projects.models import Blob; "
        f"print(hashlib.sha256(Blob.objects.get(pk={blob.sha256!r}).read()).hexdigest())"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == blob.sha256
    assert not (tmp_path / "media").exists()


def _database_url() -> str:
    db = connection.settings_dict
    return f"postgres://{db['USER']}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{db['NAME']}"


def test_collected_blobs_leave_the_bucket(s3: S3Server, bucket: str) -> None:
    kept, collected = blob_put(data=b"referenced"), blob_put(data=b"unreferenced")
    public_put(b"referenced")  # a running project's graph now
    Blob.objects.update(stored_at=timezone.now() - timedelta(days=2))
    result = storage.blobs_collect_garbage(grace_seconds=0)
    assert result.blobs == 1 and result.bytes == len(b"unreferenced")
    assert set(objects(s3, bucket)) == {key(kept.sha256)}
    assert not Blob.objects.filter(pk=collected.pk).exists()


def test_a_failed_collection_puts_the_object_back(s3: S3Server, bucket: str) -> None:
    blob = blob_put(data=b"moved and back")
    moved = storage.Moved.aside(blob.sha256)
    assert set(objects(s3, bucket)) == {f"blobs/{moved.trash}"}
    moved.restore()
    assert objects(s3, bucket) == {key(blob.sha256): b"moved and back"}


def test_orphans_are_swept_but_never_while_uploading(s3: S3Server, bucket: str) -> None:
    with pytest.raises(RuntimeError), transaction.atomic():
        orphan = blob_put(data=b"rolled back")  # its row never commits; its object stays behind
        raise RuntimeError
    uploading = hashlib.sha256(b"being uploaded").hexdigest()
    blob_put(data=b"being uploaded")
    Blob.objects.filter(pk=uploading).delete()  # as if its row were not committed yet
    kept = blob_put(data=b"kept")
    later = timezone.now() + timedelta(seconds=5)
    with _lock_held_elsewhere(uploading):  # a blob_put of these bytes, still in its transaction
        assert storage._sweep_orphan_files(before=later) == (1, len(b"rolled back"))
    assert set(objects(s3, bucket)) == {key(uploading), key(kept.sha256)}
    assert key(orphan.sha256) not in objects(s3, bucket)
    assert storage._sweep_orphan_files(before=later) == (1, len(b"being uploaded"))  # now it may go


class _lock_held_elsewhere:  # noqa: N801 - used as a context manager, like contextlib's helpers
    """blob_store's advisory lock on `sha`, held by another connection (another process's blob_put)."""

    def __init__(self, sha: str) -> None:
        self.sha, self.taken, self.release = sha, threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._hold, daemon=True)

    def _hold(self) -> None:
        try:
            with transaction.atomic():
                blob_store._lock(self.sha)
                self.taken.set()
                self.release.wait(30)
        finally:
            connection.close()

    def __enter__(self) -> None:
        self.thread.start()
        assert self.taken.wait(30)

    def __exit__(self, *exc_info: object) -> None:
        self.release.set()
        self.thread.join(30)


def test_the_release_step_creates_a_missing_bucket(s3: S3Server) -> None:
    name = f"crowdtrain-{uuid.uuid4().hex[:12]}"
    with override_settings(STORAGES={**settings.STORAGES, "blobs": s3.storage_option(name)}):
        assert _blob_bucket() == f"Created the bucket {name}."
        assert name in [bucket["Name"] for bucket in s3.client().list_buckets()["Buckets"]]
        assert _blob_bucket() == f"The bucket {name} exists."
        blob = blob_put(data=b"first weights")
        assert objects(s3, name) == {key(blob.sha256): b"first weights"}


def test_a_bucket_these_keys_may_not_see_is_an_error_not_a_new_bucket(s3: S3Server, bucket: str) -> None:
    option = s3.storage_option(bucket)
    option["OPTIONS"] = {**option["OPTIONS"], "secret_key": "not-the-secret"}
    refused = pytest.raises(CommandError, match=f"The bucket {bucket} cannot be checked or created")
    with override_settings(STORAGES={**settings.STORAGES, "blobs": option}), refused as raised:
        _blob_bucket()
    assert isinstance(raised.value.__cause__, ClientError)


def test_an_unreachable_or_misnamed_bucket_is_one_clear_error(s3: S3Server) -> None:
    unreachable = s3.storage_option("crowdtrain-blobs")
    unreachable["OPTIONS"] = {**unreachable["OPTIONS"], "endpoint_url": f"http://127.0.0.1:{free_port()}"}
    for option in (unreachable, s3.storage_option("Not A Bucket Name!")):
        refused = pytest.raises(CommandError, match="cannot be checked or created")
        with override_settings(STORAGES={**settings.STORAGES, "blobs": option}), refused:
            _blob_bucket()


def test_local_blobs_need_no_bucket() -> None:
    assert not blob_store.remote()
    assert _blob_bucket() == "Blobs are files under BLOB_ROOT: no bucket to create."


def _blob_bucket() -> str:
    out = io.StringIO()
    call_command("blob_bucket", stdout=out)
    return out.getvalue().strip()
