"""Validation and trust: honest updates are credited, every kind of bad one is caught and earns nothing."""

from __future__ import annotations

import math
import threading
from typing import Any
from unittest import mock

import pytest
import torch
from django.contrib.auth.models import User
from django.db import OperationalError, connection, transaction
from django.test.utils import CaptureQueriesContext
from safetensors.torch import save as st_save

from engine import codecs
from projects import lifecycle, tasks, training, validation
from projects.blobs import blob_put
from projects.models import Project, Result, WorkUnit
from projects.validation import recompute
from tests.integration.volunteer import assign, honest_update, judged, receive, tampered
from workers.models import CreditEntry, Device, Volunteer
from workers.services import device_register

pytestmark = pytest.mark.django_db(transaction=True)


def test_an_untrusted_volunteers_honest_update_is_spot_checked_and_credited(
    mlp_project: Project, volunteer_user: User
) -> None:
    result = assign(volunteer_user)
    outcome = receive(volunteer_user, result)
    assert outcome.status == "valid", outcome.reason
    checked = judged(result)
    assert checked.spot_checked and checked.is_valid
    assert checked.work_unit.canonical_result_id == result.pk  # the one result training aggregates
    assert outcome.credit_flops == mlp_project.flops_per_sample * result.work_unit.count
    volunteer = Volunteer.objects.get(user=volunteer_user)
    assert (volunteer.total_flops, volunteer.consecutive_valid) == (outcome.credit_flops, 1)


@pytest.mark.parametrize("how", ["nan", "shape", "sign_flip", "scaled", "random"])
def test_bad_updates_are_invalid_earn_nothing_and_are_resent(
    mlp_project: Project, volunteer_user: User, how: str
) -> None:
    Volunteer.objects.create(user=volunteer_user, consecutive_valid=3)
    result = assign(volunteer_user)
    outcome = receive(volunteer_user, result, tampered(result.work_unit, how))
    assert outcome.status == "invalid" and outcome.credit_flops == 0
    assert judged(result).reason
    assert not CreditEntry.objects.exists()
    assert Volunteer.objects.get(user=volunteer_user).consecutive_valid == 0
    assert WorkUnit.objects.get(pk=result.work_unit_id).wanted == 1


def test_a_data_parallel_result_without_a_loss_is_invalid(mlp_project: Project, volunteer_user: User) -> None:
    """The protocol admits a null loss for pipeline stage units that compute none; a data-parallel unit
    always computes one, so a volunteer sending null there is refused, not averaged in as a loss of 0."""
    result = assign(volunteer_user)
    outcome = receive(volunteer_user, result, loss=None)
    assert outcome.status == "invalid" and outcome.credit_flops == 0
    assert judged(result).reason == "the loss is not a finite number"


@pytest.mark.parametrize("problem", ["garbage", "samples"])
def test_malformed_results_are_invalid(mlp_project: Project, volunteer_user: User, problem: str) -> None:
    result = assign(volunteer_user)
    if problem == "garbage":
        outcome = receive(volunteer_user, result, b"\x00not safetensors")
    else:
        outcome = receive(volunteer_user, result, samples=result.work_unit.count + 1)
    assert outcome.status == "invalid" and outcome.credit_flops == 0


def test_replayed_updates_are_invalid(mlp_project: Project, volunteer_user: User) -> None:
    first = assign(volunteer_user)
    payload = honest_update(first.work_unit)
    assert receive(volunteer_user, first, payload).status == "valid"
    second = assign(volunteer_user)
    outcome = receive(volunteer_user, second, payload)
    assert outcome.status == "invalid" and "replay" in outcome.reason


def test_the_first_of_identical_updates_is_no_replay_when_judged_after_its_copies(
    mlp_project: Project, volunteer_user: User
) -> None:
    """A batch judged the first result after its copies had arrived and found it a replay of them: the honest
    work was refused with the replays (test_simulator's stale_replay: 3 invalid of 3 on a loaded machine)."""
    first = assign(volunteer_user)
    payload = honest_update(first.work_unit)
    with mock.patch("projects.notify.result_received"):  # the validator is away: both wait, unjudged
        assert receive(volunteer_user, first, payload).status == "pending"
        second = assign(volunteer_user)
        assert receive(volunteer_user, second, payload).status == "pending"
    assert tasks.validate_result(first.pk) == 2
    assert judged(first).is_valid, judged(first).reason
    assert judged(second).validation == "invalid" and "replay" in judged(second).reason


def test_trusted_volunteers_skip_spot_checks_but_not_the_norm_check(
    mlp_project: Project, volunteer_user: User
) -> None:
    mlp_project.spot_check_rate = 0.0
    mlp_project.save()
    Volunteer.objects.create(user=volunteer_user, consecutive_valid=mlp_project.trust_threshold)
    honest = assign(volunteer_user)
    assert receive(volunteer_user, honest).status == "valid"
    assert not judged(honest).spot_checked
    Result.objects.filter(pk=honest.pk).update(update_norm=1e-3)
    _norm_history(honest, norm=1e-3, count=4)  # a history of small updates
    scaled = assign(volunteer_user)
    outcome = receive(volunteer_user, scaled, tampered(scaled.work_unit, "scaled"))
    assert outcome.status == "invalid" and "norm" in outcome.reason


def _norm_history(unit: Result, *, norm: float, samples: int = 0, count: int = 5) -> None:
    """`count` valid results of other volunteers on `unit`'s work unit: the project's recent norms."""
    for index in range(count):
        Result.objects.create(
            work_unit=unit.work_unit,
            volunteer=User.objects.create_user(f"history-{index}"),
            deadline=unit.deadline,
            status=Result.Status.RECEIVED,
            validation=Result.Validation.VALID,
            update_norm=norm,
            samples=samples,
        )


@pytest.mark.parametrize("mode", ["averaging", "sync_sgd"])
def test_local_steps_norms_are_compared_per_step(
    mlp_project: Project, volunteer_user: User, mode: str
) -> None:
    """Crowd rounds size averaging units per device: a fast device's unit of 100 local steps has a larger
    delta than a slow one's of 2, and is no outlier for it; a scaled update still is. Gradients are means."""
    Project.objects.filter(pk=mlp_project.pk).update(mode=mode, local_batch_size=64)
    unit = assign(volunteer_user)
    _norm_history(unit, norm=0.1, samples=128)  # small units of 2 local steps
    unit.work_unit.project.refresh_from_db()
    unit.samples = 6400  # 100 local steps: 1.6 is 0.016 a step, against 0.05
    assert (validation._norm_problem(result=unit, norm=1.6) is None) is (mode == "averaging")
    unit.samples = 128
    assert validation._norm_problem(result=unit, norm=10.0) is not None


@pytest.mark.parametrize(
    ("samples", "ratio", "refused"),
    [
        (32, 11.0, True),
        (64, 11.0, True),
        (2, 75.0, False),
        (2, 170.0, True),
        (4, 70.0, False),
        (4, 90.0, True),
    ],
)
def test_the_norm_check_widens_for_units_of_a_few_samples(
    mlp_project: Project, volunteer_user: User, samples: int, ratio: float, refused: bool
) -> None:
    """Honest 2-sample gradients of the MNIST MLP reach 73x the median norm (issue 15's 256 volunteers,
    NORM_FULL_SAMPLES): at 10x, honest volunteers were refused. What a unit can move its round by (samples x
    norm) stays bounded as a full unit's at 10x."""
    unit = assign(volunteer_user)
    _norm_history(unit, norm=1.0, samples=32)
    unit.samples = samples
    assert (validation._norm_problem(result=unit, norm=ratio) is not None) is refused


@pytest.mark.parametrize("codec", ["fp32", "fp16", "int8", "int4", "topk"])
def test_every_codec_is_accepted(mlp_project: Project, volunteer_user: User, codec: str) -> None:
    Project.objects.filter(pk=mlp_project.pk).update(codec=codec)
    result = assign(volunteer_user)
    assert receive(volunteer_user, result).status == "valid"
    assert judged(result).spot_checked


@pytest.mark.parametrize("codec", ["int4", "topk"])
@pytest.mark.parametrize("how", ["sign_flip", "scaled", "random"])
def test_lossy_codecs_still_catch_tampered_updates(
    mlp_project: Project, volunteer_user: User, codec: str, how: str
) -> None:
    """int4's wider tolerance and topk's statistical check (an honest topk update is far from the server's
    in L2) still refuse the attacks."""
    Project.objects.filter(pk=mlp_project.pk).update(codec=codec)
    result = assign(volunteer_user)
    outcome = receive(volunteer_user, result, tampered(result.work_unit, how))
    assert outcome.status == "invalid", outcome.reason
    assert judged(result).spot_checked


@pytest.mark.parametrize(
    ("how", "status"), [("honest", "valid"), ("sign_flip", "invalid"), ("scaled", "invalid")]
)
def test_dropout_models_are_spot_checked_statistically(
    cnn_project: Project, volunteer_user: User, how: str, status: str
) -> None:
    result = assign(volunteer_user)
    torch.manual_seed(12345)  # a different dropout mask from the server's recomputation
    payload = honest_update(result.work_unit) if how == "honest" else tampered(result.work_unit, how)
    outcome = receive(volunteer_user, result, payload)
    assert outcome.status == status, outcome.reason
    assert judged(result).spot_checked


def test_identical_honest_answers_to_the_same_slice_are_not_replays(
    mlp_project: Project, volunteer_user: User, other_volunteer: User
) -> None:
    first = assign(volunteer_user)
    payload = honest_update(first.work_unit)
    assert receive(volunteer_user, first, payload).status == "valid"
    # The same slice of the same version, sent again (as when a round wraps around a small dataset).
    twin = WorkUnit.objects.get(pk=first.work_unit_id)
    twin.pk, twin.status, twin.wanted, twin.total_results = None, WorkUnit.Status.OPEN, 1, 0
    twin.canonical_result = None
    twin.save()
    WorkUnit.objects.exclude(pk=twin.pk).update(wanted=0)
    second = assign(other_volunteer)
    assert second.work_unit_id == twin.pk
    assert receive(other_volunteer, second, payload).status == "valid"


def test_a_spot_check_does_not_lock_the_project(
    mlp_project: Project, volunteer_user: User, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Validations of one project must run side by side (a round's results arrive together): while one
    recomputes an update, the project row, which every other validation and the round's step need, is free."""
    result = assign(volunteer_user)
    Result.objects.filter(pk=result.pk).update(
        status=Result.Status.RECEIVED,
        samples=result.work_unit.count,
        loss=1.0,
        blob=blob_put(data=honest_update(result.work_unit)),
    )
    inside, release = threading.Event(), threading.Event()

    def slow_recompute(*, work_unit: WorkUnit) -> dict[str, torch.Tensor]:
        inside.set()
        release.wait(10)
        return recompute(work_unit=work_unit)

    monkeypatch.setattr(validation, "recompute", slow_recompute)

    def validate() -> None:
        try:
            validation.results_validate(result_id=result.pk)
        finally:
            connection.close()

    thread = threading.Thread(target=validate)
    thread.start()
    try:
        assert inside.wait(10)
        with transaction.atomic():
            Project.objects.select_for_update(nowait=True).get(pk=mlp_project.pk)  # raises if locked
    finally:
        release.set()
        thread.join(10)
    assert judged(result).is_valid


def _received(result: Result) -> None:
    Result.objects.filter(pk=result.pk).update(
        status=Result.Status.RECEIVED,
        samples=result.work_unit.count,
        loss=1.0,
        blob=blob_put(data=honest_update(result.work_unit)),
    )


def _holding_work_unit(work_unit_id: int, held: threading.Event, release: threading.Event) -> None:
    try:
        with transaction.atomic():
            WorkUnit.objects.select_for_update().get(pk=work_unit_id)
            held.set()
            release.wait(10)
    finally:
        connection.close()


def test_a_result_whose_work_unit_another_transaction_holds_comes_back_later(
    mlp_project: Project, volunteer_user: User, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another validator's batch holding the work unit (deciding this result as its mate) kept this one's
    process waiting for that commit: the task now comes back after BUSY_SECONDS, and the result is decided
    when it does."""
    result = assign(volunteer_user)
    _received(result)
    later: list[tuple[Any, ...]] = []
    monkeypatch.setattr(tasks.validate_result, "apply_async", lambda *a, **kw: later.append((a, kw)))
    held, release = threading.Event(), threading.Event()
    holder = threading.Thread(target=_holding_work_unit, args=(result.work_unit_id, held, release))
    holder.start()
    try:
        assert held.wait(10)
        with pytest.raises(validation.Busy):
            validation.results_validate(result_id=result.pk, wait=False)
        assert tasks.validate_result(result.pk) == 0  # did not wait for the holder
    finally:
        release.set()
        holder.join(10)
    assert later == [(((result.pk,), {"busy": 1}), {"countdown": tasks.BUSY_SECONDS})]
    assert Result.objects.get(pk=result.pk).validation == Result.Validation.PENDING
    assert tasks.validate_result(result.pk, busy=1) == 1  # the holder is gone: decided
    assert judged(result).is_valid


def test_a_batch_of_arrivals_is_validated_by_one_task_and_a_busy_one_comes_back_alone(
    mlp_project: Project, volunteer_user: User, other_volunteer: User, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tasks.validate_results (lifecycle.results_receive's one task for a batch): the free result is decided,
    the one whose work unit another transaction holds goes on as validate_result's retries."""
    busy, free = assign(volunteer_user), assign(other_volunteer)
    _received(busy)
    _received(free)
    later: list[tuple[Any, ...]] = []
    monkeypatch.setattr(tasks.validate_result, "apply_async", lambda *a, **kw: later.append((a, kw)))
    held, release = threading.Event(), threading.Event()
    holder = threading.Thread(target=_holding_work_unit, args=(busy.work_unit_id, held, release))
    holder.start()
    try:
        assert held.wait(10)
        assert tasks.validate_results([busy.pk, free.pk]) == 1
    finally:
        release.set()
        holder.join(10)
    assert later == [(((busy.pk,), {"busy": 1}), {"countdown": tasks.BUSY_SECONDS})]
    assert judged(free).is_valid and judged(busy).validation == Result.Validation.PENDING
    assert tasks.validate_results([busy.pk, free.pk]) == 1 and judged(busy).is_valid


def test_after_its_retries_a_busy_result_waits_for_the_lock(
    mlp_project: Project, volunteer_user: User, monkeypatch: pytest.MonkeyPatch
) -> None:
    result = assign(volunteer_user)
    _received(result)
    monkeypatch.setattr(
        tasks.validate_result, "apply_async", mock.Mock(side_effect=AssertionError("requeued"))
    )
    held, release = threading.Event(), threading.Event()
    holder = threading.Thread(target=_holding_work_unit, args=(result.work_unit_id, held, release))
    holder.start()
    assert held.wait(10)
    threading.Timer(0.5, release.set).start()
    try:
        assert tasks.validate_result(result.pk, busy=tasks.BUSY_RETRIES) == 1  # waited, then decided
    finally:
        release.set()
        holder.join(10)
    assert judged(result).is_valid


# --- spot checks decided when work is sent, references computed meanwhile ------------------------


@pytest.fixture
def precomputing(settings: Any) -> None:
    """Every spot-checked work unit gets its reference at once (the MLP's are below the default size)."""
    settings.CROWDTRAIN = {**settings.CROWDTRAIN, "REFERENCE_MIN_FLOPS": 0}


def _reference(work_unit_id: int) -> dict[str, torch.Tensor] | None:
    work_unit = WorkUnit.objects.select_related("reference").get(pk=work_unit_id)
    return codecs.decode(work_unit.reference.read())[0] if work_unit.reference else None


@pytest.mark.usefixtures("precomputing")
def test_the_server_computes_a_checked_slice_while_the_volunteer_does(
    mlp_project: Project, volunteer_user: User
) -> None:
    result = assign(volunteer_user)  # Celery is eager here: the reference task ran when the work was sent

    work_unit = WorkUnit.objects.get(pk=result.work_unit_id)
    stored, expected = _reference(work_unit.pk), recompute(work_unit=work_unit)
    assert work_unit.spot_check and stored is not None
    assert stored.keys() == expected.keys()
    assert all(torch.equal(stored[name], expected[name]) for name in expected)


@pytest.mark.usefixtures("precomputing")
def test_validation_compares_with_the_stored_reference(mlp_project: Project, volunteer_user: User) -> None:
    result = assign(volunteer_user)
    honest = honest_update(result.work_unit)
    # A wrong reference makes the honest update fail: proof that validation compared with it rather than
    # recomputing the slice.
    wrong = {name: -t for name, t in recompute(work_unit=result.work_unit).items()}
    recipe = {"recipe": mlp_project.task_recipe}
    WorkUnit.objects.filter(pk=result.work_unit_id).update(
        reference=blob_put(data=codecs.encode(wrong, metadata=recipe))
    )

    outcome = receive(volunteer_user, result, honest)
    assert outcome.status == "invalid" and "recomputation" in outcome.reason


@pytest.mark.usefixtures("precomputing")
def test_a_reference_computed_under_other_settings_is_not_used(
    mlp_project: Project, volunteer_user: User
) -> None:
    result = assign(volunteer_user)  # its reference is a gradient (sync_sgd)
    assert _reference(result.work_unit_id) is not None
    Project.objects.filter(pk=mlp_project.pk).update(mode=Project.Mode.AVERAGING)  # changed mid-round

    outcome = receive(volunteer_user, judged(result))  # a local-steps delta, as the settings now say
    assert outcome.status == "valid", outcome.reason


def test_small_slices_are_recomputed_when_their_result_arrives(
    mlp_project: Project, volunteer_user: User
) -> None:
    result = assign(volunteer_user)
    assert WorkUnit.objects.get(pk=result.work_unit_id).spot_check
    assert _reference(result.work_unit_id) is None  # below REFERENCE_MIN_FLOPS: no task for it

    assert receive(volunteer_user, result).status == "valid"
    assert judged(result).spot_checked


@pytest.mark.usefixtures("precomputing")
def test_trusted_volunteers_not_drawn_get_no_reference(mlp_project: Project, volunteer_user: User) -> None:
    Project.objects.filter(pk=mlp_project.pk).update(spot_check_rate=0.0)
    Volunteer.objects.create(user=volunteer_user, consecutive_valid=mlp_project.trust_threshold)
    result = assign(volunteer_user)

    work_unit = WorkUnit.objects.get(pk=result.work_unit_id)
    assert not work_unit.spot_check and _reference(work_unit.pk) is None


def test_a_volunteer_that_lost_its_trust_after_the_work_was_sent_is_checked(
    mlp_project: Project, volunteer_user: User
) -> None:
    Project.objects.filter(pk=mlp_project.pk).update(spot_check_rate=0.0)
    Volunteer.objects.create(user=volunteer_user, consecutive_valid=mlp_project.trust_threshold)
    result = assign(volunteer_user)
    assert not WorkUnit.objects.get(pk=result.work_unit_id).spot_check
    Volunteer.objects.filter(user=volunteer_user).update(consecutive_valid=0)  # e.g. an invalid result since

    # A sign flip keeps the norm: only a spot check catches it.
    outcome = receive(volunteer_user, result, tampered(result.work_unit, "sign_flip"))
    assert outcome.status == "invalid" and "recomputation" in outcome.reason


def test_references_are_not_computed_for_decided_work(mlp_project: Project, volunteer_user: User) -> None:
    result = assign(volunteer_user)
    assert receive(volunteer_user, result).status == "valid"

    assert not validation.work_unit_compute_reference(work_unit_id=result.work_unit_id)
    assert _reference(result.work_unit_id) is None


def test_a_reference_for_a_work_unit_that_is_gone_is_skipped(mlp_project: Project) -> None:
    assert not validation.work_unit_compute_reference(work_unit_id=10**9)


def test_a_zero_update_matches_a_zero_reference_in_the_statistical_check() -> None:
    """A batch that scores nothing (every target ignore_index) gives both sides loss 0 and zero gradients
    (engine.ops.run_loss): a dropout model's honest volunteer must not fail for having no direction."""
    zero = {"w": torch.zeros(3, 2), "b": torch.zeros(2)}
    assert validation._statistical_problem(update=zero, reference=zero, against="the server") is None
    some = {"w": torch.ones(3, 2), "b": torch.zeros(2)}
    problem = validation._statistical_problem(update=some, reference=zero, against="the server")
    assert problem == "does not match the server (which is zero: nothing scored)"


# --- read, not decoded: hostile blobs are still refused (issue 15) ---------------------------------------


def _int8_blob(update: dict[str, torch.Tensor], **scales: float) -> bytes:
    """`update` as int8 blocks of 256, the first block scale of the tensors named replaced."""
    raw: dict[str, torch.Tensor] = {}
    for name, value in update.items():
        q, scale = codecs.quantize_int8(value, 256)
        if name in scales:
            q, scale = torch.full_like(q, 127), torch.full_like(scale, scales[name])
        raw[name], raw[name + ":scale"] = q, scale
    return bytes(st_save(raw, metadata={"codec": "int8", "block_size": "256"}))


@pytest.mark.parametrize(
    ("how", "reason"),
    [
        ("a scale so large the values overflow", "contains NaN or infinite values"),
        ("a NaN scale", "undecodable update: tensor 'fc1.weight': non-finite scales"),
        ("bytes after the tensors", "undecodable update: the tensors' data ends at byte"),
        ("an integer tensor", "is not a float tensor"),
    ],
)
def test_a_trusted_volunteers_hostile_blob_is_refused_without_being_decoded(
    mlp_project: Project, volunteer_user: User, how: str, reason: str
) -> None:
    """Not spot-checked, an update is only read (codecs.Packed), never decoded: its checks still hold."""
    Project.objects.filter(pk=mlp_project.pk).update(spot_check_rate=0.0)
    Volunteer.objects.create(user=volunteer_user, consecutive_valid=mlp_project.trust_threshold)
    result = assign(volunteer_user)
    update = recompute(work_unit=result.work_unit)
    if how == "a scale so large the values overflow":
        payload = _int8_blob(update, **{"fc1.weight": 3e38})
    elif how == "a NaN scale":
        payload = _int8_blob(update, **{"fc1.weight": math.nan})
    elif how == "bytes after the tensors":
        payload = _int8_blob(update) + b"\0\0\0\0"
    else:
        payload = codecs.encode(
            {**update, "fc1.bias": torch.zeros(update["fc1.bias"].shape, dtype=torch.int32)}, "int8"
        )
    outcome = receive(volunteer_user, result, payload)
    assert outcome.status == "invalid" and reason in outcome.reason, outcome.reason
    assert not judged(result).spot_checked


def test_the_norm_read_from_int8_values_is_the_decoded_updates(
    mlp_project: Project, volunteer_user: User
) -> None:
    result = assign(volunteer_user)
    payload = honest_update(result.work_unit)
    assert receive(volunteer_user, result, payload).status == "valid"
    decoded = codecs.decode(payload)[0]
    exact = math.sqrt(sum(float((value.double() ** 2).sum()) for value in decoded.values()))
    assert math.isclose(judged(result).update_norm or 0.0, exact, rel_tol=1e-6)


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_a_small_unit_after_a_large_one_passes_with_the_residual_it_carries(
    mlp_project: Project, volunteer_user: User, codec: str
) -> None:
    """Crowd rounds give a device a unit of a few samples after one of thousands: error feedback then carries
    a residual larger than the small update itself, and honest results failed their spot checks by 28-98%.
    The same device's earlier update bounds what may be carried; another device's allows nothing."""
    Project.objects.filter(pk=mlp_project.pk).update(codec=codec)
    device = Device.objects.create(volunteer=Volunteer.objects.create(user=volunteer_user), backend="webgl")
    earlier = assign(User.objects.create_user("earlier"))
    small = lifecycle.work_unit_assign(user=volunteer_user, device=device)
    assert small is not None
    delta = recompute(work_unit=small.work_unit)
    feedback = codecs.ErrorFeedback(codec)
    spread = 300 * _flat_norm(delta) / math.sqrt(sum(t.numel() for t in delta.values()))
    sent = codecs.decode(feedback.compress({k: torch.randn_like(v) * spread for k, v in delta.items()}))[0]
    honest = feedback.compress(delta)
    project = small.work_unit.project
    decoded = codecs.decode(honest)[0]
    assert validation._disagreement(project=project, update=decoded, reference=delta, against="x")
    Result.objects.filter(pk=earlier.pk).update(validation="valid", update_norm=_flat_norm(sent))
    assert validation._carried(result=small, project=project) == 0  # not this device's
    Result.objects.filter(pk=earlier.pk).update(device=device)
    assert receive(volunteer_user, small, honest).status == "valid"
    assert judged(small).spot_checked


def _topk_large_then_small(project: Project, user: User) -> tuple[codecs.ErrorFeedback, Result, bytes]:
    """A device's honest averaging unit of 800 samples (16 local steps), sent through topk with error
    feedback and valid, then, in the same round, one 16x smaller (a round's last samples): returned assigned,
    with the device's feedback (its residual carried from the large unit) and the large unit's bytes."""
    Project.objects.filter(pk=project.pk).update(
        codec="topk", mode="averaging", local_batch_size=50, batch_size=800, round_samples=1600
    )
    WorkUnit.objects.filter(project=project).delete()
    lifecycle.work_units_feed(project_id=project.pk)
    device = Device.objects.create(volunteer=Volunteer.objects.create(user=user), backend="webgl")
    feedback = codecs.ErrorFeedback("topk")
    first = _sized(user, device, 800)
    large = feedback.compress(recompute(work_unit=first.work_unit))
    assert receive(user, first, large).status == "valid"
    return feedback, _sized(user, device, 50), large


def _sized(user: User, device: Device, count: int) -> Result:
    """A work unit assigned to `device`, made `count` samples long."""
    result = lifecycle.work_unit_assign(user=user, device=device)
    assert result is not None
    WorkUnit.objects.filter(pk=result.work_unit_id).update(count=count, reference=None)
    result.work_unit.refresh_from_db()
    return result


def test_a_small_topk_unit_after_a_large_one_passes_with_the_residual_it_carries(
    mlp_project: Project, volunteer_user: User
) -> None:
    """Error feedback carries what topk left out of the large unit into the small one, and an honest small
    update is then mostly that residual: its cosine with the server's recomputation falls and its norm
    ratio rises far past TOPK_MAX_NORM_RATIO (here cosine 0.21, norm ratio 21). It was refused as an attack;
    the allowance from the device's previous valid update (its update_norm) lets it through."""
    feedback, small, _ = _topk_large_then_small(mlp_project, volunteer_user)
    delta = recompute(work_unit=small.work_unit)
    honest = feedback.compress(delta)
    project = small.work_unit.project
    decoded = codecs.decode(honest)[0]
    problem = validation._disagreement(project=project, update=decoded, reference=delta, against="x")
    assert problem and "norm ratio" in problem  # without the allowance
    outcome = receive(volunteer_user, small, honest)
    assert outcome.status == "valid", outcome.reason
    assert judged(small).spot_checked


@pytest.mark.parametrize("how", ["sign_flip", "scaled", "random", "scaled_x100", "replay", "replay_altered"])
def test_attacks_right_after_a_large_topk_unit_are_still_refused(
    mlp_project: Project, volunteer_user: User, how: str
) -> None:
    """The allowance for the residual must not open the check: after a large honest unit, an attacker's small
    update is refused whether it flips or scales (10x) what it would send, sends noise of that norm, scales
    the true update 100x (tampered), or replays its large update (the same bytes, or altered so they differ:
    refused by CARRIED_ALIGNMENT, component 8.9 against 6.3 allowed)."""
    feedback, small, large = _topk_large_then_small(mlp_project, volunteer_user)
    sent = codecs.decode(feedback.compress(recompute(work_unit=small.work_unit)))[0]
    if how in ("sign_flip", "scaled"):
        payload = _topk({k: (-1 if how == "sign_flip" else 10) * v for k, v in sent.items()})
    elif how == "random":
        torch.manual_seed(0)
        noise = {k: torch.randn_like(v) for k, v in sent.items()}
        payload = _topk({k: v * _flat_norm(sent) / _flat_norm(noise) for k, v in noise.items()})
    elif how == "scaled_x100":
        payload = tampered(small.work_unit, "scaled")
    elif how == "replay":
        payload = large
    else:
        payload = _topk({k: 1.001 * v for k, v in codecs.decode(large)[0].items()})
    outcome = receive(volunteer_user, small, payload)
    assert outcome.status == "invalid", outcome.reason
    assert ("replay" in outcome.reason) is (how == "replay")


def _topk(update: dict[str, torch.Tensor]) -> bytes:
    """topk as browsers send it (their blocks: codecs.ErrorFeedback's)."""
    return codecs.encode(update, "topk", codecs.default_block_size("topk"))


def _flat_norm(tensors: Any) -> float:
    return math.sqrt(sum(float((t.double() ** 2).sum()) for t in tensors.values()))


# --- batches: one task decides every result waiting in its project ------------------------------------


def _waiting(project: Project, count: int) -> list[Result]:
    """`count` results of as many volunteers, received while the validator was away (messages queued)."""
    Project.objects.filter(pk=project.pk).update(batch_size=10, round_samples=10 * count + 10)
    WorkUnit.objects.filter(project=project).delete()
    lifecycle.work_units_feed(project_id=project.pk)
    users = [User.objects.create_user(f"batch-{i}") for i in range(count)]
    results = [assign(user) for user in users]
    with mock.patch("projects.notify.result_received"):
        assert all(receive(user, r).status == "pending" for user, r in zip(users, results, strict=True))
    return results


def test_one_validation_decides_every_result_waiting_in_its_project_and_credits_each_once(
    mlp_project: Project,
) -> None:
    """Was one task, three transactions and one round_ready per result (issue 15): now the first task takes
    the project's waiting results along, and the others' tasks (or a retry) find them decided."""
    results = _waiting(mlp_project, 6)
    with mock.patch.object(training, "round_ready", wraps=training.round_ready) as ready:
        assert tasks.validate_result(results[3].pk) == 6
        assert ready.call_count == 1  # once a batch, not once a verdict
        assert [tasks.validate_result(r.pk) for r in results] == [0] * 6
    assert all(judged(r).is_valid for r in results)
    assert CreditEntry.objects.count() == 6
    assert list(
        Volunteer.objects.filter(user__username__startswith="batch-")
        .values_list("results_accepted", "consecutive_valid")
        .distinct()
    ) == [(1, 1)]


def test_a_batch_reads_its_projects_version_and_norm_history_once(mlp_project: Project) -> None:
    """Each result read the project's current version and its recent norms (three queries): a batch of 12
    read them 12 times. Now once, as they stood when the batch began; each result still gets its norm."""
    results = _waiting(mlp_project, 12)
    with CaptureQueriesContext(connection) as queries:
        assert tasks.validate_result(results[0].pk) == 12
    sql = [q["sql"] for q in queries.captured_queries]
    versions = [s for s in sql if s.startswith('SELECT "projects_modelversion"') and "ORDER BY" in s]
    assert len(versions) == 2, versions  # the batch's, and round_ready's once it committed
    assert sum("BETWEEN" in s and '"projects_result"' in s for s in sql) == 1  # _recent_norms' window
    assert all(judged(r).is_valid and judged(r).update_norm for r in results)


def test_a_result_whose_validation_raises_condemns_only_itself_in_a_batch(
    mlp_project: Project, monkeypatch: pytest.MonkeyPatch
) -> None:
    results = _waiting(mlp_project, 5)
    own_problem = validation._own_problem

    def crafted(result: Result) -> tuple[str | None, Any]:
        if result.pk == results[2].pk:
            raise RecursionError("a header nested 100,000 deep")
        return own_problem(result)

    monkeypatch.setattr(validation, "_own_problem", crafted)
    assert tasks.validate_result(results[0].pk) == 5
    verdicts = [judged(r) for r in results]
    assert [r.validation for r in verdicts] == ["valid", "valid", "invalid", "valid", "valid"]
    assert verdicts[2].reason == "could not be validated: RecursionError"
    assert CreditEntry.objects.count() == 4


def test_a_batch_mate_the_server_cannot_read_is_left_to_its_own_task(
    mlp_project: Project, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failure of the server's own (its blob unreadable) is retried, never a verdict: in a batch it must
    not hold back the others either."""
    results = _waiting(mlp_project, 4)
    own_problem = validation._own_problem

    def unreadable(result: Result) -> tuple[str | None, Any]:
        if result.pk == results[1].pk:
            raise OSError("blob file missing")
        return own_problem(result)

    monkeypatch.setattr(validation, "_own_problem", unreadable)
    assert tasks.validate_result(results[0].pk) == 3
    assert [judged(r).validation for r in results] == ["valid", "pending", "valid", "valid"]
    monkeypatch.undo()
    assert tasks.validate_result(results[1].pk) == 1 and judged(results[1]).is_valid
    assert CreditEntry.objects.count() == 4


def test_a_batch_mate_whose_invalidation_fails_is_left_pending_with_nothing_of_it_written(
    mlp_project: Project, monkeypatch: pytest.MonkeyPatch
) -> None:
    results = _waiting(mlp_project, 3)
    own_problem, invalidate = validation._own_problem, validation.result_invalidate

    def crafted(result: Result) -> tuple[str | None, Any]:
        if result.pk == results[1].pk:
            raise RecursionError("a header nested 100,000 deep")
        return own_problem(result)

    def half_way(*, result: Result, reason: str) -> None:
        Result.objects.filter(pk=result.pk).update(reason="half-written")
        raise OperationalError("the database went away")

    monkeypatch.setattr(validation, "_own_problem", crafted)
    monkeypatch.setattr(validation, "result_invalidate", half_way)
    assert tasks.validate_result(results[0].pk) == 2
    assert [(judged(r).validation, judged(r).reason) for r in results] == [
        ("valid", ""),
        ("pending", ""),
        ("valid", ""),
    ]
    monkeypatch.setattr(validation, "result_invalidate", invalidate)
    assert tasks.validate_result(results[1].pk) == 1 and judged(results[1]).validation == "invalid"


def test_each_result_of_a_batch_is_judged_in_one_savepoint_and_written_with_the_others(
    mlp_project: Project,
) -> None:
    results = _waiting(mlp_project, 6)
    with CaptureQueriesContext(connection) as queries:
        assert tasks.validate_result(results[0].pk) == 6
    sql = [q["sql"] for q in queries.captured_queries]
    assert sum(s.startswith("SAVEPOINT") for s in sql) == 6
    # The verdicts' rows: one statement for the results, one for their work units (not one a result each).
    assert sum(s.startswith('UPDATE "projects_result" AS t') for s in sql) == 1
    assert sum(s.startswith('UPDATE "projects_workunit"') for s in sql) == 1


def _one_volunteers_waiting(project: Project, user: User, count: int, trust: int) -> list[Result]:
    """`count` results of one volunteer whose run of valid results is `trust`, none drawn for a check."""
    Project.objects.filter(pk=project.pk).update(batch_size=10, round_samples=10 * count + 10)
    WorkUnit.objects.filter(project=project).delete()
    lifecycle.work_units_feed(project_id=project.pk)
    results = [assign(user) for _ in range(count)]
    WorkUnit.objects.filter(project=project).update(spot_check=False)
    Volunteer.objects.filter(user=user).update(consecutive_valid=trust)
    with mock.patch("projects.notify.result_received"):
        assert all(receive(user, r).status == "pending" for r in results)
    return results


def test_a_batch_reads_trust_from_the_rows_it_locked_and_keeps_it_in_step(
    mlp_project: Project, volunteer_user: User
) -> None:
    """Each result read its volunteer's row again for trust: now the batch's locked rows, counted on by each
    valid verdict. One short of trusted, the first result is checked and the next ones are not."""
    threshold = mlp_project.trust_threshold
    results = _one_volunteers_waiting(mlp_project, volunteer_user, 3, trust=threshold - 1)
    with CaptureQueriesContext(connection) as queries:
        assert tasks.validate_result(results[0].pk) == 3
    sql = [q["sql"] for q in queries.captured_queries if q["sql"].startswith('SELECT "workers_volunteer"')]
    assert not [s for s in sql if '"workers_volunteer"."user_id" = ' in s]  # the batch's reads: IN (...)
    assert [(judged(r).validation, judged(r).spot_checked) for r in results] == [
        ("valid", True),
        ("valid", False),
        ("valid", False),
    ]
    assert Volunteer.objects.get(user=volunteer_user).consecutive_valid == threshold + 2


def test_an_invalid_verdict_in_a_batch_takes_trust_away_from_the_next_result(
    mlp_project: Project, volunteer_user: User, monkeypatch: pytest.MonkeyPatch
) -> None:
    results = _one_volunteers_waiting(mlp_project, volunteer_user, 3, trust=mlp_project.trust_threshold + 5)
    own_problem = validation._own_problem

    def crafted(result: Result) -> tuple[str | None, Any]:
        return ("crafted", None) if result.pk == results[1].pk else own_problem(result)

    monkeypatch.setattr(validation, "_own_problem", crafted)
    assert tasks.validate_result(results[0].pk) == 3
    assert [(judged(r).validation, judged(r).spot_checked) for r in results] == [
        ("valid", False),
        ("invalid", False),
        ("valid", True),
    ]


def test_error_feedbacks_allowance_counts_a_valid_verdict_earlier_in_the_same_batch(
    mlp_project: Project, volunteer_user: User, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch writes its valid verdicts at its end: the allowance for what error feedback carried into a
    device's second result still comes from its first, found valid earlier in the same batch."""
    Project.objects.filter(pk=mlp_project.pk).update(batch_size=10, round_samples=40)
    WorkUnit.objects.filter(project=mlp_project).delete()
    lifecycle.work_units_feed(project_id=mlp_project.pk)
    device = device_register(user=volunteer_user, client_id="b", backend="wasm", gflops=5.0, user_agent="")
    first = lifecycle.work_unit_assign(user=volunteer_user, device=device)
    second = lifecycle.work_unit_assign(user=volunteer_user, device=device)
    assert first is not None and second is not None
    with mock.patch("projects.notify.result_received"):
        receive(volunteer_user, first)
        receive(volunteer_user, second)
    allowed: dict[int, float] = {}
    carried = validation._carried

    def recorded(*, result: Result, project: Project) -> float:
        allowed[result.pk] = carried(result=result, project=project)
        return allowed[result.pk]

    monkeypatch.setattr(validation, "_carried", recorded)
    assert tasks.validate_result(first.pk) == 2  # not trusted yet: both spot-checked
    assert judged(first).is_valid and judged(second).is_valid
    norm = judged(first).update_norm
    assert norm and allowed[second.pk] == pytest.approx(validation.CARRIED["int8"] * norm)


def test_a_batch_skips_results_another_validation_holds(mlp_project: Project) -> None:
    """Two validators (or the step cancelling a round) never wait on each other's rows: a batch takes only
    what is free, and what it skipped is decided by its own task, credited once."""
    results = _waiting(mlp_project, 4)
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        try:
            with transaction.atomic():
                WorkUnit.objects.select_for_update().get(pk=results[2].work_unit_id)
                held.set()
                release.wait(30)
        finally:
            connection.close()

    thread = threading.Thread(target=hold)
    thread.start()
    try:
        assert held.wait(10)
        assert tasks.validate_result(results[0].pk) == 3
    finally:
        release.set()
        thread.join(10)
    assert judged(results[2]).validation == "pending"
    assert tasks.validate_result(results[2].pk) == 1
    assert all(judged(r).is_valid for r in results) and CreditEntry.objects.count() == 4
