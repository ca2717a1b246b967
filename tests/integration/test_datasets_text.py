"""Text corpora for character- and byte-level language models: samples of T tokens labelled with the next
token, split by position; the demo text trains the gpt preset; bad texts are refused and store nothing."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest
from django.contrib.auth.models import User

from projects import datasets
from projects.datasets import DatasetError, dataset_create, dataset_load_split, dataset_parse_text
from projects.demo import DEMO_TEXT
from projects.forms import preset_mismatch
from projects.models import Blob, Dataset, DatasetShard, Project
from projects.services import ProjectError, project_create, version_evaluate


@pytest.fixture
def owner(db: None) -> User:
    return User.objects.create_user("text-owner", password="owner-pass-123", is_staff=True)


def text_dataset(owner: User, text: str | bytes, block: int, vocabulary: str = "chars") -> Dataset:
    data = text.encode() if isinstance(text, str) else text
    parsed = dataset_parse_text(data=data, block_size=block, vocabulary=vocabulary)
    return dataset_create(owner=owner, name="text", parsed=parsed)


def decoded(dataset: Dataset, ids: np.ndarray) -> str:
    return "".join(dataset.labels[i] for i in ids.reshape(-1).tolist())


def test_characters_become_next_token_samples_split_by_position(owner: User) -> None:
    text = "the quick brown fox jumps over the lazy dog. " * 3  # 135 characters
    dataset = text_dataset(owner, text, block=8)

    assert (dataset.kind, dataset.input_shape, dataset.target_shape) == ("tokens", [8], [8])
    assert dataset.labels == sorted(set(text)) and dataset.num_classes == len(set(text))
    # The last tenth of the text (13 characters, at least a block and its next token) is the test split;
    # samples do not overlap and each needs its next character.
    assert (dataset.train_samples, dataset.test_samples) == ((122 - 1) // 8, (13 - 1) // 8)
    x, y = dataset_load_split(dataset=dataset, split="train")
    assert x.dtype == y.dtype == np.int32 and x.shape == y.shape == (15, 8)
    assert decoded(dataset, x) == text[:120]
    assert decoded(dataset, y) == text[1:121]
    test_x, test_y = dataset_load_split(dataset=dataset, split="test")
    assert decoded(dataset, test_x) == text[122:130] and decoded(dataset, test_y) == text[123:131]


def test_bytes_are_their_own_token_ids(owner: User) -> None:
    text = "naïve café, déjà vu — " * 4
    dataset = text_dataset(owner, text, block=5, vocabulary="bytes")
    raw = np.frombuffer(text.encode(), np.uint8)

    assert (dataset.num_classes, dataset.labels) == (256, [])
    x, y = dataset_load_split(dataset=dataset, split="train")
    np.testing.assert_array_equal(x.reshape(-1), raw[: x.size])
    np.testing.assert_array_equal(y.reshape(-1), raw[1 : x.size + 1])


def test_characters_split_between_read_chunks_decode_whole(owner: User, monkeypatch: Any) -> None:
    monkeypatch.setattr(datasets, "READ_CHUNK", 7)  # cuts the 2- and 3-byte characters apart
    text = "\ufeff" + "αβγ→δε " * 20  # a byte-order mark first: dropped
    dataset = text_dataset(owner, text, block=4)

    assert "\ufeff" not in dataset.labels and set(dataset.labels) == set(text) - {"\ufeff"}
    x, _ = dataset_load_split(dataset=dataset, split="train")
    assert decoded(dataset, x) == text[1 : 1 + x.size]


BAD_TEXTS: dict[str, tuple[bytes, dict[str, Any], str]] = {
    "not UTF-8": (b"hello world " * 10 + b"\xff\xfe" + b"more", {}, "not UTF-8 text: byte 120"),
    "Latin-1": ("café ".encode("latin-1") * 20, {}, "not UTF-8 text: byte 3"),
    "truncated character at the end": (b"abcdefgh" * 4 + "é".encode()[:1], {}, "byte 32 cannot be decoded"),
    "empty": (b"", {}, "The text file is empty"),
    "shorter than a block": (b"abcdef", {"block_size": 8}, "too short for blocks of 8"),
    "no room for a test block": (b"abcdefghijklmnop", {"block_size": 8}, "At least 18 are needed"),
    "one distinct character": (b"a" * 100, {}, "The text has 1 distinct characters; between 2 and"),
    "block size 0": (b"abc" * 30, {"block_size": 0}, "between 1 and 4096; got 0"),
    "unknown vocabulary": (b"abc" * 30, {"vocabulary": "words"}, "'chars' or 'bytes', not 'words'"),
}


@pytest.mark.parametrize("case", list(BAD_TEXTS))
def test_bad_text_is_refused_and_stores_nothing(owner: User, case: str) -> None:
    data, options, message = BAD_TEXTS[case]
    with pytest.raises(DatasetError, match=re.escape(message)):
        dataset_parse_text(data=data, **{"block_size": 4, "vocabulary": "chars", **options})
    assert (Dataset.objects.count(), DatasetShard.objects.count(), Blob.objects.count()) == (0, 0, 0)


def test_stored_size_is_bounded_before_reading(settings: Any) -> None:
    settings.CROWDTRAIN = {**settings.CROWDTRAIN, "MAX_DATASET_ARRAY_BYTES": 800}
    with pytest.raises(DatasetError, match="take 808 bytes; the limit is 800"):
        dataset_parse_text(data=b"a" * 101, block_size=4)


def test_the_demo_text_trains_the_gpt_preset(owner: User) -> None:
    dataset = text_dataset(owner, DEMO_TEXT.read_bytes(), block=64)
    assert dataset.num_classes <= 65 and len(DEMO_TEXT.read_bytes()) > 20_000
    assert dataset.train_samples > 400 and dataset.test_samples > 40

    project = project_create(owner=owner, name="KJV GPT", dataset=dataset, preset="gpt")
    metrics = version_evaluate(version_id=project.current_version().pk)
    # An untrained model guesses uniformly among its 65 outputs.
    assert abs(metrics["test_loss"] - np.log(65)) < 0.5 and metrics["test_accuracy"] < 0.2


def test_token_datasets_fit_only_sequence_models(owner: User) -> None:
    bytes_dataset = text_dataset(owner, DEMO_TEXT.read_bytes()[:2000], block=64, vocabulary="bytes")
    with pytest.raises(ProjectError, match="The graph predicts 65 tokens; the dataset's vocabulary has 256"):
        project_create(owner=owner, name="too few outputs", dataset=bytes_dataset, preset="gpt")
    short_blocks = text_dataset(owner, DEMO_TEXT.read_bytes()[:2000], block=32)
    with pytest.raises(ProjectError, match=re.escape("expects samples of shape [64]; the dataset has [32]")):
        project_create(owner=owner, name="other block", dataset=short_blocks, preset="gpt")
    with pytest.raises(ProjectError, match="The graph expects samples of shape"):
        project_create(owner=owner, name="mlp on text", dataset=short_blocks, preset="mlp")
    assert not Project.objects.exists()

    assert preset_mismatch(preset="mlp", input_shape=[64], num_classes=59, kind="tokens") == (
        "The mlp preset needs one class label per sample; the dataset has token sequences (a text corpus)."
    )
    assert "has 65 outputs; the dataset has 256 tokens in its vocabulary" in str(
        preset_mismatch(preset="gpt", input_shape=[64], num_classes=256, kind="tokens")
    )
    assert preset_mismatch(preset="gpt", input_shape=[64], num_classes=59, kind="tokens") is None
