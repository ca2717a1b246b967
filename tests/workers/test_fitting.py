"""Work units that fit a device (workers/fitting.py): their download against the day's allowance and the
largest work unit, their memory against that and the browser's memory, and the per-device daily count."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from django.contrib.auth.models import User
from django.db import transaction

from engine import codecs
from engine.graph import activation_memory, load_graph
from projects.lifecycle import work_units_feed
from projects.models import Project, WorkUnit
from workers import fitting
from workers.fitting import Fit, Limits, fit, model_memory, work_unit_blobs
from workers.models import MAX_REMEMBERED_BLOBS, DeviceDownload
from workers.preferences import DEFAULTS, MB
from workers.services import device_register

pytestmark = pytest.mark.django_db


@pytest.fixture
def work_unit(mlp_project: Project) -> WorkUnit:
    work_units_feed(project_id=mlp_project.pk)  # start() feeds on commit, which this test never reaches
    related = ("project__graph", "version__weights", "version__wire_weights", "shard__blob")
    return WorkUnit.objects.select_related(*related).filter(project=mlp_project).order_by("pk").first()  # type: ignore[return-value]


def download_of(work_unit: WorkUnit) -> int:
    return sum(work_unit_blobs(work_unit).values())


def test_a_work_units_download_is_its_graph_weights_and_whole_shard(work_unit: WorkUnit) -> None:
    blobs = [work_unit.project.graph, work_unit.version.wire_blob, work_unit.shard.blob]
    assert work_unit_blobs(work_unit) == {blob.sha256: blob.size for blob in blobs}
    assert fit(work_unit=work_unit, limits=Limits()) == Fit(work_unit.count)


def test_the_days_allowance_counts_only_what_the_device_does_not_have(work_unit: WorkUnit) -> None:
    total, shard = download_of(work_unit), work_unit.shard.blob
    assert fit(work_unit=work_unit, limits=Limits(download_left=total)).samples == work_unit.count
    assert fit(work_unit=work_unit, limits=Limits(download_left=total - 1)) == Fit(0, "download_limit")
    cached = Limits(download_left=total - shard.size, sent=frozenset({shard.sha256}))
    assert fit(work_unit=work_unit, limits=cached).samples == work_unit.count


def test_the_model_memory_is_read_from_the_graph(work_unit: WorkUnit) -> None:
    params, activations = model_memory(work_unit.project.graph)
    weights, _ = codecs.decode(work_unit.version.weights_blob.read())
    assert params == 4 * sum(tensor.numel() for tensor in weights.values())
    graph = load_graph(work_unit.project.graph.read(), max_activation_bytes=None)
    assert activations == activation_memory(graph).train_bytes > 0


def test_the_largest_work_unit_and_the_devices_memory_cut_the_samples(work_unit: WorkUnit) -> None:
    params, activations = model_memory(work_unit.project.graph)
    fixed = fitting.MODEL_COPIES * params + work_unit.shard.blob.size
    cap = fixed + 3 * activations + activations // 2  # room for 3.5 samples' activations
    assert cap >= download_of(work_unit)  # else the download alone is too large
    assert fit(work_unit=work_unit, limits=Limits(work_unit_bytes=cap)) == Fit(3)
    assert fit(work_unit=work_unit, limits=Limits(memory_bytes=cap)) == Fit(3)
    assert fit(work_unit=work_unit, limits=Limits(memory_bytes=cap, work_unit_bytes=cap * 10)) == Fit(3)
    assert fit(work_unit=work_unit, limits=Limits(memory_bytes=fixed)) == Fit(0, "too_large")
    assert fit(work_unit=work_unit, limits=Limits(work_unit_bytes=download_of(work_unit) - 1)) == Fit(
        0, "too_large"
    )
    plenty = fixed + work_unit.count * activations
    assert fit(work_unit=work_unit, limits=Limits(memory_bytes=plenty)) == Fit(work_unit.count)


def test_averaging_needs_the_activations_of_one_mini_batch_only(work_unit: WorkUnit) -> None:
    project = work_unit.project
    project.mode, project.local_batch_size = Project.Mode.AVERAGING, 4
    params, activations = model_memory(project.graph)
    fixed = fitting.MODEL_COPIES * params + work_unit.shard.blob.size
    four = fit(work_unit=work_unit, limits=Limits(memory_bytes=fixed + 4 * activations))
    assert four == Fit(work_unit.count)  # any number of samples, in mini-batches of 4
    assert fit(work_unit=work_unit, limits=Limits(memory_bytes=fixed + 3 * activations)) == Fit(3)


def test_the_browsers_memory_is_shared_with_everything_else(
    work_unit: WorkUnit, volunteer_user: User
) -> None:
    params, activations = model_memory(work_unit.project.graph)
    fixed = fitting.MODEL_COPIES * params + work_unit.shard.blob.size
    memory_mb = (fixed + 2 * activations) / fitting.MEMORY_SHARE / MB
    limits = fitting.limits_for(device=None, preferences=DEFAULTS, memory_mb=memory_mb)
    assert fit(work_unit=work_unit, limits=limits) == Fit(2)
    assert fitting.limits_for(device=None, preferences=DEFAULTS, memory_mb=None) == Limits()


def test_a_devices_day_counts_each_blob_once_per_connection(
    work_unit: WorkUnit, volunteer_user: User
) -> None:
    device = device_register(
        user=volunteer_user, client_id="laptop-0001", backend="webgl", gflops=1, user_agent=""
    )
    total = download_of(work_unit)
    with transaction.atomic():
        fitting.download_record(device=device, work_unit=work_unit)
        fitting.download_record(device=device, work_unit=work_unit)  # the same blobs: cached by the browser
    assert fitting.download_today(device_id=device.pk) == total
    fitting.download_forget_sent(device_id=device.pk)  # a new connection: maybe a fresh page
    with transaction.atomic():
        fitting.download_record(device=device, work_unit=work_unit)
        row = DeviceDownload.objects.get(device=device)
    assert (row.bytes, row.work_units) == (2 * total, 3)
    preferences = replace(DEFAULTS, max_download_mb_per_day=math.ceil(3 * total / MB))
    with transaction.atomic():
        limits = fitting.limits_for(device=device, preferences=preferences, memory_mb=None)
    assert limits.download_left == math.ceil(3 * total / MB) * MB - 2 * total
    assert limits.sent == frozenset(work_unit_blobs(work_unit))


def test_a_day_remembers_a_bounded_number_of_blobs() -> None:
    day = DeviceDownload()
    for i in range(MAX_REMEMBERED_BLOBS + 50):
        day.record({f"{i:064x}": 10})
    assert day.bytes == 10 * (MAX_REMEMBERED_BLOBS + 50) and len(day.blobs) == MAX_REMEMBERED_BLOBS
    assert day.blobs[-1] == f"{MAX_REMEMBERED_BLOBS + 49:064x}"  # the latest kept
    day.record({day.blobs[0]: 10})
    assert day.bytes == 10 * (MAX_REMEMBERED_BLOBS + 50)  # still remembered: not counted again
