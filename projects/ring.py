"""The peer ring in pipeline mode's lifecycle (issue 14, item 5; docs/pipeline.md "Peer ring").

With a project's `pipeline_ring` on, a stage unit's payload for the adjacent stage (a forward unit's output
activation, a backward unit's input gradient) may go from its volunteer straight to the volunteer of the
unit that reads it, over WebRTC (frontend/static/frontend/ring.js). The result then carries the payload's
SHA-256 (`Result.sent_digest`) instead of its bytes, and the units that read it name the digest
(`WorkUnit.input_digest`, `grad_digest`) instead of a blob. The consumer pulls the bytes from the producer
and checks them against the digest the producer gave the server.

- Spot checks need the bytes: a unit sent for a spot check (drawn when sent, and every unit of a volunteer
  not trusted yet) is told to upload its payload as usual (`ring_send_allowed`). A checked unit that *read*
  a payload by the ring is recomputed from it too: its result waits (pending) while the server asks the
  producer to upload it, and is judged when it arrives (`ring_check_inputs`).
- The relay: a consumer that cannot get the bytes from its peer (no channel, the peer does not have them, a
  digest mismatch) asks the server (`fetch`); the server asks the producer's device to upload them
  (`upload`, then the producer's `relay` frame), checks them against the digest and the shape, stores them
  as a blob and attaches it to every unit that reads it, whose grants then serve it (`ring_relay_store`).
- Lost bytes: when the producer is gone or no longer has them, the producing unit is reopened and computed
  again (`ring_payload_lost`); the units that read the payload wait for it (`wanted = 0`) and are fed the new
  one when it is validated (stages.stage_successor_create). The first producer keeps its credit: it did the
  work, and nothing shows it did it wrong. A producer whose upload does not match its own digest, or does
  not decode, loses its trust instead, so its next results are spot-checked (and uploaded).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from functools import partial

from django.db import transaction
from django.db.models import Exists, OuterRef, Q

from engine import activations
from projects import notify, stages
from projects.blobs import blob_put
from projects.models import Blob, Result, WorkUnit
from workers.models import Device
from workers.services import volunteer_ensure, volunteer_record_invalid

DIGEST = re.compile(r"^[0-9a-f]{64}$")
INPUT, OUTPUT_GRAD = "input", "output_grad"


@dataclass(frozen=True)
class Fetch:
    """What a consumer's `fetch` leads to: the bytes are on the server (`ready`), the producer's device is
    asked to upload them (`ask`: its user and device), or they are lost and the producer unit reopened."""

    status: str  # "ready" | "ask" | "lost" | "refused"
    digest: str = ""
    user_id: int = 0
    device_id: int = 0


# --- what the assign says ----------------------------------------------------------------------------


def ring_on(*, work_unit: WorkUnit) -> bool:
    return bool(work_unit.stage_kind) and work_unit.project.pipeline_ring


def produces_payload(*, work_unit: WorkUnit) -> bool:
    """Does the unit send something to an adjacent stage: a forward unit its output, a backward unit of a
    stage after the first that needs it, its input gradient?"""
    if work_unit.stage_kind == stages.FORWARD:
        return True
    return bool(work_unit.stage) and stages.unit_stage(work_unit=work_unit).needs_input_grad


def ring_send_allowed(*, result: Result) -> bool:
    """May this instance send its payload by the ring (its result then carries the digest only)? Not when
    the server will check it: a spot check drawn when it was sent, or a volunteer not trusted yet."""
    work_unit = result.work_unit
    if not ring_on(work_unit=work_unit) or not produces_payload(work_unit=work_unit) or work_unit.spot_check:
        return False
    volunteer = volunteer_ensure(user=result.volunteer)
    return volunteer.is_trusted(threshold=work_unit.project.trust_threshold)


def ring_sources(*, work_unit: WorkUnit) -> dict[str, dict[str, object] | None]:
    """For each payload the unit reads that is not on the server: its digest and the device that has it."""
    sources: dict[str, dict[str, object] | None] = {INPUT: None, OUTPUT_GRAD: None}
    if work_unit.input_digest and work_unit.input_blob_id is None:
        sources[INPUT] = _source(work_unit=work_unit, what=INPUT)
    if work_unit.grad_digest and work_unit.grad_blob_id is None:
        sources[OUTPUT_GRAD] = _source(work_unit=work_unit, what=OUTPUT_GRAD)
    return sources


def _source(*, work_unit: WorkUnit, what: str) -> dict[str, object]:
    producer = producer_result(work_unit=work_unit, what=what)
    return {"digest": _digest(work_unit, what), "peer": producer.device_id if producer else None}


def _digest(work_unit: WorkUnit, what: str) -> str:
    return work_unit.input_digest if what == INPUT else work_unit.grad_digest


def producer_unit(*, work_unit: WorkUnit, what: str) -> WorkUnit | None:
    """The unit whose payload `work_unit` reads: forward(k-1) made stage k's input, backward(k+1) the gradient
    of its output."""
    k, kind = work_unit.stage or 0, stages.FORWARD
    if what == OUTPUT_GRAD:
        k, kind = k + 2, stages.BACKWARD
    return (
        WorkUnit.objects.filter(
            version_id=work_unit.version_id, stage_kind=kind, stage=k - 1, micro_batch=work_unit.micro_batch
        )
        .exclude(status=WorkUnit.Status.CANCELLED)
        .first()
    )


def producer_result(*, work_unit: WorkUnit, what: str) -> Result | None:
    producer = producer_unit(work_unit=work_unit, what=what)
    if producer is None or producer.canonical_result_id is None:
        return None
    result = Result.objects.get(pk=producer.canonical_result_id)
    return result if result.sent_digest == _digest(work_unit, what) else None


# --- signalling ---------------------------------------------------------------------------------------


def ring_adjacent(*, device_id: int, other_id: int) -> bool:
    """Do the two devices hold (or have computed) units of adjacent stages of one project step, one of
    them still computing? Only such pairs may open a peer link (workers/signalling.py)."""
    return _holds_next_to(device_id, other_id) or _holds_next_to(other_id, device_id)


def _holds_next_to(holder: int, other: int) -> bool:
    live = (Result.Status.IN_PROGRESS, Result.Status.RECEIVED)
    neighbours = WorkUnit.objects.filter(
        Q(stage=OuterRef("stage") - 1) | Q(stage=OuterRef("stage") + 1),
        version_id=OuterRef("version_id"),
        results__device_id=other,
        results__status__in=live,
    )
    return (
        WorkUnit.objects.filter(
            results__device_id=holder,
            results__status=Result.Status.IN_PROGRESS,
            project__pipeline_ring=True,
        )
        .exclude(stage_kind="")
        .filter(Exists(neighbours))
        .exists()
    )


# --- the relay ----------------------------------------------------------------------------------------


def ring_fetch(*, user_id: int, work_unit_id: int, what: str) -> Fetch:
    """A consumer could not get a payload from its peer: have it brought to the server."""
    with transaction.atomic():
        work_unit = _held(user_id=user_id, work_unit_id=work_unit_id)
        digest = _digest(work_unit, what) if work_unit else ""
        if work_unit is None or not digest:
            return Fetch("refused")
        fetch = _bring(work_unit=work_unit, what=what)
        if fetch.status == "lost":
            ring_payload_lost(work_unit=work_unit, digest=digest)
        return fetch


def ring_check_inputs(*, work_unit: WorkUnit) -> list[Fetch]:
    """The server is to recompute `work_unit` (a check of its result) from the payloads it read: those sent
    by the ring are attached if on the server by now; for the others, the producer's device is asked to
    upload them (ring_relay_store then queues the result's validation again). Returns the payloads still
    missing: "ask" (asked for, on commit) or "lost" (the producer left; its give-up, without penalty, is
    the transitioner's)."""
    wanted = [
        what for what in (INPUT, OUTPUT_GRAD) if _digest(work_unit, what) and not _blob_id(work_unit, what)
    ]
    missing = [f for f in (_bring(work_unit=work_unit, what=what) for what in wanted) if f.status != "ready"]
    for fetch in missing:
        if fetch.status == "ask":
            ask = partial(notify.ring_upload_asked, user_id=fetch.user_id, device_id=fetch.device_id)
            transaction.on_commit(partial(ask, digest=fetch.digest))
    return missing


def _blob_id(work_unit: WorkUnit, what: str) -> str | None:
    return work_unit.input_blob_id if what == INPUT else work_unit.grad_blob_id


def _bring(*, work_unit: WorkUnit, what: str) -> Fetch:
    """Where the payload `work_unit` reads as `what` is: on the server (attached now), with its producer's
    connected device, or nowhere any more."""
    digest = _digest(work_unit, what)
    blob = Blob.objects.filter(pk=digest).first()
    if blob is not None:
        _attach(work_unit=work_unit, blob=blob)
        return Fetch("ready", digest)
    producer = producer_result(work_unit=work_unit, what=what)
    device = Device.objects.filter(pk=producer.device_id).first() if producer and producer.device_id else None
    if producer is None or device is None or device.disconnected_at is not None:
        return Fetch("lost", digest)
    return Fetch("ask", digest, user_id=producer.volunteer_id, device_id=device.pk)


def _held(*, user_id: int, work_unit_id: int) -> WorkUnit | None:
    return (
        WorkUnit.objects.filter(
            pk=work_unit_id,
            status=WorkUnit.Status.OPEN,
            results__volunteer_id=user_id,
            results__status=Result.Status.IN_PROGRESS,
        )
        .exclude(stage_kind="")
        .select_related("project")
        .first()
    )


def ring_relay_store(*, user_id: int, digest: str, payload: bytes) -> bool:
    """A producer uploads a payload it sent by the ring: stored and attached to the units that read it, if
    it is what the producer's result said (its digest) and what they expect (kind, shape, codec). Bytes that
    are not: the producer loses its trust and the payload counts as lost. False if nothing asked for it."""
    with transaction.atomic():
        readers = _readers(digest=digest)
        if not readers or not _produced_by(user_id=user_id, work_unit=readers[0], digest=digest):
            return False
        if hashlib.sha256(payload).hexdigest() != digest or not _decodes(readers[0], digest, payload):
            volunteer_record_invalid(user_id=user_id)
            ring_payload_lost(work_unit=readers[0], digest=digest)
            return True
        blob = blob_put(data=payload)
        for work_unit in readers:
            _attach(work_unit=work_unit, blob=blob)
        _revalidate(readers=readers)
        return True


def _revalidate(*, readers: list[WorkUnit]) -> None:
    """Results of these units received and waiting for the payload to be checked (ring_check_inputs): their
    validation runs again once this commits."""
    waiting = Result.objects.filter(
        work_unit__in=readers, status=Result.Status.RECEIVED, validation=Result.Validation.PENDING
    )
    for result_id in waiting.values_list("pk", flat=True):
        transaction.on_commit(partial(notify.result_received, result_id=result_id))


def ring_relay_missing(*, user_id: int, digest: str) -> bool:
    """The producer no longer has the payload (its page reloaded, or dropped it): it is lost."""
    with transaction.atomic():
        readers = _readers(digest=digest)
        if not readers or not _produced_by(user_id=user_id, work_unit=readers[0], digest=digest):
            return False
        ring_payload_lost(work_unit=readers[0], digest=digest)
        return True


def _readers(*, digest: str) -> list[WorkUnit]:
    """The open units that read the payload `digest` and do not have its blob yet."""
    if not DIGEST.match(digest):
        return []
    reads = Q(input_digest=digest, input_blob__isnull=True) | Q(grad_digest=digest, grad_blob__isnull=True)
    return list(
        WorkUnit.objects.select_for_update(of=("self",), no_key=True)
        .filter(reads, status=WorkUnit.Status.OPEN)
        .select_related("project")
        .order_by("pk")
    )


def _produced_by(*, user_id: int, work_unit: WorkUnit, digest: str) -> bool:
    what = INPUT if work_unit.input_digest == digest else OUTPUT_GRAD
    producer = producer_result(work_unit=work_unit, what=what)
    return producer is not None and producer.volunteer_id == user_id


def _decodes(work_unit: WorkUnit, digest: str, payload: bytes) -> bool:
    codec = work_unit.project.activation_codec
    if work_unit.input_digest == digest:
        shape = stages.input_shape(stages.unit_stage(work_unit=work_unit), work_unit.count)
        kind = "activation"
    else:
        shape, kind = stages.output_shape(work_unit=work_unit), "gradient"
    try:
        activations.decode(payload, shape, kind=kind, codec=codec)
    except activations.ActivationError:
        return False
    return True


def _attach(*, work_unit: WorkUnit, blob: Blob) -> None:
    fields: list[str] = []
    if work_unit.input_digest == blob.sha256 and work_unit.input_blob_id is None:
        work_unit.input_blob, fields = blob, [*fields, "input_blob"]
    if work_unit.grad_digest == blob.sha256 and work_unit.grad_blob_id is None:
        work_unit.grad_blob, fields = blob, [*fields, "grad_blob"]
    if fields:
        WorkUnit.objects.filter(pk=work_unit.pk).update(**{f: blob for f in fields})


# --- lost payloads ------------------------------------------------------------------------------------


def ring_payload_lost(*, work_unit: WorkUnit, digest: str) -> None:
    """Nobody can give the payload `digest` that `work_unit` reads: its producer unit is computed again.
    The open units reading it wait (`wanted = 0`, their instances in flight cancelled) until the new
    result's validation feeds them (stages.stage_successor_create). The caller runs a transaction."""
    what = INPUT if work_unit.input_digest == digest else OUTPUT_GRAD
    producer = producer_unit(work_unit=work_unit, what=what)
    if producer is None:
        return
    producer = WorkUnit.objects.select_for_update(no_key=True).get(pk=producer.pk)
    readers = _readers(digest=digest)
    _hold_back(readers=readers)
    if producer.status == WorkUnit.Status.VALIDATED:
        producer.status, producer.canonical_result, producer.wanted = WorkUnit.Status.OPEN, None, 1
        producer.save(update_fields=["status", "canonical_result", "wanted"])
        transaction.on_commit(notify.work_available)


def _hold_back(*, readers: list[WorkUnit]) -> None:
    ids = [w.pk for w in readers]
    in_flight = Result.objects.filter(work_unit_id__in=ids, status=Result.Status.IN_PROGRESS)
    by_user: dict[int, list[int]] = {}
    for work_unit_id, user_id in in_flight.values_list("work_unit_id", "volunteer_id"):
        by_user.setdefault(user_id, []).append(work_unit_id)
    reason = "its input is being computed again (the volunteer who had it left)"
    in_flight.update(status=Result.Status.CANCELLED, reason=reason)
    WorkUnit.objects.filter(pk__in=ids).update(wanted=0)
    transaction.on_commit(lambda: notify.work_cancelled(by_user=by_user, reason=reason))
