"""The peer ring in pipeline mode's lifecycle (projects/ring.py): payloads named by their digest only, pulled
from the producer, relayed through the server on request, computed again when lost; and who may signal whom.
The volunteers are the simulated volunteer's stage code driven from the assign messages, as in
test_pipeline_mode; what the browsers would carry over WebRTC is a dict of payloads by digest here."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
import torch
from django.contrib.auth.models import User
from django.db.models import Sum

from engine import codecs
from engine.graph import load_graph
from projects import lifecycle, notify, ring, stages
from projects.datasets import shard_load
from projects.models import Blob, ModelVersion, Project, Result, WorkUnit
from projects.services import version_weights
from tests.integration.test_pipeline_mode import (
    MICRO,
    _blob,
    expected_credit,
    honest,
    offer,
    pipeline_project,
    torch_steps,
    users,
)
from workers import protocol, simulator
from workers.models import CreditEntry, Device, Volunteer
from workers.services import device_disconnect, device_register

pytestmark = pytest.mark.django_db(transaction=True)
RING = {"pipeline_ring": True, "trust_threshold": 0, "spot_check_rate": 0.0}


class Peers:
    """The browsers' side of the ring: each producer keeps what it sent, by digest."""

    def __init__(self) -> None:
        self.held: dict[str, bytes] = {}
        self.pulled = 0

    def pull(self, source: dict[str, Any] | None, url: str | None) -> bytes | None:
        if source is None:
            return _blob(url)
        data = self.held[source["digest"]]
        assert hashlib.sha256(data).hexdigest() == source["digest"]  # as ring.js checks what a peer sends
        self.pulled += len(data)
        return data


def ring_answer(peers: Peers, result: Result) -> tuple[bytes, float | None, str]:
    """The frame, the loss and the digest of what went by the ring ('' when the payload was uploaded)."""
    message = protocol.assign_message(result)["work_unit"]
    assert 0 <= message["stage"]["seed"] < 2**53  # a JSON number a browser reads exactly
    unit = simulator.Unit.parse(message)
    shard = message["shards"][0]
    x, y = shard_load(shard=result.work_unit.shard)
    window = slice(int(shard["offset"]), int(shard["offset"]) + int(shard["count"]))
    ring_fields = message["ring"] or {}
    inputs = simulator.StageInputs(
        torch.from_numpy(x[window].copy()),
        torch.from_numpy(y[window].copy()),
        peers.pull(ring_fields.get("input"), message["input_url"]),
        peers.pull(ring_fields.get("output_grad"), message["output_grad_url"]),
    )
    graph = load_graph(_blob(message["graph_url"]) or b"")
    weights = codecs.decode(_blob(message["weights_url"]) or b"")[0]
    payload, loss = simulator.honest_stage_result(graph, weights, unit, inputs)
    if not ring_fields.get("send"):
        return payload, loss, ""
    if unit.stage and unit.stage["kind"] == "forward":
        sent, frame = payload, b""
    else:
        sent, grads = stages.payload_split(payload)
        frame = stages.backward_payload(input_grad=b"", grads=grads)
    digest = hashlib.sha256(sent).hexdigest()
    peers.held[digest] = sent
    return frame, loss, digest


def receive(
    user: User, result: Result, frame: bytes, loss: float | None, digest: str
) -> lifecycle.ResultOutcome:
    """The result frame as a volunteer sends it (`digest`: what it sent by the ring, or '')."""
    return lifecycle.result_receive(
        user=user,
        work_unit_id=result.work_unit_id,
        samples=result.work_unit.count,
        loss=loss,
        compute_ms=1,
        payload=frame,
        sent_digest=digest,
    )


def send_ring(peers: Peers, user: User, result: Result) -> lifecycle.ResultOutcome:
    frame, loss, digest = ring_answer(peers, result)
    return receive(user, result, frame, loss, digest)


def device(user: User) -> Device:
    return device_register(
        user=user, client_id=f"{user.username}-device", backend="webgl", gflops=10.0, user_agent=""
    )


def work(project: Project, peers: Peers, volunteers: list[User], steps: int) -> None:
    devices = {user.pk: device(user) for user in volunteers}
    for _ in range(40 * steps * MICRO):
        if project.current_version().number >= steps:
            return
        for user in volunteers:
            result = lifecycle.work_unit_offer(user=user, device=devices[user.pk]).result
            if result is not None:
                outcome = send_ring(peers, user, result)
                assert outcome.status == "valid", Result.objects.get(pk=result.pk).reason
    raise AssertionError("the steps did not complete")


def test_with_the_ring_no_activation_reaches_the_server_and_training_equals_torch_sgd(
    researcher: User, digits_dataset: Any
) -> None:
    project = pipeline_project(researcher, digits_dataset, **RING)
    peers = Peers()
    work(project, peers, users("ann", "ben"), steps=2)
    published = version_weights(version=ModelVersion.objects.get(project=project, number=2))
    for name, value in torch_steps(project, 2).items():
        torch.testing.assert_close(published[name], value, rtol=1e-5, atol=1e-5)
    done = WorkUnit.objects.filter(project=project, version__number__lt=2)
    assert (
        not done.filter(input_blob__isnull=False).exists()
        and not done.filter(grad_blob__isnull=False).exists()
    )
    assert done.filter(stage__gt=0).exclude(input_digest="").count() == done.filter(stage__gt=0).count()
    assert peers.pulled > 0
    ledger = CreditEntry.objects.filter(project=project).aggregate(total=Sum("flops"))["total"]
    assert ledger == expected_credit(project) > 0


def first_consumer(
    project: Project, peers: Peers, producer: User, consumer: User, lie: bool = False
) -> Result:
    """The producer computes forward(0, 0) by the ring; the consumer is given forward(1, 0). `lie`: the
    producer reports the digest of garbage, and keeps the garbage for its peers."""
    result = lifecycle.work_unit_offer(user=producer, device=device(producer)).result
    assert result is not None and result.work_unit.stage == 0
    frame, loss, digest = ring_answer(peers, result)
    if lie:
        digest = hashlib.sha256(b"garbage").hexdigest()
        peers.held[digest] = b"garbage"
    outcome = receive(producer, result, frame, loss, digest)
    assert outcome.status == "valid"
    for _ in range(MICRO):
        held = lifecycle.work_unit_offer(user=consumer, device=device(consumer)).result
        assert held is not None
        if held.work_unit.stage == 1:
            return held
        lifecycle.results_release(user=consumer, work_unit_ids=[held.work_unit_id])
    raise AssertionError("no stage 1 unit")


def test_a_consumer_without_a_channel_gets_the_payload_relayed_by_its_producer(
    researcher: User, digits_dataset: Any
) -> None:
    project = pipeline_project(researcher, digits_dataset, **RING)
    peers = Peers()
    ann, ben = users("ann", "ben")
    held = first_consumer(project, peers, ann, ben)
    fields = protocol.assign_message(held)["work_unit"]
    source = fields["ring"]["input"]
    assert source["peer"] == Device.objects.get(volunteer__user=ann).pk
    fetch = ring.ring_fetch(user_id=ben.pk, work_unit_id=held.work_unit_id, what="input")
    assert (fetch.status, fetch.digest, fetch.user_id) == ("ask", source["digest"], ann.pk)
    assert ring.ring_fetch(user_id=ann.pk, work_unit_id=held.work_unit_id, what="input").status == "refused"
    payload = peers.held[source["digest"]]
    assert not ring.ring_relay_store(user_id=ben.pk, digest=source["digest"], payload=payload)  # not its
    assert ring.ring_relay_store(user_id=ann.pk, digest=source["digest"], payload=payload)
    held.work_unit.refresh_from_db()
    again = protocol.assign_message(held)["work_unit"]
    assert again["ring"]["input"] is None and _blob(again["input_url"]) == payload
    assert ring.ring_fetch(user_id=ben.pk, work_unit_id=held.work_unit_id, what="input").status == "ready"
    frame, loss, digest = ring_answer(Peers(), held)
    outcome = receive(ben, held, frame, loss, digest)
    assert outcome.status == "valid"


@pytest.mark.parametrize("lie", [False, True], ids=["bytes not matching the digest", "the digest of garbage"])
def test_a_relay_that_is_not_what_the_producer_said_costs_its_trust_and_the_unit_is_computed_again(
    researcher: User, digits_dataset: Any, lie: bool
) -> None:
    project = pipeline_project(researcher, digits_dataset, **RING)
    peers = Peers()
    ann, ben = users("ann", "ben")
    held = first_consumer(project, peers, ann, ben, lie=lie)
    digest = protocol.assign_message(held)["work_unit"]["ring"]["input"]["digest"]
    uploaded = peers.held[digest] if lie else b"\x00" * 64
    assert ring.ring_relay_store(user_id=ann.pk, digest=digest, payload=uploaded)
    assert Volunteer.objects.get(user=ann).consecutive_valid == 0
    assert not Blob.objects.filter(pk=digest).exists()
    producer = WorkUnit.objects.get(project=project, stage=0, stage_kind="forward", micro_batch=0)
    assert producer.status == WorkUnit.Status.OPEN and producer.wanted == 1
    assert Result.objects.get(pk=held.pk).status == Result.Status.CANCELLED


def test_a_payload_whose_producer_left_is_computed_again_and_the_step_still_equals_torch(
    researcher: User, digits_dataset: Any
) -> None:
    project = pipeline_project(researcher, digits_dataset, **RING)
    peers = Peers()
    ann, ben, cat = users("ann", "ben", "cat")
    held = first_consumer(project, peers, ann, ben)
    digest = protocol.assign_message(held)["work_unit"]["ring"]["input"]["digest"]
    device_disconnect(device_id=Device.objects.get(volunteer__user=ann).pk)
    del peers.held[digest]
    assert ring.ring_fetch(user_id=ben.pk, work_unit_id=held.work_unit_id, what="input").status == "lost"
    consumer = WorkUnit.objects.get(pk=held.work_unit_id)
    assert consumer.wanted == 0 and Result.objects.get(pk=held.pk).status == Result.Status.CANCELLED
    producer = WorkUnit.objects.get(project=project, stage=0, stage_kind="forward", micro_batch=0)
    assert producer.status == WorkUnit.Status.OPEN and producer.canonical_result is None
    first = Result.objects.get(work_unit=producer, volunteer=ann)
    assert first.validation == Result.Validation.VALID  # its credit stays: it did the work
    work(project, peers, [ben, cat], steps=1)
    assert WorkUnit.objects.get(pk=consumer.pk).status == WorkUnit.Status.VALIDATED
    canonical = WorkUnit.objects.get(pk=producer.pk).canonical_result_id
    assert canonical is not None and Result.objects.get(pk=canonical).volunteer != ann
    published = version_weights(version=ModelVersion.objects.get(project=project, number=1))
    for name, value in torch_steps(project, 1).items():
        torch.testing.assert_close(published[name], value, rtol=1e-5, atol=1e-5)
    ledger = CreditEntry.objects.filter(project=project).aggregate(total=Sum("flops"))["total"]
    valid = Result.objects.filter(work_unit__project=project, validation=Result.Validation.VALID)
    assert ledger == sum(stages.unit_flops(work_unit=r.work_unit) for r in valid)


def test_a_checked_unit_that_read_a_ring_payload_is_judged_once_its_producer_uploaded_it(
    researcher: User, digits_dataset: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server recomputes a checked unit from its inputs; one it read by the ring only is not on the
    server. The result waits (no verdict: no volunteer fails for the server's missing bytes), the
    producer's device is asked to upload, and its upload has the result judged."""
    asked: list[tuple[int, int, str]] = []
    monkeypatch.setattr(notify, "ring_upload_asked", lambda **kw: asked.append(tuple(kw.values())))
    project = pipeline_project(researcher, digits_dataset, **RING)
    peers = Peers()
    ann, ben = users("ann", "ben")
    held = first_consumer(project, peers, ann, ben)
    WorkUnit.objects.filter(pk=held.work_unit_id).update(spot_check=True)  # drawn for a check when sent
    held.work_unit.refresh_from_db()
    digest = protocol.assign_message(held)["work_unit"]["ring"]["input"]["digest"]
    frame, loss, sent = ring_answer(peers, held)  # ben pulled ann's activation peer to peer
    outcome = receive(ben, held, frame, loss, sent)
    waiting = Result.objects.get(pk=held.pk)
    assert (waiting.status, waiting.validation) == (Result.Status.RECEIVED, Result.Validation.PENDING), (
        outcome
    )
    assert asked == [(ann.pk, Device.objects.get(volunteer__user=ann).pk, digest)]
    assert ring.ring_relay_store(user_id=ann.pk, digest=digest, payload=peers.held[digest])
    judged = Result.objects.get(pk=held.pk)
    assert judged.validation == Result.Validation.VALID and judged.spot_checked, judged.reason


def test_a_ring_result_for_a_unit_the_server_checks_is_invalid(researcher: User, digits_dataset: Any) -> None:
    pipeline_project(researcher, digits_dataset, pipeline_ring=True, spot_check_rate=0.0)  # nobody trusted
    (ann,) = users("ann")
    result = offer(ann)
    assert result is not None and protocol.assign_message(result)["work_unit"]["ring"]["send"] is False
    payload, loss = honest(result)
    outcome = lifecycle.result_receive(
        user=ann,
        work_unit_id=result.work_unit_id,
        samples=result.work_unit.count,
        loss=loss,
        compute_ms=1,
        payload=b"",
        sent_digest=hashlib.sha256(payload).hexdigest(),
    )
    assert outcome.status == "invalid" and "only its digest" in outcome.reason


def test_only_devices_of_adjacent_stages_of_one_step_may_signal(
    researcher: User, digits_dataset: Any
) -> None:
    project = pipeline_project(researcher, digits_dataset, **RING)
    peers = Peers()
    ann, ben, cat = users("ann", "ben", "cat")
    held = first_consumer(project, peers, ann, ben)
    device(cat)
    a, b, c = (Device.objects.get(volunteer__user=u).pk for u in (ann, ben, cat))
    assert ring.ring_adjacent(device_id=b, other_id=a) and ring.ring_adjacent(device_id=a, other_id=b)
    assert not ring.ring_adjacent(device_id=c, other_id=a) and not ring.ring_adjacent(device_id=b, other_id=c)
    lifecycle.results_release(user=ben, work_unit_ids=[held.work_unit_id])
    assert not ring.ring_adjacent(device_id=b, other_id=a)  # nobody computes next to the other any more
    Project.objects.filter(pk=project.pk).update(pipeline_ring=False)
    assert not ring.ring_adjacent(device_id=a, other_id=b)
