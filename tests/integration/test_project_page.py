"""The public project page (/projects/<id>/) and its live JSON: who may see it, what it says, and the shapes
the charts poll. Through Django's test client on the real PostgreSQL."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.utils import timezone

from projects.models import Baseline, BaselinePoint, Metric, ModelVersion, Project, Result, WorkUnit
from projects.services import version_publish, version_weights
from workers.models import CreditEntry, Volunteer

LIVE_KEYS = {"project", "progress", "metrics", "versions", "checkpoints", "curves", "baseline", "comparison"}
PROGRESS_KEYS = {"samples_per_second", "volunteers_active", "flops", "versions", "eta_seconds", "eta_reason"}


def publish(project: Project, number: int, **metrics: float) -> ModelVersion:
    weights = version_weights(version=project.current_version())
    version = version_publish(project=project, number=number, weights=weights, momentum={}, samples=100)
    for name, value in metrics.items():
        Metric.objects.create(project=project, version=version, name=name, value=value)
    return version


def credited_result(project: Project, user: User, flops: int, sent_ago: float = 10.0) -> Result:
    version = project.current_version()
    shard = project.dataset.shards.get(split="train", index=0)
    work_unit = WorkUnit.objects.create(project=project, version=version, shard=shard, offset=0, count=50)
    result = Result.objects.create(
        work_unit=work_unit,
        volunteer=user,
        status=Result.Status.RECEIVED,
        validation=Result.Validation.VALID,
        samples=50,
        deadline=timezone.now(),
        received_at=timezone.now(),
    )
    Result.objects.filter(pk=result.pk).update(sent_at=timezone.now() - timedelta(seconds=sent_ago))
    volunteer, _ = Volunteer.objects.get_or_create(user=user)
    CreditEntry.objects.create(volunteer=volunteer, project=project, result=result, flops=flops)
    return result


@pytest.fixture
def draft(mlp_project: Any) -> Project:
    Project.objects.filter(pk=mlp_project.pk).update(status=Project.Status.DRAFT)
    mlp_project.refresh_from_db()
    return mlp_project


# --- who sees it ----------------------------------------------------------------------------------


def test_a_running_project_is_public_with_its_description_owner_and_numbers(
    client: Client, mlp_project: Any
) -> None:
    Project.objects.filter(pk=mlp_project.pk).update(description="Digits, <b>learned</b> together.")
    response = client.get(f"/projects/{mlp_project.pk}/")
    html = response.content.decode()
    assert response.status_code == 200
    assert "Digits, &lt;b&gt;learned&lt;/b&gt; together." in html  # escaped, never markup
    assert "by <strong>researcher</strong>" in html
    for element in (
        "stat-samples-per-second",
        "stat-volunteers",
        "stat-flops",
        "stat-eta",
        "curve-seconds",
        "curve-samples",
    ):
        assert f'id="{element}"' in html
    assert f'href="/api/projects/{mlp_project.pk}/checkpoint/?version=latest"' in html
    assert 'id="project-live-data"' in html and f'data-live-url="/projects/{mlp_project.pk}/live/"' in html


@pytest.mark.parametrize("path", ["/projects/{}/", "/projects/{}/live/"])
def test_a_draft_is_404_for_everyone_but_its_owner(
    client: Client, draft: Project, volunteer_user: User, researcher: User, path: str
) -> None:
    url = path.format(draft.pk)
    assert client.get(url).status_code == 404
    client.force_login(volunteer_user)
    assert client.get(url).status_code == 404
    staff = User.objects.create_user("staffer", password="staff-pass-123", is_staff=True, is_superuser=True)
    client.force_login(staff)
    assert client.get(url).status_code == 404
    client.force_login(researcher)
    assert client.get(url).status_code == 200


@pytest.mark.parametrize("status", [Project.Status.PAUSED, Project.Status.FINISHED])
def test_paused_and_finished_projects_stay_public(client: Client, mlp_project: Any, status: str) -> None:
    Project.objects.filter(pk=mlp_project.pk).update(status=status)
    assert client.get(f"/projects/{mlp_project.pk}/").status_code == 200
    assert client.get(f"/projects/{mlp_project.pk}/live/").json()["project"]["status"] == status


def test_unknown_projects_are_404_and_the_live_json_is_read_only(client: Client, mlp_project: Any) -> None:
    assert client.get("/projects/999999/").status_code == 404
    assert client.get("/projects/999999/live/").status_code == 404
    assert client.get("/projects/abc/").status_code == 404
    assert client.post(f"/projects/{mlp_project.pk}/live/").status_code == 405


# --- the live JSON --------------------------------------------------------------------------------


def test_the_live_json_has_the_shapes_the_charts_read(client: Client, mlp_project: Any) -> None:
    Metric.objects.create(
        project=mlp_project, version=mlp_project.current_version(), name="test_accuracy", value=0.1
    )
    publish(mlp_project, 1, test_accuracy=0.6, test_loss=1.2)
    data = client.get(f"/projects/{mlp_project.pk}/live/").json()
    assert set(data) == LIVE_KEYS and set(data["progress"]) == PROGRESS_KEYS
    assert data["project"] == {
        "id": mlp_project.pk,
        "status": "running",
        "target_metric": "test_accuracy",
        "target_value": None,
    }
    assert data["metrics"][-2:] == [
        {"version": 1, "name": "test_accuracy", "value": 0.6},
        {"version": 1, "name": "test_loss", "value": 1.2},
    ]
    newest = data["versions"][0]
    assert newest["number"] == 1 and newest["samples"] == 100 and newest["metrics"]["test_accuracy"] == 0.6
    assert data["checkpoints"] == {"latest": 1, "best": 1}
    assert data["curves"]["metric"] == "test_accuracy"
    assert [p["value"] for p in data["curves"]["platform"]] == [0.1, 0.6]
    assert set(data["curves"]["platform"][0]) == {"seconds", "samples", "value"}
    assert data["baseline"]["status"] == "skipped"  # CROWDTRAIN_BASELINE_SECONDS=0 in the tests
    assert data["comparison"]["statement"] == "The one-CPU baseline is turned off on this server."


def test_progress_counts_credit_volunteers_and_samples(
    client: Client, mlp_project: Any, volunteer_user: User, other_volunteer: User
) -> None:
    credited_result(mlp_project, volunteer_user, flops=10**9)
    credited_result(mlp_project, other_volunteer, flops=2 * 10**9)
    credited_result(mlp_project, other_volunteer, flops=5, sent_ago=3600)  # long ago: credit, not activity
    progress = client.get(f"/projects/{mlp_project.pk}/live/").json()["progress"]
    assert progress["flops"] == 3 * 10**9 + 5
    assert progress["volunteers_active"] == 2
    assert progress["samples_per_second"] == pytest.approx(150 / 300)
    assert progress["versions"] == 1


def test_platform_curve_counts_seconds_from_the_first_work_sent_and_samples_seen(
    client: Client, mlp_project: Any, volunteer_user: User
) -> None:
    result = credited_result(mlp_project, volunteer_user, flops=1)
    for number in (1, 2):
        publish(mlp_project, number, test_accuracy=0.3 * number)
    start = Result.objects.get(pk=result.pk).sent_at
    ModelVersion.objects.filter(project=mlp_project, number=2).update(
        created_at=start + timedelta(seconds=30)
    )
    ModelVersion.objects.filter(project=mlp_project, number=1).update(
        created_at=start + timedelta(seconds=12)
    )
    points = client.get(f"/projects/{mlp_project.pk}/live/").json()["curves"]["platform"]
    assert [(round(p["seconds"]), p["samples"], p["value"]) for p in points] == [
        (12, 100, 0.3),
        (30, 200, 0.6),
    ]


def test_best_checkpoint_follows_the_target_metric_direction(client: Client, mlp_project: Any) -> None:
    publish(mlp_project, 1, test_accuracy=0.8, test_loss=0.4)
    publish(mlp_project, 2, test_accuracy=0.7, test_loss=0.3)
    publish(mlp_project, 3)
    assert client.get(f"/projects/{mlp_project.pk}/live/").json()["checkpoints"] == {"latest": 3, "best": 1}
    Project.objects.filter(pk=mlp_project.pk).update(target_metric="test_loss")
    assert client.get(f"/projects/{mlp_project.pk}/live/").json()["checkpoints"] == {"latest": 3, "best": 2}


def test_the_baseline_curve_and_the_comparison_reach_the_page(client: Client, mlp_project: Any) -> None:
    Project.objects.filter(pk=mlp_project.pk).update(target_value=0.5)
    Baseline.objects.filter(project=mlp_project).update(status=Baseline.Status.DONE, reason="")
    baseline = Baseline.objects.get(project=mlp_project)
    BaselinePoint.objects.create(baseline=baseline, seconds=0, samples=0, metrics={"test_accuracy": 0.1})
    BaselinePoint.objects.create(baseline=baseline, seconds=2.0, samples=512, metrics={"test_accuracy": 0.6})
    data = client.get(f"/projects/{mlp_project.pk}/live/").json()
    assert data["curves"]["baseline"] == [
        {"seconds": 0.0, "samples": 0, "value": 0.1},
        {"seconds": 2.0, "samples": 512, "value": 0.6},
    ]
    assert data["comparison"]["statement"].startswith("Not enough data yet")  # no platform evaluation yet
    html = client.get(f"/projects/{mlp_project.pk}/").content.decode()
    assert "Baseline: done" in html


# --- links to it ----------------------------------------------------------------------------------


def test_home_leaderboard_and_admin_link_to_the_page(
    client: Client, mlp_project: Any, volunteer_user: User
) -> None:
    credited_result(mlp_project, volunteer_user, flops=10)
    href = f'href="/projects/{mlp_project.pk}/"'
    assert href in client.get("/").content.decode()
    assert href in client.get("/leaderboard/").content.decode()
    client.force_login(User.objects.create_superuser("root", password="root-pass-123"))
    change = client.get(f"/admin/projects/project/{mlp_project.pk}/change/").content.decode()
    assert f"/projects/{mlp_project.pk}/" in change  # the admin's "View on site"
