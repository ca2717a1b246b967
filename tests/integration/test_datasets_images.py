"""Zips of image folders (torchvision's ImageFolder layout): good ones become [C, H, W] float32 samples in
[0, 1] with the folder names as classes; every bad one is refused with a clear message and stores nothing."""

from __future__ import annotations

import io
import re
import struct
import zipfile
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from django.contrib.auth.models import User
from PIL import Image

from projects.datasets import DatasetError, dataset_create, dataset_load_split, dataset_parse_images
from projects.models import Blob, Dataset, DatasetShard

# A distinct colour per class, so that every stored sample can be checked against its label.
COLOURS = {"cat": (255, 0, 0), "dog": (0, 255, 0), "emu": (0, 0, 255)}


def image_bytes(
    colour: tuple[int, ...] = (255, 0, 0), size: tuple[int, int] = (6, 4), **options: Any
) -> bytes:
    mode, fmt = options.get("mode", "RGB"), options.get("format", "PNG")
    image = Image.new("RGB", size, colour[:3])
    if mode != "RGB":
        image = image.convert(mode)
    buffer = io.BytesIO()
    image.save(buffer, fmt)
    return buffer.getvalue()


def zip_of(files: dict[str, bytes], folders: tuple[str, ...] = (), compress: bool = False) -> bytes:
    buffer = io.BytesIO()
    method = zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED
    with zipfile.ZipFile(buffer, "w", method) as archive:
        for folder in folders:
            archive.writestr(zipfile.ZipInfo(folder), b"")  # a name ending in "/" is a directory entry
        for name, data in files.items():
            archive.writestr(name, data)
    return buffer.getvalue()


def class_images(
    prefix: str, per_class: int, classes: tuple[str, ...] = ("cat", "dog", "emu")
) -> dict[str, bytes]:
    return {
        f"{prefix}{name}/{i:03d}.png": image_bytes(COLOURS[name], size=(5 + i % 3, 4))
        for name in classes
        for i in range(per_class)
    }


def png_declaring(width: int, height: int) -> bytes:
    """A real 1x1 PNG whose header is rewritten to declare width x height (checksum fixed)."""
    data = image_bytes(size=(1, 1))
    chunk = b"IHDR" + struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return data[:8] + struct.pack(">I", 13) + chunk + struct.pack(">I", zlib.crc32(chunk)) + data[33:]


@pytest.fixture
def owner(db: None) -> User:
    return User.objects.create_user("image-owner", password="owner-pass-123", is_staff=True)


def parse(data: bytes, channels: int = 3, height: int = 4, width: int = 4) -> Any:
    return dataset_parse_images(data=data, channels=channels, height=height, width=width)


def test_train_and_test_folders_become_labelled_float_images(owner: User, settings: Any) -> None:
    settings.CROWDTRAIN = {**settings.CROWDTRAIN, "SHARD_SAMPLES": 4}
    files = {**class_images("train/", 3), **class_images("test/", 1, ("dog", "cat"))}
    files["train/dog/extra.jpg"] = image_bytes(COLOURS["dog"], size=(20, 10), format="JPEG")
    files["train/emu/palette.png"] = image_bytes(COLOURS["emu"], mode="P")
    dataset = dataset_create(owner=owner, name="pets", parsed=parse(zip_of(files)))

    assert (dataset.kind, dataset.input_shape, dataset.target_shape) == ("classes", [3, 4, 4], [])
    assert (dataset.num_classes, dataset.labels) == (3, ["cat", "dog", "emu"])
    assert (dataset.train_samples, dataset.test_samples) == (11, 2)
    assert list(dataset.shards.filter(split="train").values_list("count", flat=True)) == [4, 4, 3]
    for split in ("train", "test"):
        x, y = dataset_load_split(dataset=dataset, split=split)
        assert x.dtype == np.float32 and x.shape == (len(y), 3, 4, 4) and y.dtype == np.int32
        expected = np.array([COLOURS[dataset.labels[label]] for label in y], np.float32) / 255
        # JPEG is lossy: its colours are only close.
        np.testing.assert_allclose(x.mean(axis=(2, 3)), expected, atol=0.05)
    assert (
        sorted(dataset_load_split(dataset=dataset, split="train")[1].tolist()) == [0] * 3 + [1] * 4 + [2] * 4
    )


def test_samples_are_shuffled_so_work_units_mix_classes(owner: User) -> None:
    dataset = dataset_create(
        owner=owner,
        name="mixed",
        parsed=parse(zip_of({**class_images("train/", 10), **class_images("test/", 1)})),
    )
    y = dataset_load_split(dataset=dataset, split="train")[1].tolist()
    assert sorted(y) == [0] * 10 + [1] * 10 + [2] * 10
    assert y != sorted(y) and len(set(y[:10])) == 3
    again = dataset_create(
        owner=owner,
        name="again",
        parsed=parse(zip_of({**class_images("train/", 10), **class_images("test/", 1)})),
    )
    assert dataset_load_split(dataset=again, split="train")[1].tolist() == y  # seeded: the same order


def test_one_root_of_class_folders_gets_a_held_out_tenth(owner: User) -> None:
    files = class_images("photos/", 10)  # zipped folder: one wrapping folder is dropped
    files["__MACOSX/photos/cat/._000.png"] = b"resource fork"
    files["photos/.DS_Store"] = b"finder"
    dataset = dataset_create(
        owner=owner, name="root", parsed=parse(zip_of(files), channels=1, height=2, width=3)
    )

    assert (dataset.input_shape, dataset.labels) == ([1, 2, 3], ["cat", "dog", "emu"])
    assert (dataset.train_samples, dataset.test_samples) == (27, 3)
    x, y = dataset_load_split(dataset=dataset, split="train")
    grey = {0: 0.299 * 255, 1: 0.587 * 255, 2: 0.114 * 255}  # Pillow's L conversion of pure colours
    np.testing.assert_allclose(x[:, 0, 0, 0], [round(grey[int(label)]) / 255 for label in y], atol=1 / 255)


BAD_ZIPS: dict[str, tuple[Callable[[], bytes], str]] = {
    "not a zip": (lambda: b"plain text", "This is not a .zip file"),
    "no images": (lambda: zip_of({}, folders=("train/", "train/cat/")), "holds no images"),
    "corrupt image": (
        lambda: zip_of({**class_images("", 2), "cat/bad.png": b"\x89PNG\r\n\x1a\nnot really"}),
        "Cannot decode cat/bad.png",
    ),
    "truncated image": (
        lambda: zip_of({**class_images("", 2), "dog/cut.png": image_bytes(size=(40, 40))[:80]}),
        "Cannot decode dog/cut.png",
    ),
    "a GIF named .png": (
        lambda: zip_of({**class_images("", 2), "dog/anim.png": image_bytes(format="GIF")}),
        "Cannot decode dog/anim.png",
    ),
    "CMYK JPEG": (
        lambda: zip_of({**class_images("", 2), "cat/print.jpg": image_bytes(mode="CMYK", format="JPEG")}),
        "cat/print.jpg has mode CMYK",
    ),
    "16-bit PNG": (
        lambda: zip_of({**class_images("", 2), "cat/deep.png": image_bytes(mode="I;16")}),
        "cat/deep.png has mode I;16",
    ),
    "image bomb over our limit": (
        lambda: zip_of({**class_images("", 2), "cat/big.png": png_declaring(5000, 5000)}),
        "cat/big.png is 5000x5000 pixels; an image may have at most 16,777,216 pixels (refused before",
    ),
    "image bomb over Pillow's limit": (
        lambda: zip_of({**class_images("", 2), "cat/huge.png": png_declaring(100_000, 100_000)}),
        "could be decompression bomb",
    ),
    "empty class folder": (
        lambda: zip_of(class_images("train/", 2), folders=("train/fox/",)),
        "The class folder train/fox has no images",
    ),
    "empty test class folder": (
        lambda: zip_of({**class_images("train/", 2), **class_images("test/", 1)}, folders=("test/fox/",)),
        "The class folder test/fox has no images",
    ),
    "one class": (
        lambda: zip_of(class_images("", 3, ("cat",))),
        "At least 2 class folders are needed; found 1",
    ),
    "a test class train lacks": (
        lambda: zip_of({**class_images("train/", 2, ("cat", "dog")), **class_images("test/", 1)}),
        "test/emu is a class that train/ does not have",
    ),
    "test without train": (lambda: zip_of(class_images("test/", 2)), "Use train/<class>/<image>"),
    "train beside class folders": (
        lambda: zip_of({**class_images("train/", 2), **class_images("", 1)}),
        "top-level folders are: cat, dog, emu, train",
    ),
    "image too deep": (
        lambda: zip_of({**class_images("train/", 2), "train/cat/sub/x.png": image_bytes()}),
        "train/cat/sub/x.png: images go in train/<class>/<image>",
    ),
    "loose file at the root": (
        lambda: zip_of({**class_images("", 2), "readme.png": image_bytes()}),
        "readme.png: images go in <class>/<image>",
    ),
    "not an image": (
        lambda: zip_of({**class_images("", 2), "cat/notes.txt": b"hi"}),
        "is not a .png or .jpg",
    ),
    "zip bomb": (
        lambda: zip_of(
            {f"{c}/{i}.png": bytes(20 * 2**20) for c in ("a", "b") for i in range(2)}, compress=True
        ),
        "Refused as a possible zip bomb",
    ),
    "lying directory": (lambda: _lying_directory(), "The zip file is damaged"),
}


def _lying_directory() -> bytes:
    """The central directory declares one image smaller than its data: inflating stops there (CRC error)."""
    data = bytearray(zip_of(class_images("", 2), compress=True))
    entry = data.rfind(b"PK\x01\x02")  # the last image's directory entry
    struct.pack_into("<I", data, entry + 24, 10)
    return bytes(data)


@pytest.mark.parametrize("case", list(BAD_ZIPS))
def test_bad_image_zip_is_refused_and_stores_nothing(owner: User, case: str) -> None:
    make, message = BAD_ZIPS[case]
    with pytest.raises(DatasetError, match=re.escape(message)):
        parse(make())
    assert (Dataset.objects.count(), DatasetShard.objects.count(), Blob.objects.count()) == (0, 0, 0)


@pytest.mark.parametrize(
    "limit, value, message",
    [
        ("MAX_DATASET_IMAGES", 5, "The zip holds 6 images; the limit is 5"),
        ("MAX_IMAGE_BYTES", 50, "an image may be at most 50"),
        ("MAX_IMAGE_PIXELS", 20, "an image may have at most 20 pixels"),
        ("MAX_DATASET_ARRAY_BYTES", 1000, "the limit is 1,000 bytes"),
    ],
)
def test_image_limits_are_settings(settings: Any, limit: str, value: int, message: str) -> None:
    settings.CROWDTRAIN = {**settings.CROWDTRAIN, limit: value}
    with pytest.raises(DatasetError, match=re.escape(message)):
        parse(zip_of(class_images("", 2)))


@pytest.mark.parametrize(
    "shape, message",
    [((2, 4, 4), "1 (grayscale) or 3 (RGB) channels, not 2"), ((1, 0, 4), "between 1 and 1024; got 0x4")],
)
def test_the_declared_shape_is_checked(shape: tuple[int, int, int], message: str) -> None:
    with pytest.raises(DatasetError, match=re.escape(message)):
        parse(zip_of(class_images("", 2)), *shape)


def test_too_many_directory_entries_are_refused_before_parsing(settings: Any) -> None:
    settings.CROWDTRAIN = {**settings.CROWDTRAIN, "MAX_DATASET_IMAGES": 2}
    with pytest.raises(DatasetError, match="The zip lists too many files"):
        parse(zip_of({f"c{i % 2}/{'n' * 200}{i}.png": b"" for i in range(10)}))
