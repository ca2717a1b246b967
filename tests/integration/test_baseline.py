"""The one-CPU time-to-accuracy baseline: scheduled by project creation onto its own low-priority queue,
trained with the project's settings within its budget, recorded point by point, never in training's way."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from django.contrib.auth.models import User
from django.utils import timezone

from config.celery import app
from config.management.commands.runplatform import BASELINE_NICE, platform_children, worker_args
from projects import baseline as baseline_service
from projects import tasks
from projects.models import Baseline, DatasetShard, Project
from projects.services import project_create

MLP_SETTINGS = {"batch_size": 50, "round_samples": 100, "learning_rate": 0.1, "momentum": 0.9}


@pytest.fixture
def baseline_on(settings: Any) -> Callable[..., None]:
    def turn_on(**overrides: Any) -> None:
        values = {
            "BASELINE_SECONDS": 60.0,
            "BASELINE_SAMPLES": 100_000,
            "BASELINE_MAX_FLOPS_PER_SAMPLE": 10**8,
        }
        settings.CROWDTRAIN = {**settings.CROWDTRAIN, **values, **overrides}

    turn_on()
    return turn_on


def create(researcher: User, dataset: Any, name: str = "MLP baseline", **extra: Any) -> Project:
    return project_create(
        owner=researcher, name=name, dataset=dataset, preset="mlp", settings={**MLP_SETTINGS, **extra}
    )


# --- scheduling -----------------------------------------------------------------------------------


def test_creating_a_project_queues_its_baseline_after_commit(
    researcher: User, digits_dataset: Any, baseline_on: Any, django_capture_on_commit_callbacks: Any
) -> None:
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        project = create(researcher, digits_dataset)
    baseline = Baseline.objects.get(project=project)
    assert baseline.status == Baseline.Status.PENDING and baseline.queued_at is not None
    assert (baseline.budget_seconds, baseline.budget_samples) == (60.0, 100_000)
    assert len(callbacks) == 1  # notify.baseline_wanted, once the project exists for the worker to read


def test_the_baseline_task_goes_to_the_baseline_queue_only_its_own_worker_reads(tmp_path: Path) -> None:
    route = app.amqp.router.route({}, "projects.tasks.train_baseline", args=(1,))
    assert route["queue"].name == "baseline"
    assert "baseline" not in worker_args()[worker_args().index("-Q") + 1].split(",")
    children = {child.name: child.argv for child in platform_children("127.0.0.1", 8000, tmp_path / "beat")}
    argv = children["baseline"]
    assert argv[:3] == ["nice", "-n", str(BASELINE_NICE)] and BASELINE_NICE == 19
    assert argv[argv.index("-Q") + 1] == "baseline" and "solo" in argv


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        (
            {"BASELINE_MAX_FLOPS_PER_SAMPLE": 1000},
            "Not run: a training sample costs 409,088 FLOPs, over this server's",
        ),
        ({"BASELINE_SECONDS": 0.0}, "The one-CPU baseline is turned off on this server."),
    ],
)
def test_large_models_and_a_server_turning_it_off_skip_the_baseline_with_the_reason(
    researcher: User,
    digits_dataset: Any,
    baseline_on: Any,
    django_capture_on_commit_callbacks: Any,
    overrides: dict[str, Any],
    reason: str,
) -> None:
    baseline_on(**overrides)
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        project = create(researcher, digits_dataset)
    baseline = Baseline.objects.get(project=project)
    assert baseline.status == Baseline.Status.SKIPPED and baseline.reason.startswith(reason)
    assert callbacks == []
    assert tasks.train_baseline(project.pk) is None  # a skipped baseline is never trained


# --- training -------------------------------------------------------------------------------------


def test_the_task_trains_to_the_target_and_records_points_as_it_goes(
    researcher: User, digits_dataset: Any, baseline_on: Any, django_capture_on_commit_callbacks: Any
) -> None:
    threads = torch.get_num_threads()
    with django_capture_on_commit_callbacks(execute=True):  # eager Celery: the task runs here
        project = create(researcher, digits_dataset, target_value=0.6)
    baseline = Baseline.objects.get(project=project)
    points = list(baseline.points.order_by("samples"))
    assert baseline.status == Baseline.Status.DONE, baseline.reason
    assert baseline.reason == "Reached the target test_accuracy of 0.6."
    assert points[0].samples == 0 and points[0].seconds == 0.0
    assert [p.samples % 100 for p in points] == [0] * len(points)  # whole rounds of round_samples
    assert all(
        a.seconds < b.seconds and a.samples < b.samples for a, b in zip(points, points[1:], strict=False)
    )
    assert points[-1].metrics["test_accuracy"] >= 0.6 > points[0].metrics["test_accuracy"]
    assert set(points[-1].metrics) == {"test_loss", "test_accuracy"}
    assert torch.get_num_threads() == threads  # one thread while training, restored after


def test_the_sample_budget_stops_it(researcher: User, digits_dataset: Any, baseline_on: Any) -> None:
    baseline_on(BASELINE_SAMPLES=1000)
    project = create(researcher, digits_dataset)
    baseline = baseline_service.baseline_train(project_id=project.pk)
    assert baseline is not None and baseline.status == Baseline.Status.DONE
    assert baseline.reason == "Used its budget of 1,000 samples."
    assert baseline.points.order_by("-samples").first().samples == 1000  # type: ignore[union-attr]


def test_the_project_step_limit_stops_it_and_a_done_baseline_is_not_run_again(
    researcher: User, digits_dataset: Any, baseline_on: Any
) -> None:
    project = create(researcher, digits_dataset, max_versions=3)
    baseline = baseline_service.baseline_train(project_id=project.pk)
    assert baseline is not None and baseline.reason == "Took the project's 3 steps."
    assert list(baseline.points.values_list("samples", flat=True)) == [0, 100, 200, 300]
    assert baseline_service.baseline_train(project_id=project.pk) is None


def test_a_failure_is_recorded_on_the_baseline_not_raised(
    researcher: User, digits_dataset: Any, baseline_on: Any
) -> None:
    project = create(researcher, digits_dataset)
    DatasetShard.objects.filter(dataset=digits_dataset, split=DatasetShard.Split.TEST).delete()
    baseline = baseline_service.baseline_train(project_id=project.pk)
    assert baseline is not None and baseline.status == Baseline.Status.FAILED
    assert baseline.reason.startswith("DatasetError: Dataset") and "has no test shards" in baseline.reason


def test_averaging_and_async_projects_train_their_single_machine_equivalents(
    researcher: User, digits_dataset: Any, baseline_on: Any
) -> None:
    for mode in ("averaging", "async_sgd"):
        project = create(
            researcher, digits_dataset, name=f"MLP {mode}", mode=mode, max_versions=2, learning_rate=0.7
        )
        baseline = baseline_service.baseline_train(project_id=project.pk)
        assert baseline is not None
        assert baseline.status == Baseline.Status.DONE, baseline.reason
        per_step = 100 if mode == "averaging" else 50  # a round; async: one work unit of batch_size
        assert list(baseline.points.values_list("samples", flat=True)) == [0, per_step, 2 * per_step]


# --- claims and re-queueing -----------------------------------------------------------------------


def test_a_running_baseline_is_left_alone_until_its_worker_is_clearly_gone(
    researcher: User, digits_dataset: Any, baseline_on: Any
) -> None:
    project = create(researcher, digits_dataset, max_versions=1)
    Baseline.objects.filter(project=project).update(status=Baseline.Status.RUNNING, started_at=timezone.now())
    assert baseline_service.baseline_train(project_id=project.pk) is None
    long_ago = timezone.now() - timedelta(hours=2)  # budget 60 s x 2 + 10 min ago: the worker died mid-run
    Baseline.objects.filter(project=project).update(started_at=long_ago)
    baseline = baseline_service.baseline_train(project_id=project.pk)
    assert baseline is not None and baseline.status == Baseline.Status.DONE


def test_the_beat_queues_again_only_baselines_whose_message_was_lost(
    researcher: User, digits_dataset: Any, baseline_on: Any
) -> None:
    lost = create(researcher, digits_dataset, name="lost", max_versions=1)
    fresh = create(researcher, digits_dataset, name="fresh", max_versions=1)
    Baseline.objects.filter(project=lost).update(queued_at=timezone.now() - timedelta(minutes=11))
    assert tasks.queue_baselines() == 1  # eager: the lost one is trained right here
    assert Baseline.objects.get(project=lost).status == Baseline.Status.DONE
    assert Baseline.objects.get(project=fresh).status == Baseline.Status.PENDING
    assert tasks.queue_baselines() == 0
