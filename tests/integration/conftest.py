"""Fixtures shared by the integration tests (the MLP project and users are in tests/conftest.py)."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth.models import User


@pytest.fixture
def cnn_project(researcher: User) -> Any:
    """A running CNN preset project: its graph has dropout, so updates are only checked statistically."""
    from projects.datasets import dataset_create_from_npz
    from projects.services import project_create, project_start
    from tests.conftest import mnist_arrays, npz_bytes

    x, y = mnist_arrays(per_class=20)
    dataset = dataset_create_from_npz(owner=researcher, name="digit images", data=npz_bytes(x=x, y=y))
    project = project_create(
        owner=researcher,
        name="CNN",
        dataset=dataset,
        preset="cnn",
        settings={"batch_size": 32, "round_samples": 64, "codec": "fp32"},
    )
    return project_start(project=project)
