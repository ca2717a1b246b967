"""`manage.py seed_demo`: the MNIST demo dataset and running project, created once."""

from __future__ import annotations

import gzip
import io
import struct
from pathlib import Path

import numpy as np
import pytest
from django.contrib.auth.models import User
from django.core.management import call_command

from projects import demo
from projects.models import Dataset, Project


@pytest.fixture
def admin(db: None) -> User:
    return User.objects.create_superuser("admin", password="demo-admin-pass-123")


def seed(*args: str) -> str:
    out = io.StringIO()
    call_command("seed_demo", *args, stdout=out)
    return out.getvalue()


def test_seed_demo_creates_the_mnist_project_once(admin: User) -> None:
    seed("--no-fashion")

    project = Project.objects.get(name="MNIST MLP (demo)")
    assert project.status == Project.Status.RUNNING
    assert project.owner == admin and project.preset == "mlp"
    assert project.crowd_rounds  # its rounds grow with the volunteers connected
    dataset = project.dataset
    assert (dataset.train_samples, dataset.test_samples) == (9000, 1000)
    assert dataset.input_shape == [1, 28, 28] and dataset.num_classes == 10
    assert project.versions.filter(number=0).exists()

    counts = (Project.objects.count(), Dataset.objects.count())
    assert "nothing to do" in seed("--no-fashion")
    assert (Project.objects.count(), Dataset.objects.count()) == counts


def test_seed_demo_needs_an_admin(db: None) -> None:
    from django.core.management.base import CommandError

    with pytest.raises(CommandError, match="ensure_admin"):
        seed("--no-fashion")


def test_mnist_npz_is_deterministic_and_balanced() -> None:
    first, second = demo.mnist_npz(), demo.mnist_npz()
    assert first == second
    arrays = np.load(io.BytesIO(first))
    assert arrays["x"].shape == (9000, 1, 28, 28) and arrays["x_test"].shape == (1000, 1, 28, 28)
    assert arrays["x"].dtype == np.float32 and arrays["x"].min() >= 0 and arrays["x"].max() <= 1
    assert sorted(set(arrays["y_test"].tolist())) == list(range(10))


def idx_bytes(array: np.ndarray) -> bytes:
    header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    return header + array.astype(np.uint8).tobytes()


def test_read_idx_round_trips_and_rejects_garbage() -> None:
    images = np.arange(2 * 3 * 4).reshape(2, 3, 4)
    assert np.array_equal(demo.read_idx(idx_bytes(images)), images)
    with pytest.raises(ValueError):
        demo.read_idx(b"PK\x03\x04 not idx")
    with pytest.raises(ValueError):
        demo.read_idx(idx_bytes(images)[:-1])


def test_fashion_npz_scales_and_adds_a_channel(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    files = {
        "train-images-idx3-ubyte": rng.integers(0, 256, (6, 28, 28)),
        "train-labels-idx1-ubyte": np.arange(6) % 3,
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (2, 28, 28)),
        "t10k-labels-idx1-ubyte": np.array([0, 2]),
    }
    for name, array in files.items():
        (tmp_path / f"{name}.gz").write_bytes(gzip.compress(idx_bytes(array)))
    assert demo.fashion_available(tmp_path)
    arrays = np.load(io.BytesIO(demo.fashion_npz(tmp_path)))
    assert arrays["x"].shape == (6, 1, 28, 28) and arrays["x_test"].shape == (2, 1, 28, 28)
    assert np.allclose(arrays["x"][:, 0] * 255, files["train-images-idx3-ubyte"])
    assert arrays["y"].tolist() == [0, 1, 2, 0, 1, 2]


@pytest.mark.slow
def test_seed_demo_adds_fashion_mnist_when_installed(admin: User) -> None:
    from engine.presets import PRESETS

    if not demo.fashion_available() or "cnn" not in PRESETS:
        pytest.skip("needs Debian's dataset-fashion-mnist and a 'cnn' preset in engine.presets")
    seed()
    project = Project.objects.get(name="Fashion-MNIST CNN (demo)")
    assert project.status == Project.Status.RUNNING and project.preset == "cnn"
    assert project.dataset.input_shape == [1, 28, 28]
    assert (project.dataset.train_samples, project.dataset.test_samples) == (60000, 10000)
