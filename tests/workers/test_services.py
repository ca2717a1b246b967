"""workers.services.credit_grant: one ledger line, and every total it counts in (volunteer, team, device,
per-project rows) with BOINC's recent average; without lost updates when grants run at once."""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable
from datetime import datetime
from typing import Any

import pytest
from django.conf import settings
from django.contrib.auth.models import User
from django.db import OperationalError, close_old_connections, connection, transaction
from django.db.models import Sum
from django.utils import timezone

from projects.models import Project, Result
from tests.workers.conftest import accepted_result, days, device_of, grant, user
from workers.credit import credit_from_flops, update_average
from workers.models import CreditEntry, Device, Team, TeamProjectCredit, Volunteer, VolunteerProjectCredit
from workers.services import Grant, credit_grant, credit_lock, credits_grant
from workers.teams import team_create, team_join, team_leave

GFLOP = 10**9


def ledger(**filters: object) -> int:
    return int(CreditEntry.objects.filter(**filters).aggregate(total=Sum("flops"))["total"] or 0)


def test_a_grant_counts_in_the_volunteer_team_device_and_project_rows(
    mlp_project: Project, volunteer_user: User
) -> None:
    team = team_create(user=volunteer_user, name="Gradient Descenders")
    device = device_of(volunteer_user)
    entry = grant(mlp_project, volunteer_user, 3 * GFLOP, device=device)

    assert entry.team == team and entry.flops == 3 * GFLOP
    volunteer = Volunteer.objects.get(user=volunteer_user)
    rows: list[Any] = [
        volunteer,
        Team.objects.get(pk=team.pk),
        Device.objects.get(pk=device.pk),
        VolunteerProjectCredit.objects.get(volunteer=volunteer, project=mlp_project),
        TeamProjectCredit.objects.get(team=team, project=mlp_project),
    ]
    first_average = math.log(2) * credit_from_flops(3 * GFLOP) / 7
    for row in rows:
        assert row.total_flops == 3 * GFLOP
        assert row.expavg_credit == pytest.approx(first_average)
        assert (
            row.expavg_time == entry.created_at
            or abs((row.expavg_time - entry.created_at).total_seconds()) < 1
        )
    assert volunteer.results_accepted == 1 and rows[3].results == 1


def test_the_averages_follow_boincs_update_at_each_grant(
    mlp_project: Project, volunteer_user: User, clock: Callable[[datetime], None]
) -> None:
    start = timezone.now()
    grants = [(start, 5 * GFLOP), (start + days(1), 2 * GFLOP), (start + days(1.5), 9 * GFLOP)]
    avg, at = 0.0, None
    for when, flops in grants:
        clock(when)
        grant(mlp_project, volunteer_user, flops)
        avg = update_average(avg=avg, avg_time=at, credit=credit_from_flops(flops), now=when.timestamp())
        at = when.timestamp()

    volunteer = Volunteer.objects.get(user=volunteer_user)
    assert volunteer.expavg_credit == pytest.approx(avg, rel=1e-12)
    assert volunteer.expavg_time == grants[-1][0]
    later = grants[-1][0] + days(7)
    assert volunteer.recent_credit(now=later) == pytest.approx(avg / 2, rel=1e-12)


def test_a_team_counts_only_what_members_earned_while_members(
    mlp_project: Project, volunteer_user: User, other_volunteer: User
) -> None:
    team = team_create(user=other_volunteer, name="Latecomers welcome")
    grant(mlp_project, volunteer_user, 1 * GFLOP)  # before joining: not the team's
    team_join(user=volunteer_user, team_id=team.pk)
    grant(mlp_project, volunteer_user, 2 * GFLOP)
    grant(mlp_project, other_volunteer, 4 * GFLOP)
    team_leave(user=volunteer_user, team_id=team.pk)
    grant(mlp_project, volunteer_user, 8 * GFLOP)  # after leaving: not the team's either

    team.refresh_from_db()
    assert team.total_flops == 6 * GFLOP == ledger(team=team)
    assert TeamProjectCredit.objects.get(team=team).total_flops == 6 * GFLOP
    assert (
        Volunteer.objects.get(user=volunteer_user).total_flops
        == 11 * GFLOP
        == ledger(volunteer__user=volunteer_user)
    )


def test_per_project_rows_split_the_volunteers_total(
    mlp_project: Project, second_project: Project, volunteer_user: User
) -> None:
    grant(mlp_project, volunteer_user, 3 * GFLOP)
    grant(second_project, volunteer_user, 5 * GFLOP)
    grant(second_project, volunteer_user, 7 * GFLOP)
    rows = {row.project_id: row for row in VolunteerProjectCredit.objects.all()}
    assert rows[mlp_project.pk].total_flops == 3 * GFLOP and rows[mlp_project.pk].results == 1
    assert rows[second_project.pk].total_flops == 12 * GFLOP and rows[second_project.pk].results == 2
    volunteer = Volunteer.objects.get(user=volunteer_user)
    assert volunteer.total_flops == sum(row.total_flops for row in rows.values())


# --- concurrency (PostgreSQL, one connection per thread) -------------------------------------------

postgresql = pytest.mark.skipif(
    settings.DATABASES["default"]["ENGINE"] != "django.db.backends.postgresql",
    reason="row locks: SQLite runs one writer at a time",
)


def _run_threads(count: int, work: Callable[[int], None]) -> list[BaseException]:
    errors: list[BaseException] = []
    start = threading.Barrier(count)

    def run(index: int) -> None:
        try:
            start.wait(10)
            work(index)
        except BaseException as exc:  # reported in the test's own thread
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    close_old_connections()
    return errors


@postgresql
@pytest.mark.django_db(transaction=True)
def test_concurrent_grants_lose_no_update(mlp_project: Project, volunteer_user: User) -> None:
    """Six threads grant eight results each to one volunteer, in one team, from one device, at once. Every
    total equals the ledger, and the average equals what the grants add up to in the ~second they took
    (decay over a second is 1e-6 of it): a lost update would be 1/48 of it missing."""
    threads, per_thread, flops = 6, 8, 7 * GFLOP
    team = team_create(user=volunteer_user, name="Parallel")
    device = device_of(volunteer_user)
    results = [
        [accepted_result(mlp_project, volunteer_user, device=device) for _ in range(per_thread)]
        for _ in range(threads)
    ]

    def work(index: int) -> None:
        for result in results[index]:
            credit_grant(user=volunteer_user, result=result, flops=flops)

    assert _run_threads(threads, work) == []
    total = threads * per_thread * flops
    assert ledger() == total
    volunteer = Volunteer.objects.get(user=volunteer_user)
    rows: list[Any] = [
        volunteer,
        Team.objects.get(pk=team.pk),
        Device.objects.get(pk=device.pk),
        VolunteerProjectCredit.objects.get(volunteer=volunteer),
        TeamProjectCredit.objects.get(team=team),
    ]
    expected_average = math.log(2) * credit_from_flops(total) / 7
    for row in rows:
        assert row.total_flops == total
        assert row.expavg_credit == pytest.approx(expected_average, rel=1e-4)
    assert volunteer.results_accepted == threads * per_thread == rows[3].results


@postgresql
@pytest.mark.django_db(transaction=True)
def test_crediting_several_volunteers_of_one_team_in_crossing_orders_does_not_deadlock(
    mlp_project: Project,
) -> None:
    """Two validations credit {a, c} and {c, d}, a and d in one team and c in another. Each grant locks the
    volunteer and then the team: one after the other, the first can hold a and its team while waiting for c,
    and the second hold c while waiting for the team: PostgreSQL aborts one (shown with `locked=False`).
    credit_lock first takes every volunteer, then every team, in id order, as projects.validation does."""
    a, c, d = user("a-volunteer"), user("c-volunteer"), user("d-volunteer")
    team_create(user=a, name="Team of a and d")
    team_join(user=d, team_id=Team.objects.get().pk)
    team_create(user=c, name="Team of c")
    plans = [[(a, accepted_result(mlp_project, a)), (c, accepted_result(mlp_project, c))]]
    plans.append([(c, accepted_result(mlp_project, c)), (d, accepted_result(mlp_project, d))])

    def validations(locked: bool) -> list[BaseException]:
        halfway = threading.Barrier(2)

        def work(index: int) -> None:
            with transaction.atomic():
                if locked:
                    credit_lock(user_ids=[who.pk for who, _ in plans[index]])
                (first, first_result), (second, second_result) = plans[index]
                credit_grant(user=first, result=first_result, flops=GFLOP)
                # Both hold their first grant's locks here (unless credit_lock made one wait: then it breaks).
                with contextlib.suppress(threading.BrokenBarrierError):
                    halfway.wait(3)
                credit_grant(user=second, result=second_result, flops=GFLOP)

        return _run_threads(2, work)

    errors = validations(locked=False)
    assert len(errors) == 1 and isinstance(errors[0], OperationalError) and "deadlock" in str(errors[0])
    CreditEntry.objects.all().delete()  # the lines of the validation that went through, to grant them again
    before = Team.objects.get(name="Team of a and d").total_flops
    assert validations(locked=True) == []
    assert ledger() == 4 * GFLOP
    gained = Team.objects.get(name="Team of a and d").total_flops - before
    assert gained == 2 * GFLOP == ledger(team__name="Team of a and d")


def _credit_rows(users: list[User]) -> list[tuple[Any, ...]]:
    """Every total the grants of `users` wrote (recent averages to 9 digits: grants seconds apart)."""
    volunteers = Volunteer.objects.filter(user__in=users).order_by("user_id")
    rows: list[Any] = [*volunteers, *Team.objects.order_by("pk"), *Device.objects.order_by("pk")]
    rows += [*VolunteerProjectCredit.objects.order_by("volunteer_id", "project_id")]
    rows += [*TeamProjectCredit.objects.order_by("team_id", "project_id")]
    return [
        (row.total_flops, round(row.expavg_credit, 9), getattr(row, "observed_gflops", None)) for row in rows
    ]


def test_a_batchs_bulk_grant_writes_what_the_same_grants_one_by_one_write(
    mlp_project: Project, second_project: Project, volunteer_user: User, other_volunteer: User
) -> None:
    """credits_grant (a validation batch's ledger) against credit_grant and Device.observe per result: one
    volunteer in a team with two results in one project and one in another on a device, another alone."""
    team_create(user=volunteer_user, name="Batched")
    device = device_of(volunteer_user)
    plan = [
        (mlp_project, volunteer_user, 3),
        (mlp_project, volunteer_user, 5),
        (second_project, volunteer_user, 7),
    ]
    plan += [(mlp_project, other_volunteer, 11)]
    results = [
        accepted_result(project, who, device=device if who == volunteer_user else None)
        for project, who, _ in plan
    ]
    for result in results:
        Result.objects.filter(pk=result.pk).update(compute_ms=400)
        result.compute_ms = 400
    with transaction.atomic():
        credit_lock(user_ids=[volunteer_user.pk, other_volunteer.pk])
        credits_grant(
            grants=[Grant(result=r, flops=gf * GFLOP) for r, (_, _, gf) in zip(results, plan, strict=True)]
        )
    bulk = _credit_rows([volunteer_user, other_volunteer])
    assert ledger() == 26 * GFLOP and CreditEntry.objects.count() == 4
    assert Volunteer.objects.get(user=volunteer_user).results_accepted == 3
    assert (
        VolunteerProjectCredit.objects.get(volunteer__user=volunteer_user, project=mlp_project).results == 2
    )

    CreditEntry.objects.all().delete()
    zero = {"total_flops": 0, "expavg_credit": 0.0, "expavg_time": None}
    for model in (Volunteer, Team, VolunteerProjectCredit, TeamProjectCredit):
        model.objects.update(**zero)
    Device.objects.update(**zero, observed_gflops=0.0, compute_ms=0)
    for result, (_, who, gf) in zip(results, plan, strict=True):
        credit_grant(user=who, result=result, flops=gf * GFLOP)
        if result.device_id:
            one = Device.objects.get(pk=result.device_id)
            one.observe(flops=gf * GFLOP, compute_ms=400)
            one.save()
    assert _credit_rows([volunteer_user, other_volunteer]) == bulk


def test_grants_keep_an_average_of_how_long_the_device_takes_to_start_its_units(
    mlp_project: Project, volunteer_user: User
) -> None:
    """What planning a unit that ends with its round needs (lifecycle._device_unit_samples): the client's
    word for its downloads, bounded by the time the unit was out when it arrived, and averaged."""
    device = device_of(volunteer_user)
    reported = [2000, 2000, -5, 2**40]  # the last two out of any column's range: kept in range here too
    for download_ms in reported:
        result = accepted_result(mlp_project, volunteer_user, device=device)
        result.compute_ms, result.download_ms = 400, download_ms
        with transaction.atomic():
            credit_lock(user_ids=[volunteer_user.pk])
            credits_grant(grants=[Grant(result=result, flops=GFLOP)])
        device.refresh_from_db()
        if download_ms == 2000:
            assert device.start_ms in (600, 1020)  # 0.3 of the first, then 0.7 x 600 + 0.3 x 2000
    assert device.start_ms == round(0.7 * round(0.7 * 1020) + 0.3 * (2**31 - 1))
    assert device.start_seconds() == device.start_ms / 1000
