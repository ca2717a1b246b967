"""The scaling benchmark's project: an MLP on Fashion-MNIST (60,000 training images, flattened to 784).

run.py runs `seed` inside the platform (`manage.py shell -c ...`); the project starts as a draft and each run
configures and starts it with SQL. Django is imported lazily: run.py itself is not a Django process.
"""

from __future__ import annotations

import io

import numpy as np

PROJECT = "Fashion-MNIST MLP (scaling benchmark)"


def flat_fashion_npz() -> bytes:
    from projects.demo import fashion_npz, npz_bytes

    data = np.load(io.BytesIO(fashion_npz()))
    arrays = {key: data[key] for key in data.files}
    for key in ("x", "x_test"):
        arrays[key] = arrays[key].reshape(len(arrays[key]), -1)
    return npz_bytes(**arrays)


def seed() -> None:
    from django.contrib.auth.models import User

    from projects.datasets import dataset_create_from_npz
    from projects.services import project_create

    owner = User.objects.get(username="admin")
    dataset = dataset_create_from_npz(owner=owner, name="Fashion-MNIST, flat", data=flat_fashion_npz())
    project_create(owner=owner, name=PROJECT, dataset=dataset, preset="mlp")
