"""projects/stages.py: pipeline partitions, feeding, unit FLOPs and seeds, the backward payload's framing."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from django.contrib.auth.models import User

from engine.pipeline import StageUnitError
from projects import lifecycle, stages
from projects.models import Project, WorkUnit
from projects.services import ProjectError, project_create, project_pause, project_start, project_update

pytestmark = pytest.mark.django_db


def pipeline(researcher: User, dataset: Any, **settings: Any) -> Project:
    chosen = {"mode": "pipeline", "pipeline_stages": 3, "micro_batches": 2, "batch_size": 10, **settings}
    project = project_create(owner=researcher, name="Pipe", dataset=dataset, preset="mlp", settings=chosen)
    return project_start(project=project)


def test_a_step_is_fed_once_with_one_first_unit_per_micro_batch(
    researcher: User, digits_dataset: Any
) -> None:
    project = pipeline(researcher, digits_dataset)
    lifecycle.work_units_feed(project_id=project.pk)
    assert lifecycle.work_units_feed(project_id=project.pk) == 0
    units = WorkUnit.objects.filter(project=project).order_by("micro_batch")
    assert [(u.stage_kind, u.stage, u.micro_batch, u.offset) for u in units] == [
        ("forward", 0, 0, 0),
        ("forward", 0, 1, 10),
    ]
    assert sum(u.loss_scale or 0 for u in units) == pytest.approx(1.0)
    assert all(u.stage_graph_id and u.stage_weights_id and u.input_blob_id is None for u in units)


def test_unit_flops_count_the_stage_not_the_model(researcher: User, digits_dataset: Any) -> None:
    project = pipeline(researcher, digits_dataset)
    lifecycle.work_units_feed(project_id=project.pk)
    unit = WorkUnit.objects.filter(project=project).first()
    assert unit is not None
    first = stages.project_partition(project=project).stages[0]
    assert stages.unit_flops(work_unit=unit) == first.forward_flops * unit.count
    unit.stage_kind = "backward"
    assert stages.unit_flops(work_unit=unit) == (first.forward_flops + first.backward_flops) * unit.count
    unit.stage_kind = ""
    assert stages.unit_flops(work_unit=unit) == project.flops_per_sample * unit.count


def test_forward_and_backward_of_a_stage_share_a_seed(researcher: User, digits_dataset: Any) -> None:
    project = pipeline(researcher, digits_dataset)
    lifecycle.work_units_feed(project_id=project.pk)
    first, second = WorkUnit.objects.filter(project=project).order_by("micro_batch")
    seed = stages.unit_seed(work_unit=first)
    first.stage_kind = "backward"
    assert stages.unit_seed(work_unit=first) == seed != stages.unit_seed(work_unit=second)


@pytest.mark.parametrize(("stage_count", "backward"), [(2, 1), (3, 3)])
def test_the_backward_chain_ends_where_nothing_before_trains(
    researcher: User, digits_dataset: Any, stage_count: int, backward: int
) -> None:
    # The MLP's two-stage cut is after `flatten`: stage 0 has no params, so it needs no backward unit.
    project = pipeline(researcher, digits_dataset, pipeline_stages=stage_count)
    assert stages.backward_units(project=project) == backward


def test_a_data_parallel_project_cannot_be_switched_to_a_budget_it_exceeds(
    researcher: User, digits_dataset: Any
) -> None:
    project = project_pause(project=pipeline(researcher, digits_dataset, batch_size=25))
    with pytest.raises(ProjectError, match="Choose the pipeline mode"):
        project_update(project=project, changes={"mode": "sync_sgd", "device_memory_mb": 1})
    project_update(project=project, changes={"mode": "pipeline", "device_memory_mb": 1, "pipeline_stages": 0})


def test_pipeline_mode_refuses_more_stages_than_cut_points(researcher: User, digits_dataset: Any) -> None:
    with pytest.raises(ProjectError, match="cannot cut"):
        pipeline(researcher, digits_dataset, pipeline_stages=9)


@pytest.mark.parametrize("payload", [b"", b"\x01\x02", stages.LENGTH.pack(9) + b"short"])
def test_a_backward_payload_whose_length_runs_past_its_end_is_refused(payload: bytes) -> None:
    with pytest.raises(StageUnitError):
        stages.payload_split(payload)


def test_a_backward_payload_splits_into_its_two_parts() -> None:
    assert stages.payload_split(stages.backward_payload(input_grad=b"ab", grads=b"cde")) == (b"ab", b"cde")


def test_a_stage_unit_is_sent_again_however_often_it_fails(researcher: User, digits_dataset: Any) -> None:
    # A data-parallel slice is given up after 3 failed instances; a step cannot complete without each unit.
    project = pipeline(researcher, digits_dataset)
    lifecycle.work_units_feed(project_id=project.pk)
    unit = WorkUnit.objects.filter(project=project).first()
    assert unit is not None
    for _ in range(5):
        lifecycle.work_unit_fail(work_unit=unit)
    unit.refresh_from_db()
    assert unit.is_open and unit.wanted == 6


# --- the partition follows the micro-batch count -----------------------------------------------------


def hourglass() -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Five layers of about equal FLOPs: in 3 stages the cut with the shortest GPipe step moves with M
    (M = 4: 2 layers, 1, 2; M = 8: 1, 1, 3; the last stage recomputes no forward, so it can take more)."""
    from engine.export import export_module

    torch.manual_seed(0)
    layers: list[torch.nn.Module] = [torch.nn.Flatten()]
    for a, b in ((784, 100), (100, 784), (784, 100), (100, 784)):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    net = torch.nn.Sequential(*layers, torch.nn.Linear(784, 10))
    return export_module(net, (1, 28, 28), loss=torch.nn.CrossEntropyLoss())


def test_the_partition_is_the_fastest_step_for_the_projects_micro_batches(
    researcher: User, digits_dataset: Any
) -> None:
    """The server cuts where a step of the project's `micro_batches` is shortest, as every recomputation of
    its partition (credit checks, the volunteers' tests) does; a new M after a pause gives a new cut."""
    from engine.partition import MemoryModel, partition
    from projects.services import project_create_from_graph, project_graph

    graph, weights = hourglass()
    settings = {"mode": "pipeline", "pipeline_stages": 3, "micro_batches": 4, "batch_size": 10}
    project = project_create_from_graph(
        owner=researcher,
        name="Hourglass",
        dataset=digits_dataset,
        graph_dict=graph,
        weights=weights,
        settings=settings,
    )
    project = project_start(project=project)
    memory = MemoryModel(micro_batch=10, optimizer_slots=0)
    cuts: dict[int, list[range]] = {}
    for m in (4, 8):
        if m != project.micro_batches:
            project_update(project=project_pause(project=project), changes={"micro_batches": m})
            project = project_start(project=Project.objects.get(pk=project.pk))
        server = stages.project_partition(project=project)
        expected = partition(project_graph(project=project), 3, memory, micro_batches=m)
        cuts[m] = [stage.nodes for stage in server.stages]
        assert cuts[m] == [stage.nodes for stage in expected.stages] and server.cuts == expected.cuts
    assert cuts[4] != cuts[8], cuts
    # Cut for the wrong M, a step would take longer: the server must not reuse the cut cached for M = 4.
    whole = project_graph(project=project)
    by_m = {m: partition(whole, 3, memory, micro_batches=m) for m in (4, 8)}
    assert by_m[8].makespan(8) < by_m[4].makespan(8)


# --- changing the partition ---------------------------------------------------------------------------


def test_a_running_pipeline_project_refuses_partition_changes_but_not_others(
    researcher: User, digits_dataset: Any
) -> None:
    project = pipeline(researcher, digits_dataset)
    for changes in ({"pipeline_stages": 2}, {"micro_batches": 3}, {"batch_size": 5}, {"mode": "sync_sgd"}):
        with pytest.raises(ProjectError, match="cannot change while the project runs.*Pause the project"):
            project_update(project=project, changes=changes)
    project_update(project=project, changes={"learning_rate": 0.01, "pipeline_stages": 3})  # unchanged: fine
    project.refresh_from_db()
    assert (project.pipeline_stages, project.learning_rate) == (3, 0.01)
    paused = project_pause(project=project)
    project_update(project=paused, changes={"pipeline_stages": 2})
    assert Project.objects.get(pk=project.pk).pipeline_stages == 2


@pytest.mark.django_db(transaction=True)
def test_a_step_a_pause_interrupted_starts_over_under_the_new_stage_count(
    researcher: User, digits_dataset: Any
) -> None:
    """Units computed before the pause were cut in 3 stages; the step runs again in 2 and trains exactly as
    torch.optim.SGD on the unsplit model does on the restarted step's batch."""
    from projects.models import ModelVersion
    from projects.services import version_weights
    from tests.integration.test_pipeline_mode import BATCH, MICRO, offer, pipeline_project, send, users

    project = pipeline_project(researcher, digits_dataset)
    (ann,) = users("ann")
    for _ in range(3):  # the step's first units, before the pause
        result = offer(ann)
        assert result is not None and send(ann, result).status == "valid"
    start = int(Project.objects.get(pk=project.pk).data_cursor)  # the restarted step's first sample
    project = project_pause(project=project)
    project_update(project=project, changes={"pipeline_stages": 2})
    project_start(project=project)
    while project.current_version().number < 1:
        result = offer(ann)
        assert result is not None and send(ann, result).status == "valid"
    old = WorkUnit.objects.filter(version__number=0, status=WorkUnit.Status.CANCELLED)
    assert old.count() >= 3 and old.filter(results__validation="valid").count() == 3
    step = WorkUnit.objects.filter(version__number=0, status=WorkUnit.Status.VALIDATED)
    assert {unit.stage for unit in step} == {0, 1} and step.count() == 2 * MICRO
    published = version_weights(version=ModelVersion.objects.get(project=project, number=1))
    expected = torch_sgd_step(project, start, start + BATCH * MICRO)
    for name, value in expected.items():
        torch.testing.assert_close(published[name], value, rtol=1e-5, atol=1e-5)


def torch_sgd_step(project: Project, start: int, end: int) -> dict[str, torch.Tensor]:
    """One torch.optim.SGD step (lr 0.1, momentum 0.9) of version 0 on training samples [start, end)."""
    from engine.runtime import compute_gradients
    from projects.datasets import shard_load
    from projects.models import DatasetShard
    from projects.services import project_graph, version_weights

    graph = project_graph(project=project)
    weights = version_weights(version=project.versions.get(number=0))
    params = {p.name: torch.nn.Parameter(weights[p.name].clone()) for p in graph.params}
    x, y = shard_load(shard=project.dataset.shards.get(split=DatasetShard.Split.TRAIN, index=0))
    grads = compute_gradients(
        graph,
        weights,
        {graph.inputs[0].name: torch.from_numpy(x[start:end].copy())},
        {graph.targets[0].name: torch.from_numpy(y[start:end].copy())},
    ).grads
    optimizer = torch.optim.SGD(params.values(), lr=0.1, momentum=0.9)
    for name, param in params.items():
        param.grad = grads[name].clone()
    optimizer.step()
    return {name: param.detach() for name, param in params.items()}
