"""An honest volunteer computed in-process with engine/: what a browser would send for a work unit
(and what a Byzantine one would send instead)."""

from __future__ import annotations

import math

import torch
from django.contrib.auth.models import User

from engine import codecs
from projects import lifecycle
from projects.lifecycle import ResultOutcome
from projects.models import Result, WorkUnit
from projects.validation import recompute


def honest_update(work_unit: WorkUnit) -> bytes:
    return codecs.encode(recompute(work_unit=work_unit), codec=work_unit.project.codec)


def tampered(work_unit: WorkUnit, how: str) -> bytes:
    """The honest update spoilt: nan, shape, sign_flip, scaled (x100) or random (noise of the same norm)."""
    update = recompute(work_unit=work_unit)
    name = next(iter(update))
    if how == "nan":
        update[name][0] = math.nan
    elif how == "shape":
        update[name] = torch.zeros(3)
    elif how == "sign_flip":
        update = {k: -v for k, v in update.items()}
    elif how == "scaled":
        update = {k: 100 * v for k, v in update.items()}
    elif how == "random":
        update = {k: torch.randn_like(v) * v.norm() / v.numel() ** 0.5 for k, v in update.items()}
    return codecs.encode(update, codec=work_unit.project.codec)


def receive(
    user: User,
    result: Result,
    payload: bytes | None = None,
    samples: int | None = None,
    loss: float | None = 1.0,
) -> ResultOutcome:
    """Upload an update for an assigned instance; Celery runs eagerly, so it is validated at once."""
    work_unit = result.work_unit
    return lifecycle.result_receive(
        user=user,
        work_unit_id=work_unit.pk,
        samples=work_unit.count if samples is None else samples,
        loss=loss,
        compute_ms=5,
        payload=honest_update(work_unit) if payload is None else payload,
    )


def judged(result: Result) -> Result:
    return Result.objects.select_related("work_unit").get(pk=result.pk)


def assign(user: User) -> Result:
    result = lifecycle.work_unit_assign(user=user)
    assert result is not None
    return result
