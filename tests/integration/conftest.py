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


@pytest.fixture
def wide_units(settings: Any, researcher: User) -> Any:
    """Work units of 400 samples over shards of 300, 300, 300 and 100: each runs across two or three of them,
    the third on past the split's end from its start."""
    from projects.datasets import dataset_create_from_npz
    from projects.services import project_create, project_start
    from tests.conftest import mnist_arrays, npz_bytes

    settings.CROWDTRAIN = {**settings.CROWDTRAIN, "SHARD_SAMPLES": 300}
    x, y = mnist_arrays(per_class=120)
    data = npz_bytes(x=x[:1000], y=y[:1000], x_test=x[1000:], y_test=y[1000:])
    dataset = dataset_create_from_npz(owner=researcher, name="digits in shards of 300", data=data)
    project = project_create(
        owner=researcher,
        name="Wide units",
        dataset=dataset,
        preset="mlp",
        settings={"batch_size": 400, "round_samples": 1000, "learning_rate": 0.1},
    )
    return project_start(project=project)
