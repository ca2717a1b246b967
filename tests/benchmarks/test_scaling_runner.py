"""The scaling benchmark's round timeline (benchmarks/scaling/runner.py), read from the platform's own tables
on PostgreSQL: how long each round took and how long its devices took to start computing; and how long each
volunteer waited for its first unit."""

from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace
from typing import Any, cast

import pytest
from django.contrib.auth.models import User
from django.db import connection
from django.utils import timezone

from benchmarks.scaling.emulation import CountingSimulator
from benchmarks.scaling.runner import Race, busy, round_timeline, rounds_summary
from projects.models import ModelVersion, Project, Result, WorkUnit

pytestmark = pytest.mark.django_db

RUN_START = timezone.now() - timedelta(minutes=10)


def _round(project: Project, *, number: int, at: float, starts_ms: list[int], late_ms: int) -> None:
    """Version `number` published `at` seconds after the run's start, its units sent at once and one more
    10 s later."""
    start = RUN_START + timedelta(seconds=at)
    version = ModelVersion.objects.create(project=project, number=number)
    ModelVersion.objects.filter(pk=version.pk).update(created_at=start)
    user = User.objects.get_or_create(username="timeline")[0]
    shard = project.dataset.shards.order_by("pk")[0]
    sent = [(start + timedelta(seconds=0.2), ms) for ms in starts_ms] + [
        (start + timedelta(seconds=10), late_ms)
    ]
    for when, ms in sent:
        unit = WorkUnit.objects.create(project=project, version=version, shard=shard, offset=0, count=1)
        result = Result.objects.create(work_unit=unit, volunteer=user, deadline=start, download_ms=ms)
        Result.objects.filter(pk=result.pk).update(sent_at=when, received_at=when + timedelta(seconds=40))


def test_rounds_are_timed_from_version_to_version_with_their_first_units_start(mlp_project: Project) -> None:
    ModelVersion.objects.filter(project=mlp_project).delete()
    for number, at in enumerate([0.0, 3.0, 44.0, 85.5, 127.0]):
        _round(mlp_project, number=number, at=at, starts_ms=[100 * (number + 1), 900, 300], late_ms=5_000)
    raw: Any = connection.connection  # Django's psycopg connection, inside the test's transaction
    rounds = round_timeline(raw, mlp_project.pk)
    # Versions 2 and 3 (0 and 1 warm up; 4 has no next); a unit sent 10 s in does not count as a start.
    assert rounds == [
        {"version": 2, "seconds": 41.5, "start_ms_p50": 300.0, "start_ms_p90": 780.0},
        {"version": 3, "seconds": 41.5, "start_ms_p50": 400.0, "start_ms_p90": 800.0},
    ]
    summary = rounds_summary(rounds)
    assert (summary["seconds_median"], summary["start_ms_p50_median"], summary["start_ms_p90_median"]) == (
        41.5,
        350.0,
        790.0,
    )
    assert rounds_summary([])["seconds_median"] is None


def _sim(started: float, computing: list[tuple[float, float]]) -> Any:
    return SimpleNamespace(
        started=started,
        tally=SimpleNamespace(computing=computing),
        left_at=None,
        config=SimpleNamespace(gflops=1.0),
    )


def test_a_volunteers_wait_for_its_first_unit_is_reported_beside_the_busy_fraction() -> None:
    """The busy fraction counts from a device's first unit, so a volunteer who connected mid-round and got
    nothing until the next one looked as busy as the others; the wait from its start to that unit shows it."""
    sims = [_sim(100.0, [(101.0, 140.0), (141.0, 180.0)]), _sim(100.0, [(140.0, 180.0)]), _sim(120.0, [])]
    race = Race(sims=cast(list[CountingSimulator], sims), started=100.0, ended=180.0)
    report = busy(race)
    assert report["first_unit_wait_s"] == {"median": 20.5, "p90": 36.1, "max": 40.0}
    assert report["busy_median"] == pytest.approx((78 / 79 + 1.0) / 2, abs=1e-4)
    assert busy(Race(sims=[], ended=1.0))["first_unit_wait_s"] == {"median": None, "p90": None, "max": None}
