"""Celery tasks: thin wrappers that take ids and call services."""

from __future__ import annotations

from typing import Any

from celery import shared_task

from projects import baseline, lifecycle, notify, services, storage, swarms, training, validation
from projects.models import Project


@shared_task
def feed_project(project_id: int) -> int:
    created = lifecycle.work_units_feed(project_id=project_id)
    if created:
        notify.work_available()
    return created


@shared_task
def feed_work_units() -> int:
    """The feeder's beat. It also announces unsent work on every beat, not only work it just created: a
    volunteer told `idle` is owed an assign, and the one `work.available` it waits for can be lost (a group
    message to a busy connection expires) or come while its back-off still runs: each beat is a new chance."""
    running = Project.objects.filter(status=Project.Status.RUNNING).values_list("pk", flat=True)
    created = sum(lifecycle.work_units_feed(project_id=project_id) for project_id in running)
    if lifecycle.work_sendable():
        notify.work_available()
    return created


@shared_task
def rebalance_pipelines() -> int:
    """Beat: move pipeline volunteers to the stage that is the bottleneck or lost its volunteers."""
    return swarms.pipelines_rebalance()


@shared_task
def transition() -> int:
    """The BOINC transitioner: time out late instances, resend their work, close expired rounds,
    validate results whose validation message was lost (the database, not the queue, is the truth), and give
    up on those that could not be validated for too long."""
    lifecycle.results_give_up()
    for result_id in lifecycle.results_unvalidated():
        validate_result.delay(result_id)
    expired = lifecycle.results_expire()
    project_ids = set(expired) | set(training.rounds_close_expired())
    for project_id in project_ids:
        feed_project.delay(project_id)
    if expired:
        notify.work_available()  # their work units are open again
    return len(project_ids)


BUSY_RETRIES = 3
BUSY_SECONDS = 0.25
# A validation failing for the server's own reasons (database or broker down, blob unreadable) is retried
# with backoff, 1 s doubling to 30 s; past that the transitioner queues it again until
# lifecycle.VALIDATION_GIVE_UP_SECONDS, then gives it up. Any other failure is the result's: it is invalid.
RETRIED: dict[str, Any] = {
    "autoretry_for": validation.INFRASTRUCTURE_ERRORS,
    "max_retries": 5,
    "retry_backoff": 1,
    "retry_backoff_max": 30,
    "retry_jitter": True,
}


@shared_task(**RETRIED)
def validate_result(result_id: int, busy: int = 0) -> int:
    """Decides the result and the batch of its project's results waiting with it (validation.py); the
    tasks of those others then find them decided and return at once. Returns how many were decided. A
    result whose work unit another transaction holds comes back BUSY_SECONDS later, BUSY_RETRIES times,
    and then waits for it: the holder most often decides it meanwhile, as a batch mate."""
    return len(_decide(result_id=result_id, busy=busy))


def _decide(*, result_id: int, busy: int) -> list[int]:
    try:
        decided = validation.results_validate(result_id=result_id, wait=busy >= BUSY_RETRIES)
    except validation.Busy:
        validate_result.apply_async((result_id,), {"busy": busy + 1}, countdown=BUSY_SECONDS)
        return []
    # Announced here, once its transaction committed, not through notify.results_decided's task: the verdict
    # completing a round queues the step with no extra trip through the queue (one round_ready a batch).
    training.results_decided(result_ids=decided)
    return decided


@shared_task(**RETRIED)
def validate_results(result_ids: list[int]) -> int:
    """validate_result for a batch of arrivals (lifecycle.results_receive): the first result's batch most
    often decides the others as its batch mates, and each left undecided gets its own batch. One whose work
    unit another transaction holds goes on as validate_result's retries. A retry of this task (the server's
    own failure) finds the results it decided already decided, at one query each."""
    decided: set[int] = set()
    for result_id in result_ids:
        if result_id not in decided:
            decided.update(_decide(result_id=result_id, busy=0))
    return len(decided)


@shared_task
def results_decided(result_ids: list[int]) -> None:
    training.results_decided(result_ids=result_ids)


@shared_task
def compute_reference(work_unit_id: int) -> bool:
    return validation.work_unit_compute_reference(work_unit_id=work_unit_id)


@shared_task
def project_step(project_id: int) -> int | None:
    version = training.project_step(project_id=project_id)
    return version.number if version else None


@shared_task
def evaluate_version(version_id: int) -> dict[str, float]:
    return services.version_evaluate(version_id=version_id)


@shared_task
def evaluate_projects() -> int:
    version_ids = services.versions_evaluate_latest()
    for version_id in version_ids:
        services.version_evaluate(version_id=version_id)
    return len(version_ids)


@shared_task
def train_baseline(project_id: int) -> str | None:
    """Routed to the `baseline` queue (CELERY_TASK_ROUTES), which only a niced worker of its own consumes."""
    result = baseline.baseline_train(project_id=project_id)
    return None if result is None else str(result.status)


@shared_task
def queue_baselines() -> int:
    project_ids = baseline.baselines_to_queue()
    for project_id in project_ids:
        notify.baseline_wanted(project_id=project_id)
    return len(project_ids)


@shared_task
def collect_storage() -> dict[str, int]:
    """Beat: release decided work units' updates, prune old versions' weights, delete unreferenced blobs."""
    released = storage.storage_release_decided()
    pruned = storage.versions_prune()
    collected = storage.blobs_collect_garbage()
    return {"released": released, "pruned": pruned, "blobs": collected.blobs, "bytes": collected.bytes}
