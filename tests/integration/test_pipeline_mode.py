"""Pipeline mode through the real lifecycle: stage units offered, computed by the simulated volunteer's stage
code (workers/simulator.honest_stage_result, from the assign message the server builds), received, judged,
credited, and steps published; Celery runs eagerly, so every verdict and step happens in place."""

from __future__ import annotations

import math
from collections.abc import Callable
from datetime import timedelta
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
import torch
from django.contrib.auth.models import User
from django.db.models import Sum
from django.utils import timezone

from engine import codecs
from engine.graph import load_graph
from engine.runtime import compute_gradients
from projects import lifecycle, stages
from projects.datasets import shard_load
from projects.lifecycle import ResultError
from projects.models import Blob, DatasetShard, ModelVersion, Project, Result, WorkUnit
from projects.services import ProjectError, project_create, project_graph, project_start, version_weights
from workers import protocol, simulator
from workers.models import CreditEntry

pytestmark = pytest.mark.django_db(transaction=True)
Answered = tuple[bytes, float | None]  # the payload and the loss (None: the unit computes none)
Answer = Callable[[Result], Answered]
BATCH, MICRO = 20, 3


def pipeline_project(researcher: User, dataset: Any, **settings: Any) -> Project:
    chosen = {
        "mode": "pipeline",
        "pipeline_stages": 3,
        "micro_batches": MICRO,
        "batch_size": BATCH,
        "activation_codec": "fp32",
        "learning_rate": 0.1,
        "momentum": 0.9,
        **settings,
    }
    project = project_create(owner=researcher, name="Pipe", dataset=dataset, preset="mlp", settings=chosen)
    return project_start(project=project)


def users(*names: str) -> list[User]:
    return [User.objects.create_user(name, password=f"{name}-pass-123") for name in names]


def _sha(url: str) -> str:
    return url.split("?")[0].rsplit("/", 1)[1]


def _blob(url: str | None) -> bytes | None:
    return Blob.objects.get(pk=_sha(url)).read() if url else None


def honest(result: Result) -> Answered:
    """What the simulated volunteer sends, from the assign message alone."""
    message = protocol.assign_message(result)["work_unit"]
    unit = simulator.Unit.parse(message)
    graph = load_graph(_blob(message["graph_url"]) or b"")
    weights = codecs.decode(_blob(message["weights_url"]) or b"")[0]
    shard = message["shards"][0]
    x, y = shard_load(shard=result.work_unit.shard)
    window = slice(int(shard["offset"]), int(shard["offset"]) + int(shard["count"]))
    inputs = simulator.StageInputs(
        torch.from_numpy(x[window].copy()),
        torch.from_numpy(y[window].copy()),
        _blob(message["input_url"]),
        _blob(message["output_grad_url"]),
    )
    return simulator.honest_stage_result(graph, weights, unit, inputs)


def send(user: User, result: Result, answer: Answer = honest) -> lifecycle.ResultOutcome:
    payload, loss = answer(result)
    return lifecycle.result_receive(
        user=user,
        work_unit_id=result.work_unit_id,
        samples=result.work_unit.count,
        loss=loss,
        compute_ms=1,
        payload=payload,
    )


def offer(user: User) -> Result | None:
    return lifecycle.work_unit_offer(user=user).result


def run_steps(project: Project, volunteers: list[User], steps: int) -> None:
    for _ in range(40 * steps * MICRO):
        if project.current_version().number >= steps:
            return
        for user in volunteers:
            result = offer(user)
            if result is not None:
                assert send(user, result).status == "valid", Result.objects.get(pk=result.pk).reason
    raise AssertionError("the steps did not complete")


def torch_steps(project: Project, steps: int) -> dict[str, torch.Tensor]:
    """The same steps on the unsplit model: the whole batch's gradient, torch.optim.SGD."""
    graph = project_graph(project=project)
    weights = {k: v.clone() for k, v in version_weights(version=project.versions.get(number=0)).items()}
    params = {p.name: torch.nn.Parameter(weights[p.name]) for p in graph.params}
    optimizer = torch.optim.SGD(params.values(), lr=0.1, momentum=0.9)
    x, y = shard_load(shard=project.dataset.shards.get(split=DatasetShard.Split.TRAIN, index=0))
    size = BATCH * MICRO
    for step in range(steps):
        window = slice(step * size, (step + 1) * size)
        current = {**weights, **{k: v.detach() for k, v in params.items()}}
        grads = compute_gradients(
            graph,
            current,
            {graph.inputs[0].name: torch.from_numpy(x[window].copy())},
            {graph.targets[0].name: torch.from_numpy(y[window].copy())},
        ).grads
        for name, param in params.items():
            param.grad = grads[name].clone()
        optimizer.step()
    return {k: v.detach() for k, v in params.items()}


def expected_credit(project: Project) -> int:
    """The ledger's total from the partition's FLOPs, unit by validated unit."""
    parts = stages.project_partition(project=project).stages
    total = 0
    for unit in WorkUnit.objects.filter(project=project, status=WorkUnit.Status.VALIDATED):
        stage = parts[unit.stage or 0]
        per = (
            stage.forward_flops
            if unit.stage_kind == "forward"
            else stage.forward_flops + stage.backward_flops
        )
        total += per * unit.count
    return total


def test_three_stages_train_like_torch_sgd_and_credit_sums_exactly(
    researcher: User, digits_dataset: Any
) -> None:
    project = pipeline_project(researcher, digits_dataset)
    run_steps(project, users("ann", "ben"), steps=3)
    published = version_weights(version=ModelVersion.objects.get(project=project, number=3))
    for name, value in torch_steps(project, 3).items():
        torch.testing.assert_close(published[name], value, rtol=1e-5, atol=1e-5)
    units = WorkUnit.objects.filter(project=project, version__number__lt=3, status=WorkUnit.Status.VALIDATED)
    assert units.count() == 3 * MICRO * (2 * 3 - 1)  # forward on stages 0-1, backward on 0-2
    ledger = CreditEntry.objects.filter(project=project).aggregate(total=Sum("flops"))["total"]
    assert ledger == expected_credit(project) > 0
    # Only the last stage's units compute a loss: the others report none, and none is stored for them.
    results = Result.objects.filter(work_unit__project=project, validation=Result.Validation.VALID)
    losses = list(results.filter(work_unit__stage=2).values_list("loss", flat=True))
    assert losses and all(loss is not None and math.isfinite(loss) for loss in losses)
    assert not results.exclude(work_unit__stage=2).exclude(loss=None).exists()


def test_the_data_parallel_modes_refuse_a_model_over_the_device_budget_and_pipeline_cuts_it(
    researcher: User, digits_dataset: Any
) -> None:
    tight = {"device_memory_mb": 1, "batch_size": 25}
    with pytest.raises(ProjectError, match="pipeline mode"):
        project_create(owner=researcher, name="Too big", dataset=digits_dataset, preset="mlp", settings=tight)
    project = pipeline_project(researcher, digits_dataset, pipeline_stages=0, **tight)
    assert len(stages.project_partition(project=project).stages) == 2


def nan_activation(result: Result) -> Answered:
    payload, loss = honest(result)
    tensor = codecs.decode(payload)[0]["activation"].clone()
    tensor[0, 0] = math.nan
    return codecs.encode({"activation": tensor}, "fp32"), loss


def wrong_shape(result: Result) -> Answered:
    return codecs.encode({"activation": torch.zeros(3, 7)}, "fp32"), 0.0


def garbage(result: Result) -> Answered:
    return b"\xff" * 64, 0.0


def scaled_activation(result: Result) -> Answered:
    """Well-formed but not what the stage computes: only the server's recomputation can tell."""
    payload, loss = honest(result)
    return codecs.encode({"activation": 2 * codecs.decode(payload)[0]["activation"]}, "fp32"), loss


@pytest.mark.parametrize("answer", [nan_activation, wrong_shape, garbage, scaled_activation])
def test_a_hostile_stage_result_is_invalid_and_its_unit_reissued(
    researcher: User, digits_dataset: Any, answer: Answer
) -> None:
    pipeline_project(researcher, digits_dataset, pipeline_stages=2)
    mallory, ann = users("mallory", "ann")
    result = offer(mallory)
    assert result is not None
    outcome = send(mallory, result, answer)
    assert outcome.status == "invalid", outcome
    unit = WorkUnit.objects.get(pk=result.work_unit_id)
    assert unit.is_open and unit.wanted == 1 and unit.error_results == 1
    reissued = offer(ann)  # the oldest open unit: the one refused
    assert reissued is not None and reissued.work_unit_id == unit.pk
    assert send(ann, reissued).status == "valid"
    assert not CreditEntry.objects.filter(volunteer__user=mallory).exists()


def test_a_loss_claimed_for_a_unit_without_one_is_not_stored(researcher: User, digits_dataset: Any) -> None:
    """Pages before null losses sent 0 for stage units without one: still valid, and no loss stored."""
    pipeline_project(researcher, digits_dataset, pipeline_stages=2)
    (ann,) = users("ann")
    result = offer(ann)
    assert result is not None and result.work_unit.stage_kind == "forward"
    assert send(ann, result, lambda unit: (honest(unit)[0], 0.0)).status == "valid"
    assert Result.objects.get(pk=result.pk).loss is None


def test_results_for_an_unknown_unit_or_another_volunteers_unit_are_refused(
    researcher: User, digits_dataset: Any
) -> None:
    pipeline_project(researcher, digits_dataset, pipeline_stages=2)
    ann, ben = users("ann", "ben")
    result = offer(ann)
    assert result is not None
    payload, _ = honest(result)
    with pytest.raises(ResultError) as unknown:
        lifecycle.result_receive(user=ann, work_unit_id=10**9, samples=1, loss=0, compute_ms=1, payload=b"")
    assert unknown.value.code == "unknown_work_unit"
    with pytest.raises(ResultError) as other:
        lifecycle.result_receive(
            user=ben, work_unit_id=result.work_unit_id, samples=BATCH, loss=0, compute_ms=1, payload=payload
        )
    assert other.value.code == "not_assigned"
    assert Result.objects.get(pk=result.pk).status == Result.Status.IN_PROGRESS


def test_a_volunteer_vanishing_mid_unit_costs_only_that_unit(researcher: User, digits_dataset: Any) -> None:
    project = pipeline_project(researcher, digits_dataset, pipeline_stages=2, micro_batches=2)
    gone, ann, ben = users("gone", "ann", "ben")
    held = offer(gone)
    assert held is not None
    Result.objects.filter(pk=held.pk).update(deadline=timezone.now() - timedelta(seconds=1))
    lifecycle.results_expire()
    run_steps(project, [ann, ben], steps=1)
    assert Result.objects.get(pk=held.pk).status == Result.Status.TIMED_OUT
    assert WorkUnit.objects.get(pk=held.work_unit_id).status == WorkUnit.Status.VALIDATED
    others = Result.objects.filter(work_unit__project=project).exclude(pk=held.pk)
    assert others.exists() and not others.exclude(validation=Result.Validation.VALID).exists()


def forward_then(project: Project, volunteers: list[User]) -> Result:
    """Work the step until a backward unit is offered to the last volunteer; returns it."""
    *helpers, last = volunteers
    for _ in range(40):
        result = offer(last)
        if result is not None and result.work_unit.stage_kind == "backward":
            return result
        if result is not None:
            assert send(last, result).status == "valid"
        for user in helpers:
            other = offer(user)
            if other is not None:
                assert send(user, other).status == "valid"
    raise AssertionError("no backward unit came")


def wrong_grads(result: Result) -> Answered:
    payload, loss = honest(result)
    grad, _ = stages.payload_split(payload)
    return stages.backward_payload(
        input_grad=grad, grads=codecs.encode({"fc2.weight": torch.zeros(2)}, "fp32")
    ), loss


def flipped_grads(result: Result) -> Answered:
    payload, loss = honest(result)
    grad, grads = stages.payload_split(payload)
    flipped = {k: -v for k, v in codecs.decode(grads)[0].items()}
    return stages.backward_payload(input_grad=grad, grads=codecs.encode(flipped, "fp32")), loss


def overlong_prefix(result: Result) -> Answered:
    return stages.LENGTH.pack(2**60) + b"x", 0.0


def no_loss(result: Result) -> Answered:
    """The last stage's unit computes the loss: one without it is no answer."""
    return honest(result)[0], None


@pytest.mark.parametrize("answer", [wrong_grads, flipped_grads, overlong_prefix, no_loss])
def test_a_hostile_backward_result_is_invalid(researcher: User, digits_dataset: Any, answer: Answer) -> None:
    project = pipeline_project(researcher, digits_dataset, micro_batches=1)
    ann, mallory = users("ann", "mallory")
    result = forward_then(project, [ann, mallory])
    outcome = send(mallory, result, answer)
    assert outcome.status == "invalid", outcome
    assert WorkUnit.objects.get(pk=result.work_unit_id).wanted == 1


def test_stage_blobs_are_granted_to_the_holder_of_the_unit_only(
    researcher: User, digits_dataset: Any
) -> None:
    from projects.blobs import Access, blob_access

    pipeline_project(researcher, digits_dataset)
    (ann,) = users("ann")
    result = offer(ann)
    assert result is not None
    url = protocol.assign_message(result)["work_unit"]["weights_url"]
    sha, grant = _sha(url), parse_qs(urlsplit(url).query)["grant"][0]
    assert blob_access(sha256=sha, grant=grant)[1] == Access.GRANTED
    assert blob_access(sha256=sha, grant=grant[:-2] + "xx")[1] == Access.REFUSED
    assert send(ann, result).status == "valid"
    assert blob_access(sha256=sha, grant=grant)[1] == Access.REFUSED  # no longer held


# --- batch norm: running statistics aggregated into the next version ----------------------------------------


class TwoNorms(torch.nn.Module):
    """Cut in 3 stages: bn1 in stage 1 (not last), bn2 in the last stage."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.bn1 = torch.nn.Linear(784, 32), torch.nn.BatchNorm1d(32)
        self.fc2, self.bn2, self.fc3 = (
            torch.nn.Linear(32, 16),
            torch.nn.BatchNorm1d(16),
            torch.nn.Linear(16, 10),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn1(self.fc1(x.flatten(1))))
        return self.fc3(torch.relu(self.bn2(self.fc2(x))))


class FrozenNormFirst(torch.nn.Module):
    """Cut in 3 stages: the frozen batch norm is stage 1 alone, which trains nothing and has no backward
    unit (nothing before it trains): its statistics come from the server's recomputation of its forward."""

    def __init__(self) -> None:
        super().__init__()
        self.bn, self.fc1, self.fc2 = (
            torch.nn.BatchNorm1d(784),
            torch.nn.Linear(784, 16),
            torch.nn.Linear(16, 10),
        )
        self.bn.weight.requires_grad_(False)
        self.bn.bias.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(self.bn(x.flatten(1)))))


def normed_project(researcher: User, dataset: Any, net: torch.nn.Module) -> Project:
    from engine.export import export_module
    from projects.services import project_create_from_graph

    graph, weights = export_module(net, (1, 28, 28), loss=torch.nn.CrossEntropyLoss())
    settings = {"mode": "pipeline", "pipeline_stages": 3, "micro_batches": 1, "batch_size": BATCH}
    settings |= {"activation_codec": "fp32", "learning_rate": 0.1, "momentum": 0.9}
    project = project_create_from_graph(
        owner=researcher, name="Normed", dataset=dataset, graph_dict=graph, weights=weights, settings=settings
    )
    return project_start(project=project)


@pytest.mark.parametrize("model", [TwoNorms, FrozenNormFirst])
def test_batch_norm_statistics_train_like_torch_on_the_unsplit_model(
    researcher: User, digits_dataset: Any, model: type[torch.nn.Module]
) -> None:
    """One micro-batch per step, so each step normalises the whole batch as torch does: after 2 steps every
    parameter and every running statistic equals the torch module's, trained in train mode by
    torch.optim.SGD."""
    torch.manual_seed(0)
    net = model()
    project = normed_project(researcher, digits_dataset, net)
    assert stages.project_partition(project=project).stages[1].graph.trained_buffers()
    (ann,) = users("ann")
    while project.current_version().number < 2:
        result = offer(ann)
        assert result is not None
        assert send(ann, result).status == "valid", Result.objects.get(pk=result.pk).reason
    optimizer = torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    x, y = shard_load(shard=project.dataset.shards.get(split=DatasetShard.Split.TRAIN, index=0))
    net.train()
    for step in range(2):
        window = slice(step * BATCH, (step + 1) * BATCH)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(
            net(torch.from_numpy(x[window].copy())), torch.from_numpy(y[window].copy()).long()
        ).backward()
        optimizer.step()
    published = version_weights(version=ModelVersion.objects.get(project=project, number=2))
    expected = {k: v for k, v in net.state_dict().items() if not k.endswith("num_batches_tracked")}
    assert any("running_var" in name for name in expected)
    for name, value in expected.items():
        torch.testing.assert_close(published[name], value, rtol=1e-5, atol=1e-5, msg=name)


def rewritten(result: Result, change: Callable[[dict[str, Any]], dict[str, Any]]) -> Answered:
    """The honest backward frame with its gradients and statistics passed through `change`."""
    payload, loss = honest(result)
    grad, tensors = stages.payload_split(payload)
    changed = change(codecs.decode(tensors)[0])
    return stages.backward_payload(input_grad=grad, grads=codecs.encode(changed, "fp32")), loss


def without_buffers(result: Result) -> Answered:
    return rewritten(result, lambda tensors: {k: v for k, v in tensors.items() if "running" not in k})


def test_a_backward_result_without_its_stages_statistics_is_invalid(
    researcher: User, digits_dataset: Any
) -> None:
    project = normed_project(researcher, digits_dataset, TwoNorms())
    ann, mallory = users("ann", "mallory")
    result = forward_then(project, [ann, mallory])
    outcome = send(mallory, result, without_buffers)
    assert outcome.status == "invalid" and "trained buffers" in outcome.reason, outcome


def stale_buffers(result: Result) -> Answered:
    """The statistics the unit was sent, as a volunteer that dropped its forward's updates would report."""
    sent = result.work_unit.stage_weights
    assert sent is not None
    before = codecs.decode(sent.read())[0]
    return rewritten(
        result, lambda tensors: {k: before[k] if "running" in k else v for k, v in tensors.items()}
    )


def test_a_backward_result_with_stale_statistics_fails_its_spot_check(
    researcher: User, digits_dataset: Any
) -> None:
    """Right names and shapes, its parameter gradients honest: the spot check compares the statistics too."""
    project = normed_project(researcher, digits_dataset, TwoNorms())
    ann, mallory = users("ann", "mallory")
    result = forward_then(project, [ann, mallory])
    assert stages.unit_stage(work_unit=result.work_unit).graph.trained_buffers()
    outcome = send(mallory, result, stale_buffers)
    assert outcome.status == "invalid" and "trained buffers differ" in outcome.reason, outcome
