"""Who may do what, through every API route and object type: another researcher (mallory) cannot read the
private data of, change, start, pause or delete the owner's projects, datasets, checkpoints of drafts,
uploads or tokens; anonymous users cannot write; users who are not approved researchers cannot get tokens.
Nothing a refused request asked for happened: each test checks the database afterwards."""

from __future__ import annotations

import base64
import uuid
from typing import Any

import pytest
from django.contrib.auth.models import User
from knox.models import AuthToken
from rest_framework.test import APIClient

from projects.models import Dataset, Project
from projects.services import project_create
from uploads.models import Upload
from uploads.services import upload_create

pytestmark = pytest.mark.django_db


@pytest.fixture
def draft(owner: User, digits_dataset: Dataset) -> Project:
    return project_create(owner=owner, name="Secret draft", dataset=digits_dataset, preset="mlp")


@pytest.fixture
def upload(owner: User) -> Upload:
    return upload_create(owner=owner, filename="secret.npz", size=1000)


def snapshot() -> list[Any]:
    projects = list(
        Project.objects.order_by("pk").values_list("pk", "name", "status", "learning_rate", "description")
    )
    return [
        projects,
        list(Dataset.objects.values_list("pk", flat=True)),
        list(Upload.objects.values_list("pk", "offset")),
    ]


def project_writes(pk: int) -> list[tuple[str, str, dict[str, Any]]]:
    return [
        ("patch", f"/api/projects/{pk}/", {"learning_rate": 0.5, "name": "taken over"}),
        ("post", f"/api/projects/{pk}/start/", {}),
        ("post", f"/api/projects/{pk}/pause/", {}),
        ("delete", f"/api/projects/{pk}/", {}),
    ]


def call(client: APIClient, method: str, url: str, data: dict[str, Any]) -> Any:
    return getattr(client, method)(url, data, format="json")


def test_another_researchers_running_project_is_readable_but_not_writable(
    intruder_api: APIClient, mlp_project: Project
) -> None:
    assert intruder_api.get(f"/api/projects/{mlp_project.pk}/").status_code == 200  # public
    before = snapshot()
    for method, url, data in project_writes(mlp_project.pk):
        response = call(intruder_api, method, url, data)
        assert response.status_code == 403 and response.json()["detail"] == "This project is not yours.", url
    assert snapshot() == before


def test_another_researchers_draft_does_not_exist_for_them(intruder_api: APIClient, draft: Project) -> None:
    before = snapshot()
    for suffix in ("", "metrics/", "versions/", "checkpoint/", "checkpoint/?version=0"):
        assert intruder_api.get(f"/api/projects/{draft.pk}/{suffix}").status_code == 404, suffix
    for method, url, data in project_writes(draft.pk):
        assert call(intruder_api, method, url, data).status_code == 404, url
    assert "Secret draft" not in str(intruder_api.get("/api/projects/").json())
    assert "Secret draft" not in str(intruder_api.get("/api/projects/?mine=1").json())
    assert snapshot() == before


def test_anonymous_users_see_no_drafts_and_cannot_write(
    anonymous: APIClient, draft: Project, mlp_project: Project, digits_dataset: Dataset, upload: Upload
) -> None:
    before = snapshot()
    assert anonymous.get(f"/api/projects/{draft.pk}/checkpoint/").status_code == 404
    for method, url, data in [
        *project_writes(mlp_project.pk),
        *project_writes(draft.pk),
        ("post", "/api/projects/", {"name": "anon", "dataset": digits_dataset.pk, "preset": "mlp"}),
        ("get", "/api/datasets/", {}),
        ("post", "/api/datasets/", {"name": "anon", "upload": str(upload.pk)}),
        ("get", f"/api/datasets/{digits_dataset.pk}/", {}),
        ("delete", f"/api/datasets/{digits_dataset.pk}/", {}),
        ("post", "/api/uploads/", {"filename": "x.npz", "size": 10}),
        ("get", f"/api/uploads/{upload.pk}/", {}),
        ("put", f"/api/uploads/{upload.pk}/", {}),
        ("post", "/api/auth/logout/", {}),
        ("get", "/api/me/", {}),
    ]:
        assert call(anonymous, method, url, data).status_code == 401, (method, url)
    assert snapshot() == before


def test_another_researchers_datasets_and_uploads_do_not_exist_for_them(
    intruder_api: APIClient, digits_dataset: Dataset, upload: Upload
) -> None:
    before = snapshot()
    assert intruder_api.get("/api/datasets/").json()["count"] == 0
    assert intruder_api.get(f"/api/datasets/{digits_dataset.pk}/").status_code == 404
    assert intruder_api.delete(f"/api/datasets/{digits_dataset.pk}/").status_code == 404
    assert intruder_api.get(f"/api/uploads/{upload.pk}/").status_code == 404
    put = intruder_api.generic(
        "PUT", f"/api/uploads/{upload.pk}/", "x" * 10, "application/octet-stream", HTTP_UPLOAD_OFFSET="0"
    )
    assert put.status_code == 404
    consumed = intruder_api.post(
        "/api/datasets/", {"name": "stolen", "upload": str(upload.pk)}, format="json"
    )
    assert consumed.status_code == 400 and consumed.json()["detail"] == "No such upload."
    assert snapshot() == before


def test_a_project_cannot_be_created_on_another_researchers_dataset(
    intruder_api: APIClient, digits_dataset: Dataset
) -> None:
    response = intruder_api.post(
        "/api/projects/", {"name": "parasite", "dataset": digits_dataset.pk, "preset": "mlp"}
    )
    assert response.status_code == 400 and response.json()["dataset"] == ["No dataset of yours has this id."]
    assert not Project.objects.filter(name="parasite").exists()


def test_volunteers_cannot_write_or_get_tokens(
    volunteer_api: APIClient, volunteer_user: User, digits_dataset: Dataset
) -> None:
    for method, url, data in [
        ("post", "/api/projects/", {"name": "v", "dataset": digits_dataset.pk, "preset": "mlp"}),
        ("get", "/api/datasets/", {}),
        ("post", "/api/uploads/", {"filename": "x.npz", "size": 10}),
    ]:
        response = call(volunteer_api, method, url, data)
        assert response.status_code == 403 and "approved researchers" in response.json()["detail"], url
    basic = base64.b64encode(b"alice:alice-pass-123").decode()
    refused = APIClient().post("/api/auth/login/", HTTP_AUTHORIZATION=f"Basic {basic}")
    assert refused.status_code == 403 and "request a researcher account" in refused.json()["detail"]
    assert not AuthToken.objects.filter(user=volunteer_user).exists()


def test_a_token_logs_out_only_itself(owner: User, api: APIClient) -> None:
    from tests.api.conftest import token_client

    other = token_client(owner)
    assert api.post("/api/auth/logout/").status_code == 204
    assert api.get("/api/me/").status_code == 401
    assert other.get("/api/me/").status_code == 200


def test_garbage_ids_are_json_404s(api: APIClient) -> None:
    for url in (
        "/api/projects/null/",
        "/api/uploads/not-a-uuid/",
        f"/api/uploads/{uuid.uuid4()}/",
        "/api/nothing/",
    ):
        response = api.get(url)
        assert response.status_code == 404 and response["Content-Type"] == "application/json", url
