"""Helpers for the workers tests: accepted results to credit, a second project, a clock to set."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.utils import timezone

from projects.models import Project, Result, WorkUnit
from tests.conftest import second_project  # noqa: F401 (tests/accounts/conftest.py imports the fixture from here)
from workers.models import CreditEntry, Device
from workers.services import credit_grant, device_register


def accepted_result(project: Project, user: User, *, device: Device | None = None, count: int = 50) -> Result:
    """A valid result of `user` (one row per call: the ledger has one line per result)."""
    shard = project.dataset.shards.get(split="train", index=0)
    work_unit = WorkUnit.objects.create(
        project=project,
        version=project.current_version(),
        shard=shard,
        offset=0,
        count=count,
        status=WorkUnit.Status.VALIDATED,
    )
    return Result.objects.create(
        work_unit=work_unit,
        volunteer=user,
        device=device,
        status=Result.Status.RECEIVED,
        validation=Result.Validation.VALID,
        samples=count,
        deadline=timezone.now(),
    )


def grant(project: Project, user: User, flops: int, *, device: Device | None = None) -> CreditEntry:
    return credit_grant(user=user, result=accepted_result(project, user, device=device), flops=flops)


def device_of(user: User, name: str = "browser-1", connection: str = "") -> Device:
    return device_register(
        user=user, client_id=name, backend="webgl", gflops=12.5, user_agent="Test/1.0", connection=connection
    )


def user(name: str, **volunteer: Any) -> User:
    """A user with a volunteer row (display name, country... as given)."""
    from workers.services import volunteer_ensure

    made = User.objects.create_user(name, email=f"{name}@example.org")  # no password: no slow hashing
    if volunteer:
        row = volunteer_ensure(user=made)
        for field, value in volunteer.items():
            setattr(row, field, value)
        row.save()
    return made


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[datetime], None]]:
    """Sets what timezone.now() returns (auto_now_add fields included), until the test ends."""
    now = [timezone.now()]
    monkeypatch.setattr(timezone, "now", lambda: now[0])

    def set_to(at: datetime) -> None:
        now[0] = at

    yield set_to


def days(n: float) -> timedelta:
    return timedelta(days=n)
