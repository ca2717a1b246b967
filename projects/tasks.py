"""Celery tasks: thin wrappers that take ids and call services."""

from __future__ import annotations

from celery import shared_task

from projects import notify, services
from projects.models import Project


@shared_task
def feed_project(project_id: int) -> int:
    created = services.work_units_feed(project_id=project_id)
    if created:
        notify.work_available()
    return created


@shared_task
def feed_work_units() -> int:
    running = Project.objects.filter(status=Project.Status.RUNNING).values_list("pk", flat=True)
    return sum(feed_project(project_id) for project_id in running)


@shared_task
def expire_work_units() -> int:
    project_ids = services.work_units_expire()
    for project_id in project_ids:
        feed_project.delay(project_id)
    return len(project_ids)


@shared_task
def aggregate_round(project_id: int, version_number: int) -> int | None:
    version = services.version_aggregate(project_id=project_id, version_number=version_number)
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
