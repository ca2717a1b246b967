"""Time to accuracy against one machine: the project's graph, initial weights and optimizer settings trained
by one CPU process of the server's own (engine/baseline.py says what one step is in each mode), evaluated on
the test split now and then, within the budget baseline_schedule recorded. Runs in the niced `baseline`
worker.

Clocks: a point's `seconds` counts training only. The platform evaluates its versions in another process
beside training, so the baseline's evaluations are not charged to it either (they are bounded: points get
sparser as training goes on, about one per 25% more training time, plus steps 1, 2, 4, 8, ...).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta

import torch
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from engine import baseline as engine_baseline
from engine.graph import Graph
from projects.curves import reached
from projects.datasets import dataset_load_split
from projects.models import Baseline, BaselinePoint, DatasetShard, Project
from projects.services import project_graph, version_weights

logger = logging.getLogger(__name__)

EVAL_MIN_SECONDS = 0.5
EVAL_GROWTH = 0.25
# A queued baseline nobody started after this long was lost (broker down, queue flushed): queue it again.
REQUEUE_AFTER = timedelta(minutes=10)
# Evaluations are not charged to the training clock, but the task as a whole stops at this many budgets.
WALL_BUDGETS = 2.0


@dataclass
class Run:
    """A baseline in progress: the model, the data, and the two clocks."""

    baseline: Baseline
    graph: Graph
    recipe: engine_baseline.Recipe
    cursor: engine_baseline.Cursor
    test: tuple[torch.Tensor, torch.Tensor]
    weights: dict[str, torch.Tensor]
    state: dict[str, torch.Tensor] = field(default_factory=dict)
    steps: int = 0
    samples: int = 0
    train_seconds: float = 0.0
    evaluated_at: float = -1.0  # train_seconds at the latest evaluation
    started: float = field(default_factory=time.monotonic)
    last_metrics: dict[str, float] = field(default_factory=dict)


def baseline_train(*, project_id: int) -> Baseline | None:
    """Train and evaluate the project's baseline; None if it is not this call's to run (done, skipped, or
    running elsewhere). A failure is recorded on the baseline, never raised: it is an extra, not training."""
    baseline = _claim(project_id=project_id)
    if baseline is None:
        return None
    try:
        with _one_thread():
            status, reason = _train(_prepare(baseline))
    except Exception as exc:
        logger.exception("the baseline of project %s failed", project_id)
        status, reason = Baseline.Status.FAILED, f"{type(exc).__name__}: {exc}"[:300]
    Baseline.objects.filter(pk=baseline.pk).update(status=status, reason=reason, finished_at=timezone.now())
    baseline.refresh_from_db()
    return baseline


def baselines_to_queue() -> list[int]:
    """Project ids of baselines queued long ago and never started (the message was lost): queued again."""
    stale = timezone.now() - REQUEUE_AFTER
    with transaction.atomic():
        lost = Baseline.objects.select_for_update().filter(
            Q(queued_at__isnull=True) | Q(queued_at__lt=stale), status=Baseline.Status.PENDING
        )
        project_ids = list(lost.values_list("project_id", flat=True))
        Baseline.objects.filter(project_id__in=project_ids).update(queued_at=timezone.now())
    return project_ids


def _claim(*, project_id: int) -> Baseline | None:
    """Pending, or running for far longer than its budget (its worker died mid-run): start it afresh."""
    with transaction.atomic():
        baseline = Baseline.objects.select_for_update().filter(project_id=project_id).first()
        if baseline is None or not _claimable(baseline):
            return None
        baseline.points.all().delete()
        baseline.status, baseline.reason, baseline.started_at = Baseline.Status.RUNNING, "", timezone.now()
        baseline.save(update_fields=["status", "reason", "started_at"])
    return baseline


def _claimable(baseline: Baseline) -> bool:
    if baseline.status == Baseline.Status.PENDING:
        return True
    limit = timedelta(seconds=baseline.budget_seconds * WALL_BUDGETS) + REQUEUE_AFTER
    started = baseline.started_at
    return (
        baseline.status == Baseline.Status.RUNNING
        and started is not None
        and timezone.now() - started > limit
    )


@contextmanager
def _one_thread() -> Iterator[None]:
    """One CPU process means one thread: torch would otherwise use every core for the baseline."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _prepare(baseline: Baseline) -> Run:
    project = Project.objects.select_related("dataset").get(pk=baseline.project_id)
    x, y = dataset_load_split(dataset=project.dataset, split=DatasetShard.Split.TRAIN)
    x_test, y_test = dataset_load_split(dataset=project.dataset, split=DatasetShard.Split.TEST)
    return Run(
        baseline=baseline,
        graph=project_graph(project=project),
        recipe=baseline_recipe(project=project),
        cursor=engine_baseline.Cursor(x, y),
        test=(torch.from_numpy(x_test), torch.from_numpy(y_test)),
        weights=version_weights(version=project.versions.get(number=0)),
    )


def baseline_recipe(*, project: Project) -> engine_baseline.Recipe:
    return engine_baseline.Recipe(
        mode=project.mode,
        round_samples=project.round_samples,
        batch_size=project.batch_size,
        learning_rate=project.learning_rate,
        momentum=project.momentum,
        weight_decay=project.weight_decay,
        local_learning_rate=project.local_learning_rate,
        local_momentum=project.local_momentum,
        local_batch_size=project.local_batch_size,
    )


def _train(run: Run) -> tuple[str, str]:
    """Step until a budget runs out or the target is reached; returns (status, why it stopped)."""
    project = run.baseline.project
    _evaluate(run)
    while (why := _stop_reason(run, project)) is None:
        x, y = run.cursor.take(run.recipe.step_samples)
        began = time.perf_counter()
        result = engine_baseline.step(run.graph, run.weights, run.state, x, y, run.recipe)
        run.train_seconds += time.perf_counter() - began
        run.weights, run.state = result.weights, result.state
        run.steps, run.samples = run.steps + 1, run.samples + len(x)
        if _evaluation_due(run):
            _evaluate(run)
    if run.evaluated_at < run.train_seconds:
        _evaluate(run)
        why = _stop_reason(run, project) or why
    return Baseline.Status.DONE, why or ""


def _stop_reason(run: Run, project: Project) -> str | None:
    budget = run.baseline
    if _target_reached(run, project):
        return f"Reached the target {project.target_metric} of {project.target_value:g}."
    if run.train_seconds >= budget.budget_seconds:
        return f"Used its budget of {budget.budget_seconds:g} s of training."
    if run.samples >= budget.budget_samples:
        return f"Used its budget of {budget.budget_samples:,} samples."
    if run.steps >= project.max_versions:
        return f"Took the project's {project.max_versions} steps."
    if time.monotonic() - run.started >= budget.budget_seconds * WALL_BUDGETS:
        return "Stopped: evaluations took as long as training allowed."
    return None


def _target_reached(run: Run, project: Project) -> bool:
    value, target = run.last_metrics.get(project.target_metric), project.target_value
    if target is None or value is None or not run.steps:
        return False
    return reached(metric=project.target_metric, value=value, target=target)


def _evaluation_due(run: Run) -> bool:
    power_of_two = run.steps & (run.steps - 1) == 0
    gap = max(EVAL_MIN_SECONDS, EVAL_GROWTH * run.evaluated_at)
    return power_of_two or run.train_seconds - run.evaluated_at >= gap


def _evaluate(run: Run) -> None:
    metrics = engine_baseline.evaluate(run.graph, run.weights, *run.test)
    BaselinePoint.objects.create(
        baseline=run.baseline, seconds=run.train_seconds, samples=run.samples, metrics=metrics
    )
    run.evaluated_at, run.last_metrics = run.train_seconds, metrics
