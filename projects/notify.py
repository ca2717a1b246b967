"""Side effects after a commit: queue Celery tasks and tell connected volunteers over the channel layer."""

from __future__ import annotations

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.conf import settings

VOLUNTEERS_GROUP = "volunteers"


def user_group(user_id: int) -> str:
    return f"volunteer.{user_id}"


def _group_send(group: str, message: dict[str, object]) -> None:
    layer = get_channel_layer()
    if layer is not None:
        async_to_sync(layer.group_send)(group, message)


def feed_requested(*, project_id: int) -> None:
    from projects import tasks

    tasks.feed_project.delay(project_id)


def result_accepted(*, project_id: int, version_number: int) -> None:
    from projects import tasks

    tasks.aggregate_round.delay(project_id, version_number)


def version_published(*, project_id: int, version_id: int, number: int) -> None:
    from projects import tasks

    tasks.feed_project.delay(project_id)
    if number % settings.CROWDTRAIN["EVAL_EVERY_VERSIONS"] == 0:
        tasks.evaluate_version.delay(version_id)


def work_available() -> None:
    _group_send(VOLUNTEERS_GROUP, {"type": "work.available"})


def work_cancelled(*, by_user: dict[int, list[int]], reason: str) -> None:
    for user_id, work_unit_ids in by_user.items():
        _group_send(
            user_group(user_id), {"type": "work.cancel", "work_units": work_unit_ids, "reason": reason}
        )
