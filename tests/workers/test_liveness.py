"""workers/liveness.py on PostgreSQL: the heartbeat's stamp, departures in bulk, and the beat sweep that
disconnects devices whose process died and gives their work units back."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth.models import User
from django.utils import timezone

from projects import lifecycle
from projects.models import Project, Result
from tests.workers.conftest import device_of
from workers import liveness
from workers.liveness import devices_depart, devices_sweep, devices_touch
from workers.models import Device
from workers.tasks import sweep_devices

STALE = 120


def _age(device: Device, seconds: float) -> None:
    """As if its last heartbeat were `seconds` ago (connected just before)."""
    seen = timezone.now() - timedelta(seconds=seconds)
    Device.objects.filter(pk=device.pk).update(last_seen=seen, connected_at=seen - timedelta(seconds=60))


def test_the_sweep_disconnects_a_silent_device_and_releases_its_work(
    mlp_project: Project, volunteer_user: User, other_volunteer: User
) -> None:
    silent, alive = device_of(volunteer_user), device_of(other_volunteer)
    lifecycle.work_units_feed(project_id=mlp_project.pk)  # start() feeds on commit, never reached here
    held = lifecycle.work_unit_offer(user=volunteer_user, device=silent).result
    assert held is not None
    _age(silent, STALE + 5)
    _age(alive, STALE - 30)

    assert devices_sweep(stale_seconds=STALE) == 1

    silent.refresh_from_db()
    assert silent.disconnected_at == silent.last_seen  # offline since its last heartbeat, not since now
    assert silent.online_ms == 60_000
    assert Result.objects.get(work_unit_id=held.work_unit_id, device=silent).status == Result.Status.RELEASED
    assert Device.objects.get(pk=alive.pk).disconnected_at is None
    assert devices_sweep(stale_seconds=STALE) == 0  # nothing twice


def test_the_beat_task_sweeps_with_the_settings_timeout(volunteer_user: User, settings: object) -> None:
    device = device_of(volunteer_user)
    _age(device, 10_000)
    assert sweep_devices() == 1
    assert Device.objects.get(pk=device.pk).disconnected_at is not None


def test_the_beat_task_sweeps_every_batch_of_a_dead_process(
    volunteer_user: User, monkeypatch: pytest.MonkeyPatch
) -> None:
    """More stale devices than one batch (a web process that died with its thousands): all of them in one
    run, batch after batch."""
    monkeypatch.setattr(liveness, "SWEEP_BATCH", 4)
    for index in range(10):
        _age(device_of(volunteer_user, name=f"browser-{index}"), 10_000)
    assert sweep_devices() == 10
    assert not Device.objects.filter(disconnected_at__isnull=True).exists()


def test_the_sweep_stops_when_its_budget_is_spent(
    volunteer_user: User, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(liveness, "SWEEP_BATCH", 4)
    for index in range(10):
        _age(device_of(volunteer_user, name=f"browser-{index}"), 10_000)
    # One batch at least; the next run does the rest.
    assert liveness.devices_sweep_all(stale_seconds=STALE, budget_seconds=0) == 4


def test_a_departure_does_not_disconnect_a_device_that_connected_again(volunteer_user: User) -> None:
    device = device_of(volunteer_user)
    left_before_reconnecting = device.connected_at - timedelta(seconds=1)
    assert devices_depart(left={device.pk: left_before_reconnecting}) == 0
    assert Device.objects.get(pk=device.pk).disconnected_at is None
    assert devices_depart(left={device.pk: timezone.now()}) == 1
    assert Device.objects.get(pk=device.pk).disconnected_at is not None


def test_the_heartbeat_stamps_connected_devices_only(volunteer_user: User, other_volunteer: User) -> None:
    connected, gone = device_of(volunteer_user), device_of(other_volunteer)
    devices_depart(left={gone.pk: timezone.now()})
    _age(connected, 500)
    later = timezone.now() + timedelta(seconds=1)
    assert devices_touch(device_ids=[connected.pk, gone.pk], now=later) == 1
    assert Device.objects.get(pk=connected.pk).last_seen == later
    assert Device.objects.get(pk=gone.pk).last_seen < later
