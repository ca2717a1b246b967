"""Issue 9, finding 6: who may download which blob, through the real ASGI application daphne runs.

Found: a paused or deleted project's weights, its dataset shards, a volunteer's upload and the server's
spot-check reference stayed downloadable anonymously forever (`immutable`, a year, no `nosniff`). Now only
the graph and weights of a running or finished project are public; shards go to the volunteer holding a
work unit through a signed, expiring URL from the assign message, and to their owner and superusers;
results and references to their owner and superusers only; a rejected upload to nobody.
"""

from __future__ import annotations

import time
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from asgiref.sync import async_to_sync
from channels.testing import HttpCommunicator
from django.conf import settings
from django.contrib.auth.models import User
from django.core.signing import TimestampSigner, b62_encode
from django.test import Client

from config.asgi import application
from projects import blob_server
from projects.blobs import blob_put
from projects.lifecycle import work_unit_assign
from projects.models import Blob, ModelVersion, Project, Result
from projects.services import project_pause
from workers.protocol import assign_message

pytestmark = pytest.mark.django_db(transaction=True)  # the blob server reads on a pool thread's connection
PUBLIC = b"public, max-age=31536000, immutable"
PRIVATE = b"private, no-store"


def fetch(url: str, user: User | None = None, method: str = "GET") -> dict[str, Any]:
    parts = urlsplit(url)
    headers = [(b"host", b"localhost"), *session_cookie(user)]
    communicator = HttpCommunicator(application, method, parts.path, headers=headers)
    communicator.scope["query_string"] = parts.query.encode()
    response = async_to_sync(communicator.get_response)(timeout=30)
    response["headers"] = dict(response["headers"])
    return response


def session_cookie(user: User | None) -> list[tuple[bytes, bytes]]:
    if user is None:
        return []
    client = Client()
    client.force_login(user)
    cookie = client.cookies[settings.SESSION_COOKIE_NAME].value
    return [(b"cookie", f"{settings.SESSION_COOKIE_NAME}={cookie}".encode())]


@pytest.fixture
def assigned(mlp_project: Project, volunteer_user: User) -> Result:
    result = work_unit_assign(user=volunteer_user)
    assert result is not None
    return result


def shard_url(result: Result) -> str:
    return str(assign_message(result)["work_unit"]["shards"][0]["url"])


def assert_private(response: dict[str, Any], data: bytes) -> None:
    assert response["status"] == 200 and response["body"] == data
    assert response["headers"][b"cache-control"] == PRIVATE
    assert response["headers"][b"x-content-type-options"] == b"nosniff"


# --- public: graphs and weights of running or finished projects -------------------------------------


def test_graph_and_weights_of_a_running_project_are_public(mlp_project: Project) -> None:
    version = mlp_project.current_version()
    for blob in (mlp_project.graph, version.wire_blob):
        response = fetch(blob.url)
        assert response["status"] == 200 and response["body"] == blob.read()
        assert response["headers"][b"cache-control"] == PUBLIC
        assert response["headers"][b"x-content-type-options"] == b"nosniff"


@pytest.mark.parametrize("status", [Project.Status.PAUSED, Project.Status.DRAFT])
def test_graph_and_weights_of_a_stopped_project_are_not(mlp_project: Project, status: str) -> None:
    Project.objects.filter(pk=mlp_project.pk).update(status=status)
    for blob in (mlp_project.graph, mlp_project.current_version().wire_blob):
        assert fetch(blob.url)["status"] == 404


def test_a_finished_projects_model_stays_public(mlp_project: Project) -> None:
    Project.objects.filter(pk=mlp_project.pk).update(status=Project.Status.FINISHED)
    assert fetch(mlp_project.current_version().wire_blob.url)["status"] == 200


def test_a_shard_that_is_also_a_stopped_projects_weights_is_private(assigned: Result) -> None:
    """Content-addressed dedup: one row, two roles. Public only through a graph or weights reference."""
    shard_blob = assigned.work_unit.shard.blob
    project = assigned.work_unit.project
    ModelVersion.objects.create(project=project, number=99, weights=shard_blob)
    assert fetch(shard_blob.url)["headers"][b"cache-control"] == PUBLIC  # the project is running
    project_pause(project=project)
    # A web process remembers a public blob for seconds (browsers and proxies keep it a year): then private.
    assert fetch(shard_blob.url)["status"] == 200
    blob_server.PUBLIC.clear()
    assert fetch(shard_blob.url)["status"] == 404


# --- shards: signed, expiring URLs from the assign message -----------------------------------------


def test_anonymous_and_other_volunteers_cannot_read_shards(assigned: Result, other_volunteer: User) -> None:
    blob = assigned.work_unit.shard.blob
    assert fetch(blob.url)["status"] == 404
    assert fetch(blob.url, user=other_volunteer)["status"] == 404
    assert fetch(blob.url, user=assigned.volunteer)["status"] == 404  # the URL alone is not enough


def test_the_signed_url_works_for_its_holder(assigned: Result) -> None:
    url = shard_url(assigned)
    blob = assigned.work_unit.shard.blob
    assert urlsplit(url).path == blob.url  # clients cache shards by path; the grant is the query
    assert_private(fetch(url), blob.read())
    head = fetch(url, method="HEAD")
    assert head["status"] == 200 and head["body"] == b""
    assert head["headers"][b"content-length"] == str(blob.size).encode()


def test_the_signed_url_expires(assigned: Result, monkeypatch: pytest.MonkeyPatch) -> None:
    an_hour_ago = int(time.time()) - settings.CROWDTRAIN_SHARD_URL_SECONDS - 1
    monkeypatch.setattr(TimestampSigner, "timestamp", lambda self: b62_encode(an_hour_ago))
    response = fetch(shard_url(assigned))
    assert response["status"] == 403 and b"expired" in response["body"]


def test_a_paused_or_deleted_projects_shards_are_refused(assigned: Result) -> None:
    url = shard_url(assigned)
    project_pause(project=assigned.work_unit.project)
    assert fetch(url)["status"] == 403

    Project.objects.filter(pk=assigned.work_unit.project_id).delete()
    assert fetch(url)["status"] == 403


def test_a_grant_is_for_one_shard_only(assigned: Result, researcher: User) -> None:
    grant = parse_qs(urlsplit(shard_url(assigned)).query)
    other = assigned.work_unit.shard.dataset.shards.exclude(blob=assigned.work_unit.shard.blob).first()
    assert other is not None
    query = "&".join(f"{key}={value[0]}" for key, value in grant.items())
    assert fetch(f"{other.blob.url}?{query}")["status"] == 403
    weights = assigned.work_unit.version.wire_blob
    Project.objects.filter(pk=assigned.work_unit.project_id).update(status=Project.Status.PAUSED)
    assert fetch(f"{weights.url}?{query}")["status"] == 403  # not a shard of the project


@pytest.mark.parametrize("grant", ["", "x", "1.1:abc:def", "ž" * 10, "1" * 5000, "%00"])
def test_forged_grants_are_refused(assigned: Result, grant: str) -> None:
    response = fetch(f"{assigned.work_unit.shard.blob.url}?grant={grant}")
    assert response["status"] == 403 and response["headers"][b"x-content-type-options"] == b"nosniff"


# --- owners and superusers, through the session (the admin's links) --------------------------------


def test_the_owner_and_superusers_read_shards_others_do_not(assigned: Result, researcher: User) -> None:
    blob = assigned.work_unit.shard.blob
    assert_private(fetch(blob.url, user=researcher), blob.read())
    admin = User.objects.create_superuser("root", password="root-pass-123")
    assert_private(fetch(blob.url, user=admin), blob.read())
    stranger = User.objects.create_user("lab2", password="lab2-pass-123", is_staff=True)
    assert fetch(blob.url, user=stranger)["status"] == 404


def test_results_and_references_are_never_served_to_volunteers(assigned: Result, researcher: User) -> None:
    upload, reference = blob_put(data=b"an update"), blob_put(data=b"the server's update")
    Result.objects.filter(pk=assigned.pk).update(blob=upload, status=Result.Status.RECEIVED)
    type(assigned.work_unit).objects.filter(pk=assigned.work_unit_id).update(reference=reference)

    for blob in (upload, reference):
        assert fetch(blob.url)["status"] == 404
        assert fetch(blob.url, user=assigned.volunteer)["status"] == 404
        assert fetch(f"{blob.url}?{urlsplit(shard_url(assigned)).query}")["status"] == 403
        assert_private(fetch(blob.url, user=researcher), blob.read())


def test_a_rejected_upload_is_served_to_nobody(assigned: Result, researcher: User) -> None:
    upload = blob_put(data=b"a poisoned update")
    Result.objects.filter(pk=assigned.pk).update(blob=upload, validation=Result.Validation.INVALID)
    admin = User.objects.create_superuser("root", password="root-pass-123")
    for user in (None, assigned.volunteer, researcher, admin):
        assert fetch(upload.url, user=user)["status"] == 404


def test_an_orphan_blob_is_served_to_nobody() -> None:
    blob = blob_put(data=b"referenced by nothing")
    admin = User.objects.create_superuser("root", password="root-pass-123")
    assert fetch(blob.url, user=admin)["status"] == 404
    assert Blob.objects.filter(pk=blob.pk).exists()


# --- headers on pages too ----------------------------------------------------------------------------


def test_pages_say_nosniff(client: Client) -> None:
    assert client.get("/", HTTP_HOST="localhost")["X-Content-Type-Options"] == "nosniff"
    assert fetch("/blobs/" + "0" * 64)["headers"][b"x-content-type-options"] == b"nosniff"
