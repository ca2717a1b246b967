"""The scaling benchmark's project, and the benchmark's writes to the platform's database, through Django.

The runner runs `seed` once inside the platform (`manage.py shell -c ...`) on a template database, then
`serve_run` for every run on that run's clone; the project starts as a draft and `configure` starts it with
the run's settings. Django is imported lazily: the runner itself is not a Django process.
"""

from __future__ import annotations

import json
import sys
from typing import Any

PROJECT = "Fashion-MNIST MLP (scaling benchmark)"
CONFIGURED = "configured project"  # serve_run's line on stdout once the project runs, then its id
OPENED = "opened the first round"  # and once the clock may start


def seed() -> None:
    from django.contrib.auth.models import User

    from projects.datasets import dataset_create_from_npz
    from projects.demo import fashion_npz
    from projects.services import project_create

    owner = User.objects.get(username="admin")
    # Images keep their [1, 28, 28] shape: the mlp preset flattens them itself.
    dataset = dataset_create_from_npz(owner=owner, name="Fashion-MNIST", data=fashion_npz())
    project_create(owner=owner, name=PROJECT, dataset=dataset, preset="mlp")


def configure(columns: dict[str, Any]) -> int:
    """Start the benchmark project with a run's settings before any volunteer connects (everything else
    paused), dropping work fed with other settings so the first round already has the run's size. Plain
    column updates, as an operator's: no service may queue work before the platform's processes start."""
    from projects.models import Project, WorkUnit
    from projects.services import version_rewire

    Project.objects.exclude(name=PROJECT).update(status=Project.Status.PAUSED)
    running = {**columns, "data_cursor": 0, "status": Project.Status.RUNNING}
    if not Project.objects.filter(name=PROJECT).update(**running):
        raise RuntimeError("benchmark project missing")
    WorkUnit.objects.filter(total_results=0).delete()
    project = Project.objects.get(name=PROJECT)
    # Version 0 was published with the template's default codecs (fp32 down): as project_create would, send
    # it in the run's weights_codec, or a 2-round method's bytes are mostly one fp32 download per volunteer.
    version_rewire(version=project.current_version())
    return project.pk


def open_first_round(project_id: int) -> None:
    """Version 0 was published when the template was seeded, minutes ago: its round would count as timed
    out at once and close with the first result in. Date it now, when the clock starts."""
    from django.utils import timezone

    from projects.models import ModelVersion

    ModelVersion.objects.filter(project_id=project_id).update(created_at=timezone.now())


def serve_run(columns_json: str) -> None:
    """A run's writes from one Django process started before the platform's: `configure` at once, then
    `open_first_round` when a line comes on stdin, at the clock's start (a Django start-up takes seconds
    here, and meanwhile the old version 0 would make beat time out the first round)."""
    project_id = configure(json.loads(columns_json))
    print(CONFIGURED, project_id, flush=True)
    sys.stdin.readline()
    open_first_round(project_id)
    print(OPENED, flush=True)  # before this process takes its time to exit
