"""The outbox: side effects after a commit, by id. Celery tasks are queued and connected volunteers are told
over the channel layer; nothing here reads the database or decides anything (the services do, and call
these from `transaction.on_commit`). It imports no other module of projects/, so every one may use it."""

from __future__ import annotations

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer

from config.celery import app

VOLUNTEERS_GROUP = "volunteers"
# Connections that asked for work and got none: only they hear work.available. Sent to every volunteer, each
# beat's announcement woke all 19,000 idle consumers of one web process (issue 15).
WAITING_GROUP = "waiting"
RING_UPLOAD_EVENT = "ring.upload"  # workers/ring.py's handler: the named device uploads a ring payload


def user_group(user_id: int) -> str:
    return f"volunteer.{user_id}"


def _group_send(group: str, message: dict[str, object]) -> None:
    layer = get_channel_layer()
    if layer is not None:
        async_to_sync(layer.group_send)(group, message)


def _enqueue(task: str, *args: object) -> None:
    # By name: tasks.py imports every service, so importing it here would close a circle. projects.apps
    # imports it in every process, so the name is always registered (and eager test runs run it in place).
    app.tasks[f"projects.tasks.{task}"].delay(*args)


def feed_requested(*, project_id: int) -> None:
    _enqueue("feed_project", project_id)


def result_received(*, result_id: int) -> None:
    _enqueue("validate_result", result_id)


def results_received(*, result_ids: list[int]) -> None:
    """A batch of arrivals (lifecycle.results_receive): one task validates them all."""
    _enqueue("validate_results", result_ids)


def reference_wanted(*, work_unit_id: int) -> None:
    _enqueue("compute_reference", work_unit_id)


def results_decided(*, result_ids: list[int]) -> None:
    """Verdicts committed outside a validation (refusals, give-ups, abandons): their announcement, and the
    step any of them may complete (training.results_decided), run in a task."""
    _enqueue("results_decided", result_ids)


def ring_upload_asked(*, user_id: int, device_id: int, digest: str) -> None:
    """The server needs a payload a device sent by the peer ring (to check a unit that read it)."""
    _group_send(user_group(user_id), {"type": RING_UPLOAD_EVENT, "to": device_id, "digest": digest})


def step_wanted(*, project_id: int) -> None:
    _enqueue("project_step", project_id)


def evaluation_wanted(*, version_id: int) -> None:
    _enqueue("evaluate_version", version_id)


def baseline_wanted(*, project_id: int) -> None:
    _enqueue("train_baseline", project_id)


def result_decided(
    *,
    user_id: int,
    work_unit_id: int,
    status: str,
    reason: str,
    credit_flops: int,
    total_credit_flops: int,
    recent_credit: float,
) -> None:
    """Tell a volunteer how its result was judged, and its credit after it (the total, the recent average)."""
    _group_send(
        user_group(user_id),
        {
            "type": "result.decided",
            "work_unit": work_unit_id,
            "status": status,
            "reason": reason,
            "credit_flops": credit_flops,
            "total_credit_flops": total_credit_flops,
            "recent_credit": recent_credit,
        },
    )


def work_available() -> None:
    _group_send(WAITING_GROUP, {"type": "work.available"})


def preferences_changed(*, user_id: int) -> None:
    """A volunteer saved computing preferences: each of their connections sends its browser the new set."""
    _group_send(user_group(user_id), {"type": "preferences.changed"})


def work_cancelled(*, by_user: dict[int, list[int]], reason: str) -> None:
    for user_id, work_unit_ids in by_user.items():
        _group_send(
            user_group(user_id), {"type": "work.cancel", "work_units": work_unit_ids, "reason": reason}
        )
