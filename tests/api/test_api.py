"""projects/api.py through DRF's test client: projects, versions, metrics, checkpoints and datasets, as their
owner sees them (who may not: test_authorisation.py; uploads: test_uploads.py)."""

from __future__ import annotations

import io
import json
from typing import Any

import pytest
import torch
from django.contrib.auth.models import User
from rest_framework.test import APIClient
from safetensors.torch import load as st_load

from engine import codecs
from engine.presets import export_preset
from projects.models import Dataset, Metric, ModelVersion, Project
from projects.services import version_publish, version_weights
from tests.conftest import mnist_arrays, npz_bytes

pytestmark = pytest.mark.django_db


def upload(api: APIClient, data: bytes, name: str = "data.npz") -> str:
    created = api.post("/api/uploads/", {"filename": name, "size": len(data)}, format="json")
    assert created.status_code == 201, created.content
    upload_id = created.json()["id"]
    put = api.put(
        f"/api/uploads/{upload_id}/", data, content_type="application/octet-stream", HTTP_UPLOAD_OFFSET="0"
    )
    assert put.status_code == 200 and put.json()["offset"] == len(data), put.content
    return str(upload_id)


def create_dataset(api: APIClient, name: str = "api digits") -> dict[str, Any]:
    x, y = mnist_arrays(per_class=30)
    response = api.post(
        "/api/datasets/", {"name": name, "upload": upload(api, npz_bytes(x=x, y=y))}, format="json"
    )
    assert response.status_code == 201, response.content
    return dict(response.json())


def test_the_public_list_is_paginated_running_first_and_hides_drafts(
    anonymous: APIClient, mlp_project: Project, owner: User, digits_dataset: Dataset
) -> None:
    from projects.services import project_create

    paused = project_create(owner=owner, name="A paused one", dataset=digits_dataset, preset="mlp")
    paused.status = Project.Status.PAUSED
    paused.save()
    project_create(owner=owner, name="A draft", dataset=digits_dataset, preset="mlp")

    body = anonymous.get("/api/projects/").json()
    assert body["count"] == 2 and body["next"] is None and body["previous"] is None
    assert [item["name"] for item in body["results"]] == ["MLP", "A paused one"]
    item = body["results"][0]
    assert item["owner"] == "researcher" and item["url"] == f"/projects/{mlp_project.pk}/"
    assert item["current_version"] == 0 and item["dataset"] == "digits" and item["mode"] == "sync_sgd"
    assert item["target_metric"] == "test_accuracy" and item["target_value"] is None


def test_mine_lists_own_projects_drafts_included(
    api: APIClient, anonymous: APIClient, owner: User, digits_dataset: Dataset
) -> None:
    from projects.services import project_create

    project_create(owner=owner, name="My draft", dataset=digits_dataset, preset="mlp")
    assert [p["name"] for p in api.get("/api/projects/?mine=1").json()["results"]] == ["My draft"]
    assert anonymous.get("/api/projects/?mine=1").status_code == 401


def test_create_from_a_preset_and_start(api: APIClient) -> None:
    dataset = create_dataset(api)
    response = api.post(
        "/api/projects/",
        {
            "name": "From the API",
            "dataset": dataset["id"],
            "preset": "mlp",
            "learning_rate": "0.05",
            "start": "true",
        },
    )
    assert response.status_code == 201, response.content
    body = response.json()
    assert body["status"] == "running" and body["preset"] == "mlp" and body["current_version"] == 0
    assert body["settings"]["learning_rate"] == 0.05 and body["settings"]["mode"] == "sync_sgd"
    assert set(body["progress"]) == {
        "samples_per_second",
        "volunteers_active",
        "flops",
        "versions",
        "eta_seconds",
    }
    assert body["progress"]["versions"] == 1


def test_create_from_an_uploaded_graph_and_weights(api: APIClient) -> None:
    dataset = create_dataset(api)
    graph, weights = export_preset("mlp")
    files = {
        "name": "Uploaded model",
        "dataset": dataset["id"],
        "graph": io.BytesIO(json.dumps(graph).encode()),
        "weights": io.BytesIO(codecs.encode(weights)),
    }
    files["graph"].name, files["weights"].name = "graph.json", "weights.safetensors"
    response = api.post("/api/projects/", files, format="multipart")
    assert response.status_code == 201, response.content
    project = Project.objects.get(name="Uploaded model")
    assert project.status == "draft" and project.preset == ""
    stored = version_weights(version=project.current_version())
    assert all(torch.equal(stored[name], weights[name]) for name in weights)


@pytest.mark.parametrize(
    ("form", "field", "message"),
    [
        ({"name": "x"}, "preset", "exactly one"),
        ({"preset": "gpt", "name": "x"}, "preset", "token sequences"),
        ({"preset": "mlp", "name": "x", "learning_rate": "-1"}, "learning_rate", "greater than or equal"),
        ({"preset": "mlp", "name": "x", "batch_size": "0"}, "batch_size", "greater than or equal"),
        ({"preset": "mlp", "name": "x", "mode": "bogus"}, "mode", "not a valid choice"),
        ({"preset": "mlp", "name": "MLP"}, "name", "already exists"),
    ],
)
def test_bad_creations_are_400_with_the_field_and_save_nothing(
    api: APIClient,
    mlp_project: Project,
    digits_dataset: Dataset,
    form: dict[str, str],
    field: str,
    message: str,
) -> None:
    before = Project.objects.count()
    response = api.post("/api/projects/", {"dataset": digits_dataset.pk, **form})
    assert response.status_code == 400, response.content
    assert message in " ".join(response.json()[field]), response.json()
    assert Project.objects.count() == before


def test_a_graph_that_does_not_fit_the_dataset_is_a_clear_400(
    api: APIClient, digits_dataset: Dataset
) -> None:
    graph, weights = export_preset("gpt")
    form = {"name": "misfit", "dataset": digits_dataset.pk}
    graph_file, weights_file = io.BytesIO(json.dumps(graph).encode()), io.BytesIO(codecs.encode(weights))
    graph_file.name, weights_file.name = "graph.json", "weights.safetensors"
    response = api.post(
        "/api/projects/", {**form, "graph": graph_file, "weights": weights_file}, format="multipart"
    )
    assert response.status_code == 400 and "samples of shape" in response.json()["detail"], response.content
    assert not Project.objects.filter(name="misfit").exists()


def test_garbage_graph_and_weights_are_field_errors(api: APIClient, digits_dataset: Dataset) -> None:
    graph_file, weights_file = io.BytesIO(b"{not json"), io.BytesIO(b"\x00" * 20)
    graph_file.name, weights_file.name = "graph.json", "weights.safetensors"
    form = {"name": "garbage", "dataset": digits_dataset.pk, "graph": graph_file, "weights": weights_file}
    response = api.post("/api/projects/", form, format="multipart")
    assert response.status_code == 400 and "Invalid model graph" in response.json()["graph"][0]


def test_patch_settings_start_pause_and_delete(api: APIClient, owner: User, digits_dataset: Dataset) -> None:
    from projects.services import project_create

    project = project_create(owner=owner, name="Tuned", dataset=digits_dataset, preset="mlp")
    url = f"/api/projects/{project.pk}/"
    patched = api.patch(
        url, {"learning_rate": 0.01, "description": "smaller steps", "target_value": 0.9}, format="json"
    )
    assert patched.status_code == 200 and patched.json()["settings"]["learning_rate"] == 0.01
    assert patched.json()["description"] == "smaller steps" and patched.json()["target_value"] == 0.9
    assert api.patch(url, {"resource_share": 10_000}, format="json").status_code == 200
    project.refresh_from_db()
    assert project.resource_share == 100  # staff's, silently not a setting
    assert api.post(f"{url}start/").json()["status"] == "running"
    assert api.post(f"{url}pause/").json()["status"] == "paused"
    assert api.delete(url).status_code == 204 and not Project.objects.filter(pk=project.pk).exists()


def test_the_update_codec_may_be_int4_or_topk_and_the_weights_codec_int4_but_never_sparse(
    api: APIClient, owner: User, digits_dataset: Dataset
) -> None:
    from projects.services import project_create

    project = project_create(owner=owner, name="Few bytes", dataset=digits_dataset, preset="mlp")
    url = f"/api/projects/{project.pk}/"
    for codec in ("int4", "topk"):
        assert api.patch(url, {"codec": codec}, format="json").json()["settings"]["codec"] == codec
    assert api.patch(url, {"weights_codec": "int4"}, format="json").status_code == 200
    refused = api.patch(url, {"weights_codec": "topk"}, format="json")
    assert refused.status_code == 400 and "weights_codec" in refused.json()
    project.refresh_from_db()
    assert (project.codec, project.weights_codec) == ("topk", "int4")


def test_settings_that_do_not_go_together_are_a_400_and_change_nothing(
    api: APIClient, owner: User, digits_dataset: Dataset
) -> None:
    """Found by schemathesis: a pipeline the model cannot be cut into was a 500."""
    from projects.services import project_create

    project = project_create(owner=owner, name="Uncuttable", dataset=digits_dataset, preset="mlp")
    url = f"/api/projects/{project.pk}/"
    response = api.patch(url, {"mode": "pipeline", "pipeline_stages": 9}, format="json")
    assert response.status_code == 400, response.content
    assert "Pipeline mode cannot cut this model" in response.json()["non_field_errors"][0]
    project.refresh_from_db()
    assert (project.mode, project.pipeline_stages) == ("sync_sgd", 0)


def test_a_project_volunteers_were_credited_for_cannot_be_deleted(
    api: APIClient, mlp_project: Project, volunteer_user: User
) -> None:
    from tests.integration.test_pages import accepted_result
    from workers.services import credit_grant

    credit_grant(user=volunteer_user, result=accepted_result(mlp_project, volunteer_user), flops=10**6)
    response = api.delete(f"/api/projects/{mlp_project.pk}/")
    assert response.status_code == 409 and "pause it instead" in response.json()["detail"]
    assert Project.objects.filter(pk=mlp_project.pk).exists()


def add_version(project: Project, number: int, accuracy: float | None) -> ModelVersion:
    weights = version_weights(version=project.current_version())
    scaled = {name: tensor * (1 + number) for name, tensor in weights.items()}
    version = version_publish(project=project, number=number, weights=scaled, momentum={}, samples=100)
    if accuracy is not None:
        Metric.objects.create(project=project, version=version, name="test_accuracy", value=accuracy)
    return version


def test_versions_metrics_and_checkpoints(anonymous: APIClient, mlp_project: Project) -> None:
    add_version(mlp_project, 1, 0.5)
    add_version(mlp_project, 2, 0.8)
    add_version(mlp_project, 3, 0.7)
    url = f"/api/projects/{mlp_project.pk}/"

    versions = anonymous.get(f"{url}versions/").json()
    assert versions["count"] == 4 and [v["number"] for v in versions["results"]] == [0, 1, 2, 3]
    assert (
        versions["results"][2]["metrics"] == {"test_accuracy": 0.8}
        and versions["results"][2]["samples"] == 100
    )
    metrics = anonymous.get(f"{url}metrics/").json()
    assert [m["value"] for m in metrics["metrics"]] == [0.5, 0.8, 0.7]

    for which, number in (("latest", 3), ("best", 2), ("1", 1), ("", 3)):
        response = anonymous.get(f"{url}checkpoint/", {"version": which} if which else {})
        assert response.status_code == 200 and response["X-Crowdtrain-Version"] == str(number)
        assert response["Content-Disposition"] == f'attachment; filename="mlp-v{number}.safetensors"'
        tensors = st_load(b"".join(response.streaming_content))  # type: ignore[attr-defined]
        expected = version_weights(version=mlp_project.versions.get(number=number))
        assert set(tensors) == set(expected) and all(torch.equal(tensors[k], expected[k]) for k in expected)
    assert json.loads(anonymous.get(f"{url}checkpoint/", {"version": "best"})["X-Crowdtrain-Metrics"]) == {
        "test_accuracy": 0.8
    }
    assert anonymous.get(f"{url}checkpoint/", {"version": "9"}).status_code == 404
    assert anonymous.get(f"{url}checkpoint/", {"version": "../1"}).status_code == 404


def test_best_by_loss_is_the_lowest(anonymous: APIClient, mlp_project: Project) -> None:
    mlp_project.target_metric = "test_loss"
    mlp_project.save()
    for number, loss in ((1, 0.9), (2, 0.3), (3, 0.6)):
        version = add_version(mlp_project, number, None)
        Metric.objects.create(project=mlp_project, version=version, name="test_loss", value=loss)
    response = anonymous.get(f"/api/projects/{mlp_project.pk}/checkpoint/", {"version": "best"})
    assert response["X-Crowdtrain-Version"] == "2"


def test_a_pruned_version_is_404_naming_the_kept_ones(anonymous: APIClient, mlp_project: Project) -> None:
    add_version(mlp_project, 1, None)
    add_version(mlp_project, 2, None)
    ModelVersion.objects.filter(project=mlp_project, number=1).update(weights=None)
    response = anonymous.get(f"/api/projects/{mlp_project.pk}/checkpoint/", {"version": "1"})
    assert response.status_code == 404
    assert response.json()["detail"] == "version 1's weights were pruned; kept: [0, 2]"


def test_datasets_list_and_delete(api: APIClient, owner: User, mlp_project: Project) -> None:
    created = create_dataset(api, "to delete")
    names = [d["name"] for d in api.get("/api/datasets/").json()["results"]]
    assert names == ["to delete", "digits"]
    assert (
        created["kind"] == "classes"
        and created["input_shape"] == [1, 28, 28]
        and created["num_classes"] == 10
    )
    used = api.delete(f"/api/datasets/{mlp_project.dataset_id}/")
    assert used.status_code == 409 and "MLP" in used.json()["detail"]
    assert api.delete(f"/api/datasets/{created['id']}/").status_code == 204
    assert not Dataset.objects.filter(pk=created["id"]).exists()


def test_me(api: APIClient, volunteer_api: APIClient, anonymous: APIClient) -> None:
    assert api.get("/api/me/").json() == {"username": "researcher", "is_researcher": True}
    assert volunteer_api.get("/api/me/").json() == {"username": "alice", "is_researcher": False}
    assert anonymous.get("/api/me/").status_code == 401
