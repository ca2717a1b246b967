"""workers/liveness.py on PostgreSQL: the heartbeat's stamp, departures in bulk, and the beat sweep that
disconnects devices whose process died and gives their work units back."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

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


def test_a_departure_of_an_older_connection_leaves_the_device_connected(volunteer_user: User) -> None:
    """Compared under the row lock: only the device's current connection's departure disconnects it."""
    device = _connected(volunteer_user, connection="tab-new")
    later = timezone.now() + timedelta(seconds=1)  # noticed after the new hello: the time cannot tell
    assert devices_depart(left={device.pk: later}, connections={device.pk: {"tab-old"}}) == 0
    assert Device.objects.get(pk=device.pk).disconnected_at is None
    assert devices_depart(left={device.pk: later}, connections={device.pk: {"tab-old", "tab-new"}}) == 1
    assert Device.objects.get(pk=device.pk).disconnected_at == later


def test_the_sweep_spares_a_device_that_said_hello_again_and_the_work_it_got(
    mlp_project: Project, volunteer_user: User, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sweep reads a stale device; its browser reconnects before the sweep locks the row and gets work:
    the device stays connected and that work stays with it."""
    device = _connected(volunteer_user, connection="old")
    _age(device, STALE + 5)
    lifecycle.work_units_feed(project_id=mlp_project.pk)
    offered: list[int] = []
    original = liveness._devices_gone

    def reconnect_first(**kwargs: Any) -> dict[int, Any]:
        again = _connected(volunteer_user, connection="new")
        offer = lifecycle.work_unit_offer(user=volunteer_user, device=again).result
        assert offer is not None
        offered.append(offer.work_unit_id)
        return original(**kwargs)

    monkeypatch.setattr(liveness, "_devices_gone", reconnect_first)
    devices_sweep(stale_seconds=STALE)
    assert Device.objects.get(pk=device.pk).disconnected_at is None
    assert Result.objects.get(work_unit_id=offered[0], device=device).status == Result.Status.IN_PROGRESS


def test_the_heartbeat_stamps_the_devices_of_live_connections_only(
    volunteer_user: User, other_volunteer: User
) -> None:
    connected = _connected(volunteer_user, connection="live")
    moved = _connected(other_volunteer, connection="elsewhere")  # its current connection is another's
    _age(connected, 500)
    _age(moved, 500)
    later = timezone.now() + timedelta(seconds=1)
    assert devices_touch(connections=["live", "stale-tab"], now=later) == 1
    assert Device.objects.get(pk=connected.pk).last_seen == later
    assert Device.objects.get(pk=moved.pk).last_seen < later


def test_the_heartbeat_reconnects_a_live_connections_device_marked_disconnected(volunteer_user: User) -> None:
    """A late departure or the sweep behind a lagging heartbeat took it: it is connected, as of now."""
    device = _connected(volunteer_user, connection="live")
    devices_depart(left={device.pk: timezone.now()})
    later = timezone.now() + timedelta(seconds=1)
    assert devices_touch(connections=["live"], now=later) == 1
    device.refresh_from_db()
    assert (device.disconnected_at, device.connected_at, device.last_seen) == (None, later, later)


def _connected(user: User, *, connection: str) -> Device:
    return device_of(user, connection=connection)
