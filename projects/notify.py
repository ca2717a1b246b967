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


def result_received(*, result_id: int) -> None:
    from projects import tasks

    tasks.validate_result.delay(result_id)


def reference_wanted(*, work_unit_id: int) -> None:
    from projects import tasks

    tasks.compute_reference.delay(work_unit_id)


def result_decided(*, result_id: int) -> None:
    """Tell the volunteer how its result was judged; valid results may complete a round."""
    from projects import tasks, training
    from projects.lifecycle import result_outcome
    from projects.models import Result

    result = Result.objects.select_related("work_unit").get(pk=result_id)
    outcome = result_outcome(result=result)
    _group_send(
        user_group(result.volunteer_id),
        {
            "type": "result.decided",
            "work_unit": outcome.work_unit_id,
            "status": outcome.status,
            "reason": outcome.reason,
            "credit_flops": outcome.credit_flops,
            "total_credit_flops": outcome.total_credit_flops,
        },
    )
    # Any verdict may be the one the round waited for (it closes only once every result received is judged).
    if training.round_ready(project_id=result.work_unit.project_id):
        tasks.project_step.delay(result.work_unit.project_id)
    if result.validation == Result.Validation.INVALID:
        work_available()  # its slice is open again


def results_decided(*, result_ids: list[int]) -> None:
    for result_id in result_ids:
        result_decided(result_id=result_id)


def version_published(*, version_id: int, number: int) -> None:
    """The step fed the next round in its transaction: volunteers may ask for it."""
    from projects import tasks

    work_available()
    if number % settings.CROWDTRAIN["EVAL_EVERY_VERSIONS"] == 0:
        tasks.evaluate_version.delay(version_id)


def work_available() -> None:
    _group_send(VOLUNTEERS_GROUP, {"type": "work.available"})


def work_cancelled(*, by_user: dict[int, list[int]], reason: str) -> None:
    for user_id, work_unit_ids in by_user.items():
        _group_send(
            user_group(user_id), {"type": "work.cancel", "work_units": work_unit_ids, "reason": reason}
        )
