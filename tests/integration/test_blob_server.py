"""projects/blob_server.py through the real ASGI application (the same one daphne runs).

Here every blob is made public (the graph of a running project); who may read which blob is in
tests/security/test_blobs.py."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
from asgiref.sync import async_to_sync
from channels.testing import HttpCommunicator
from django.contrib.auth.models import User

from config.asgi import application
from projects import blob_server
from projects.blobs import blob_put
from projects.models import Blob, Dataset, Project

pytestmark = pytest.mark.django_db(transaction=True)  # the lookup runs on a pool thread's own connection


def fetch(path: str, method: str = "GET", headers: list[tuple[bytes, bytes]] | None = None) -> dict[str, Any]:
    response = async_to_sync(HttpCommunicator(application, method, path, headers=headers).get_response)()
    response["headers"] = dict(response["headers"])
    return response


def public_put(data: bytes, content_type: str = "application/octet-stream") -> Blob:
    blob = blob_put(data=data, content_type=content_type)
    owner = User.objects.get_or_create(username="owner")[0]
    dataset = Dataset.objects.create(
        owner=owner, name="d", input_shape=[1], num_classes=2, train_samples=1, test_samples=1
    )
    Project.objects.create(
        owner=owner,
        name=blob.sha256,
        dataset=dataset,
        graph=blob,
        flops_per_sample=1,
        status=Project.Status.RUNNING,
    )
    return blob


def test_blob_is_served_immutable_with_etag() -> None:
    data = b"weights!" * 200_000  # 1.6 MB: more than one chunk
    blob = public_put(data, content_type="application/octet-stream")
    response = fetch(f"/blobs/{blob.sha256}")

    assert response["status"] == 200 and response["body"] == data
    assert response["headers"][b"cache-control"] == b"public, max-age=31536000, immutable"
    assert response["headers"][b"etag"] == f'"{blob.sha256}"'.encode()
    assert response["headers"][b"content-type"] == b"application/octet-stream"
    assert response["headers"][b"content-length"] == str(len(data)).encode()
    assert response["headers"][b"x-content-type-options"] == b"nosniff"


def test_a_public_blob_is_looked_up_once_while_a_granted_one_every_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A round's volunteers all fetch the new version at once: one lookup for all of them. A blob that is
    not public (a shard, with its grant) is looked up at every request, so its rights apply at once."""
    public = public_put(b"new version")
    private = blob_put(data=b"a shard")
    asked: list[str] = []
    look_up = blob_server.blob_access

    def counted(*, sha256: str, grant: str | None) -> Any:
        asked.append(sha256)
        return look_up(sha256=sha256, grant=grant)

    monkeypatch.setattr(blob_server, "blob_access", counted)
    assert [fetch(f"/blobs/{public.sha256}")["status"] for _ in range(3)] == [200, 200, 200]
    assert [fetch(f"/blobs/{private.sha256}?grant=x")["status"] for _ in range(2)] == [403, 403]
    assert asked == [public.sha256] + [private.sha256] * 2
    monkeypatch.setattr(blob_server._Public, "SECONDS", 0.0)  # forgotten once its seconds have passed
    blob_server.PUBLIC.clear()
    fetch(f"/blobs/{public.sha256}")
    fetch(f"/blobs/{public.sha256}")
    assert asked[3:] == [public.sha256] * 2


def test_graphs_keep_their_content_type() -> None:
    blob = public_put(b'{"nodes": []}', content_type="application/json")
    assert fetch(f"/blobs/{blob.sha256}")["headers"][b"content-type"] == b"application/json"


def test_revalidation_head_and_wrong_methods() -> None:
    blob = public_put(b"weights")
    etag = f'"{blob.sha256}"'.encode()

    again = fetch(f"/blobs/{blob.sha256}", headers=[(b"if-none-match", etag)])
    assert again["status"] == 304 and again["body"] == b"" and again["headers"][b"etag"] == etag
    head = fetch(f"/blobs/{blob.sha256}", method="HEAD")
    assert head["status"] == 200 and head["body"] == b"" and head["headers"][b"content-length"] == b"7"
    post = fetch(f"/blobs/{blob.sha256}", method="POST")
    assert post["status"] == 405 and post["headers"][b"allow"] == b"GET, HEAD"


@pytest.mark.parametrize(
    "name",
    [
        hashlib.sha256(b"never stored").hexdigest(),
        "abc",
        "A" * 64,
        "g" * 64,
        "0" * 65,
        "..%2F..%2Fsettings.py",
    ],
)
def test_unknown_or_malformed_blob_is_404(name: str) -> None:
    assert fetch(f"/blobs/{name}")["status"] == 404


def test_blob_row_without_file_is_404() -> None:
    blob = public_put(b"soon gone")
    blob.path.unlink()
    assert fetch(f"/blobs/{blob.sha256}")["status"] == 404


def test_other_paths_still_reach_django() -> None:
    response = fetch("/api/projects/", headers=[(b"host", b"localhost")])
    assert response["status"] == 200 and response["body"].startswith(b'{"count":')
