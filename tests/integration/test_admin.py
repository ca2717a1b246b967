"""The researcher's admin: projects from presets and .npz uploads, ownership, actions, the progress page."""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import pytest
from django.contrib.auth.models import Permission, User
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import Client

from projects import lifecycle
from projects.datasets import dataset_create_from_npz
from projects.models import Dataset, DatasetShard, Metric, ModelVersion, Project

ADD_URL = "/admin/projects/project/add/"
CHANGELIST_URL = "/admin/projects/project/"


def npz_upload(
    name: str = "digits.npz", shape: tuple[int, ...] = (1, 28, 28), samples: int = 60
) -> SimpleUploadedFile:
    rng = np.random.default_rng(0)
    buffer = io.BytesIO()
    np.savez(buffer, x=rng.random((samples, *shape), dtype=np.float32), y=np.arange(samples) % 10)
    return SimpleUploadedFile(name, buffer.getvalue(), content_type="application/octet-stream")


def project_form(**overrides: Any) -> dict[str, Any]:
    form = {
        "name": "Digits MLP",
        "description": "Handwritten digits.",
        "preset": "mlp",
        "dataset": "",
        "dataset_name": "",
        "mode": "sync_sgd",
        "learning_rate": "0.05",
        "momentum": "0.9",
        "weight_decay": "0.0001",
        "batch_size": "32",
        "round_samples": "128",
        "max_versions": "500",
        "device_memory_mb": "",
        "pipeline_stages": "0",
        "micro_batches": "4",
        "activation_codec": "fp16",
        "target_metric": "test_accuracy",
        "target_value": "0.9",
        "codec": "int8",
        "weights_codec": "fp32",
        "aggregator": "mean",
        "local_learning_rate": "0.05",
        "local_momentum": "0.9",
        "local_batch_size": "64",
        "round_timeout": "60",
        "staleness_bound": "4",
        "target_seconds": "20",
        "spot_check_rate": "0.1",
        "spot_check_by": "server",
        "trust_threshold": "5",
        "_save": "Save",
    }
    return {**form, **overrides}


@pytest.fixture
def superuser(db: None) -> User:
    return User.objects.create_superuser("root", password="root-pass-123")


@pytest.fixture
def lab_researcher(db: None) -> User:
    """Staff with model permissions on the projects app, but not a superuser."""
    user = User.objects.create_user("lab", password="lab-pass-123", is_staff=True)
    user.user_permissions.set(Permission.objects.filter(content_type__app_label="projects"))
    return user


def test_superuser_creates_a_project_with_an_npz_upload(client: Client, superuser: User) -> None:
    client.force_login(superuser)
    page = client.get(ADD_URL).content.decode()
    assert 'enctype="multipart/form-data"' in page and 'value="mlp"' in page

    response = client.post(ADD_URL, project_form(dataset_file=npz_upload(), dataset_name="digits-60"))

    assert response.status_code == 302, response.content.decode()[:3000]
    project = Project.objects.get(name="Digits MLP")
    assert (project.owner, project.preset, project.status) == (superuser, "mlp", Project.Status.DRAFT)
    assert (project.learning_rate, project.batch_size, project.round_samples) == (0.05, 32, 128)
    assert (project.max_versions, project.target_value, project.weight_decay) == (500, 0.9, 0.0001)
    assert project.flops_per_sample > 0
    assert project.dataset.name == "digits-60" and project.dataset.owner == superuser
    assert (project.dataset.train_samples, project.dataset.test_samples) == (54, 6)
    assert ModelVersion.objects.filter(project=project, number=0).exists()


def test_researcher_creates_a_project_from_an_existing_dataset(client: Client, lab_researcher: User) -> None:
    dataset = dataset_create_from_npz(owner=lab_researcher, name="mine", data=npz_upload().read())
    client.force_login(lab_researcher)

    response = client.post(ADD_URL, project_form(dataset=str(dataset.pk)))

    assert response.status_code == 302
    project = Project.objects.get(name="Digits MLP")
    assert project.owner == lab_researcher and project.dataset == dataset
    assert Dataset.objects.count() == 1


def test_bad_upload_error_is_shown_on_the_form(client: Client, lab_researcher: User) -> None:
    client.force_login(lab_researcher)
    bad = SimpleUploadedFile("evil.npz", b"definitely not a zip file")

    response = client.post(ADD_URL, project_form(dataset_file=bad))

    assert response.status_code == 200
    errors = response.context["adminform"].form.errors
    assert "not an .npz file" in errors["dataset_file"][0]
    assert "not an .npz file" in response.content.decode()
    assert (Project.objects.count(), Dataset.objects.count(), DatasetShard.objects.count()) == (0, 0, 0)


def test_dataset_that_does_not_fit_the_preset_is_refused(client: Client, lab_researcher: User) -> None:
    client.force_login(lab_researcher)

    response = client.post(ADD_URL, project_form(dataset_file=npz_upload(shape=(10,))))

    assert response.status_code == 200
    assert "expects samples of shape [1, 28, 28]" in response.context["adminform"].form.errors["preset"][0]
    assert (Project.objects.count(), Dataset.objects.count()) == (0, 0)


def test_exactly_one_dataset_source_is_required(client: Client, lab_researcher: User) -> None:
    client.force_login(lab_researcher)
    response = client.post(ADD_URL, project_form())
    assert response.status_code == 200
    assert "exactly one" in response.context["adminform"].form.errors["dataset"][0]


def test_researcher_cannot_see_or_change_anothers_project(
    client: Client, lab_researcher: User, mlp_project: Project
) -> None:
    client.force_login(lab_researcher)
    change_url = f"/admin/projects/project/{mlp_project.pk}/change/"

    assert "MLP" not in client.get(CHANGELIST_URL).content.decode()
    assert client.get(change_url).status_code == 302  # "doesn't exist": it is not in their queryset
    client.post(change_url, {"name": "Hijacked", "description": "", "learning_rate": "9"})
    client.post(CHANGELIST_URL, {"action": "pause", "_selected_action": [str(mlp_project.pk)]})
    mlp_project.refresh_from_db()
    assert (mlp_project.name, mlp_project.learning_rate, mlp_project.status) == ("MLP", 0.1, "running")

    page = client.get(ADD_URL).content.decode()
    assert f'<option value="{mlp_project.dataset_id}"' not in page  # nor pick their dataset
    assert client.get(f"/admin/projects/dataset/{mlp_project.dataset_id}/change/").status_code == 302
    assert "MLP" not in client.get("/admin/projects/modelversion/").content.decode()


def test_owner_sees_progress_and_can_pause_and_start(
    client: Client, researcher: User, mlp_project: Project
) -> None:
    researcher.user_permissions.set(Permission.objects.filter(content_type__app_label="projects"))
    version = mlp_project.current_version()
    Metric.objects.create(project=mlp_project, version=version, name="test_accuracy", value=0.42)
    Metric.objects.create(project=mlp_project, version=version, name="test_loss", value=1.7)
    client.force_login(researcher)

    page = client.get(f"/admin/projects/project/{mlp_project.pk}/change/").content.decode()
    assert "42.00%" in page and "v0 of" in page and 'id="metrics-chart"' in page
    assert "vendor/chart.umd.min.js" in page and '"test_loss"' in page

    client.post(CHANGELIST_URL, {"action": "pause", "_selected_action": [str(mlp_project.pk)]})
    mlp_project.refresh_from_db()
    assert mlp_project.status == Project.Status.PAUSED
    client.post(CHANGELIST_URL, {"action": "start", "_selected_action": [str(mlp_project.pk)]})
    mlp_project.refresh_from_db()
    assert mlp_project.status == Project.Status.RUNNING


def test_dataset_admin_upload(client: Client, lab_researcher: User, settings: Any) -> None:
    settings.CROWDTRAIN = {**settings.CROWDTRAIN, "SHARD_SAMPLES": 25}
    client.force_login(lab_researcher)

    response = client.post("/admin/projects/dataset/add/", {"name": "uploaded", "file": npz_upload()})

    assert response.status_code == 302
    dataset = Dataset.objects.get(name="uploaded")
    assert (
        dataset.owner == lab_researcher and dataset.input_shape == [1, 28, 28] and dataset.num_classes == 10
    )
    assert list(dataset.shards.filter(split="train").values_list("count", flat=True)) == [25, 25, 4]

    bad = client.post(
        "/admin/projects/dataset/add/", {"name": "bad", "file": SimpleUploadedFile("b.npz", b"not a zip")}
    )
    assert bad.status_code == 200 and "not an .npz file" in bad.content.decode()
    assert Dataset.objects.count() == 1


def test_superuser_sees_everything(client: Client, superuser: User, mlp_project: Project) -> None:
    client.force_login(superuser)
    for url in [
        CHANGELIST_URL,
        "/admin/projects/dataset/",
        "/admin/projects/modelversion/",
        "/admin/projects/blob/",
        "/admin/workers/creditentry/",
        "/admin/workers/volunteer/",
        f"/admin/projects/project/{mlp_project.pk}/change/",
        "/admin/projects/workunit/",
        "/admin/projects/result/",
        "/admin/projects/metric/",
        "/admin/projects/datasetshard/",
        "/admin/workers/team/",
        "/admin/workers/device/",
    ]:
        assert client.get(url).status_code == 200, url
    assert "MLP" in client.get(CHANGELIST_URL).content.decode()


def test_spot_checks_by_replica_are_a_training_setting(
    client: Client, superuser: User, mlp_project: Project
) -> None:
    client.force_login(superuser)
    page = client.get(ADD_URL).content.decode()
    assert 'name="spot_check_by"' in page and 'value="replica"' in page
    change = client.get(f"/admin/projects/project/{mlp_project.pk}/change/").content.decode()
    assert 'name="spot_check_by"' in change

    response = client.post(ADD_URL, project_form(spot_check_by="replica", dataset_file=npz_upload()))

    assert response.status_code == 302, response.content.decode()[:3000]
    assert Project.objects.get(name="Digits MLP").spot_check_by == Project.SpotCheckBy.REPLICA
    lifecycle.work_units_feed(project_id=mlp_project.pk)
    work_unit = mlp_project.work_units.first()
    assert work_unit is not None
    page = client.get(f"/admin/projects/workunit/{work_unit.pk}/change/").content.decode()
    assert "Canonical result" in page and "Min quorum" in page


def test_the_change_form_refuses_a_running_pipeline_projects_stage_count(
    client: Client, superuser: User, researcher: User, digits_dataset: Dataset
) -> None:
    from projects.services import project_create, project_start

    settings = {"mode": "pipeline", "pipeline_stages": 3, "batch_size": 32, "micro_batches": 4}
    project = project_create(
        owner=researcher, name="Pipe", dataset=digits_dataset, preset="mlp", settings=settings
    )
    project_start(project=project)
    client.force_login(superuser)
    change = project_form(name="Pipe", mode="pipeline", pipeline_stages="2", resource_share="100")
    response = client.post(f"/admin/projects/project/{project.pk}/change/", change)
    assert response.status_code == 200
    assert "pipeline_stages cannot change while the project runs" in response.content.decode()
    assert Project.objects.get(pk=project.pk).pipeline_stages == 3
