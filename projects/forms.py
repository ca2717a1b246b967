"""Admin forms: create a dataset from an upload (.npz arrays, a zip of image folders or a text corpus), and
a project from a preset (or an uploaded graph.json + weights.safetensors, e.g. from `manage.py export_model`)
plus a dataset."""

from __future__ import annotations

from collections.abc import Callable
from typing import IO, Any

import torch
from django import forms
from django.conf import settings
from django.contrib.auth.models import User
from django.core.files.uploadedfile import UploadedFile
from django.db import transaction

from engine import codecs
from engine.graph import MAX_ACTIVATION_BYTES, Graph, GraphError, activation_memory, load_graph
from engine.presets import PRESETS
from projects import stages
from projects.datasets import (
    MAX_BLOCK_SIZE,
    MAX_IMAGE_SIDE,
    DatasetError,
    ParsedDataset,
    dataset_create,
    dataset_parse_images,
    dataset_parse_npz,
    dataset_parse_text,
)
from projects.models import DEFAULT_MAX_ACTIVATION_MB, Dataset, Project
from projects.services import TRAINING_SETTINGS, graph_mismatch, project_create, project_create_from_graph

MAX_GRAPH_BYTES = 2 * 2**20
SOURCE_PRESET, SOURCE_UPLOAD = "preset", "upload"
Tensors = dict[str, torch.Tensor]


def preset_choices() -> list[tuple[str, str]]:
    return [(name, f"{name} — {spec.description}") for name, spec in PRESETS.items()]


def parse_upload(
    upload: UploadedFile, parse: Callable[[IO[bytes]], ParsedDataset] | None = None
) -> ParsedDataset:
    """Validate an uploaded dataset (an .npz unless `parse` says otherwise); the size is checked before
    anything is read. The file is parsed where Django put it (on disk above FILE_UPLOAD_MAX_MEMORY_SIZE), a
    chunk at a time, never read into memory whole."""
    limit = settings.CROWDTRAIN["MAX_DATASET_BYTES"]
    if upload.size is not None and upload.size > limit:
        raise forms.ValidationError(f"The file is {upload.size:,} bytes; the limit is {limit:,} bytes.")
    if upload.file is None:
        raise forms.ValidationError("The upload is empty.")
    try:
        return parse(upload.file) if parse else dataset_parse_npz(data=upload.file)
    except DatasetError as exc:
        raise forms.ValidationError(str(exc)) from exc


PRESET_KINDS = {"class": Dataset.Kind.CLASSES, "sequence": Dataset.Kind.TOKENS}
KIND_WORDS = {
    Dataset.Kind.CLASSES: "one class label per sample",
    Dataset.Kind.TOKENS: "token sequences (a text corpus)",
    Dataset.Kind.REGRESSION: "float targets",
}


def preset_mismatch(
    *, preset: str, input_shape: list[int], num_classes: int, kind: str = Dataset.Kind.CLASSES
) -> str | None:
    """Why a dataset cannot train a preset (None if it can)."""
    spec = PRESETS[preset]
    wanted, has = PRESET_KINDS[spec.target], Dataset.Kind(kind)
    if wanted != has:
        hint = (
            " (a model with an mse or l1 loss fits them: upload one)"
            if has == Dataset.Kind.REGRESSION
            else ""
        )
        return f"The {preset} preset needs {KIND_WORDS[wanted]}; the dataset has {KIND_WORDS[has]}{hint}."
    if list(spec.input_shape) != list(input_shape):
        expected = list(spec.input_shape)
        return f"The {preset} preset expects samples of shape {expected}; the dataset has {input_shape}."
    if num_classes > spec.classes:
        what = "tokens in its vocabulary" if kind == Dataset.Kind.TOKENS else "classes"
        return f"The {preset} preset has {spec.classes} outputs; the dataset has {num_classes} {what}."
    return None


def read_limited(upload: UploadedFile, limit: int) -> bytes:
    """The upload's bytes; the size is checked before anything is read."""
    if upload.size is not None and upload.size > limit:
        raise forms.ValidationError(f"The file is {upload.size:,} bytes; the limit is {limit:,} bytes.")
    return upload.read()


def parse_graph_upload(upload: UploadedFile) -> Graph:
    try:
        return load_graph(read_limited(upload, MAX_GRAPH_BYTES))
    except GraphError as exc:
        raise forms.ValidationError(f"Invalid model graph: {exc}") from exc


def parse_weights_upload(upload: UploadedFile) -> Tensors:
    """safetensors only, through engine.codecs: nothing uploaded is ever unpickled (no torch.load).
    The header's declared length is checked from its first 8 bytes, before the file is read."""
    max_header = settings.CROWDTRAIN["MAX_TENSOR_HEADER_BYTES"]
    try:
        codecs.check_header_length(upload.read(8), max_header)
        upload.seek(0)
        return codecs.decode(read_limited(upload, settings.CROWDTRAIN["MAX_RESULT_BYTES"]), max_header)[0]
    except codecs.CodecError as exc:
        raise forms.ValidationError(f"Not a usable safetensors file: {exc}") from exc


def weights_mismatch(*, graph: Graph, weights: Tensors) -> str | None:
    """Why `weights` cannot be the graph's params + buffers (None if they can), naming the first culprit."""
    specs = {spec.name: spec.shape for spec in (*graph.params, *graph.buffers)}
    for name, shape in specs.items():
        tensor = weights.get(name)
        if tensor is None:
            return f"The weights have no tensor '{name}' (the graph needs shape {list(shape)})."
        if tuple(tensor.shape) != tuple(shape):
            return f"Tensor '{name}' has shape {list(tensor.shape)}; the graph says {list(shape)}."
        if not tensor.is_floating_point() or not bool(torch.isfinite(tensor).all()):
            return f"Tensor '{name}' must hold finite float values."
    extra = sorted(set(weights) - set(specs))
    return f"Tensor '{extra[0]}' is not a param or buffer of the graph." if extra else None


FORMAT_NPZ, FORMAT_IMAGES, FORMAT_TEXT = "npz", "images", "text"
IMAGE_DEFAULTS = {"channels": 1, "height": 28, "width": 28}
TEXT_DEFAULTS = {"block_size": 64, "vocabulary": "chars"}


class DatasetAddForm(forms.ModelForm):
    """A dataset from one uploaded file, in one of three formats (projects/datasets.py); the fields of the
    other formats are ignored. Everything is checked in clean(): an invalid upload saves nothing."""

    format = forms.ChoiceField(
        choices=[
            (FORMAT_NPZ, ".npz arrays: x, y (class labels or float targets), optionally x_test, y_test"),
            (
                FORMAT_IMAGES,
                "A .zip of image folders: train/<class>/*.png|jpg (+ test/<class>/…) or <class>/…",
            ),
            (FORMAT_TEXT, "A UTF-8 .txt corpus, for character- or byte-level language models"),
        ],
        initial=FORMAT_NPZ,
        required=False,  # forms posted before the choice existed upload .npz files
        widget=forms.RadioSelect,
    )
    file = forms.FileField(
        label="File",
        help_text="An .npz, a .zip or a .txt, as the format says. Nothing in it is ever unpickled or run.",
        widget=forms.ClearableFileInput(attrs={"accept": ".npz,.zip,.txt"}),
    )
    channels = forms.TypedChoiceField(
        choices=[(1, "1 (grayscale)"), (3, "3 (RGB)")],
        coerce=int,
        initial=IMAGE_DEFAULTS["channels"],
        required=False,
        help_text="Every image is converted to this many channels…",
    )
    height = forms.IntegerField(
        min_value=1, max_value=MAX_IMAGE_SIDE, initial=IMAGE_DEFAULTS["height"], required=False
    )
    width = forms.IntegerField(
        min_value=1,
        max_value=MAX_IMAGE_SIDE,
        initial=IMAGE_DEFAULTS["width"],
        required=False,
        help_text="…and resized to height x width pixels; values become float32 in [0, 1].",
    )
    block_size = forms.IntegerField(
        min_value=1,
        max_value=MAX_BLOCK_SIZE,
        initial=TEXT_DEFAULTS["block_size"],
        required=False,
        help_text="Tokens per sample (the gpt preset takes 64); each is labelled with the next token.",
    )
    vocabulary = forms.ChoiceField(
        choices=[("chars", "The text's distinct characters"), ("bytes", "Bytes (256 tokens)")],
        initial=TEXT_DEFAULTS["vocabulary"],
        required=False,
        help_text="The gpt preset predicts 65 tokens: a text of at most 65 distinct characters fits it.",
    )

    class Meta:
        model = Dataset
        fields = ["name"]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.parsed: ParsedDataset | None = None

    def clean(self) -> dict[str, Any]:
        super().clean()
        cleaned = self.cleaned_data
        upload = cleaned.get("file")
        if upload is not None and not self.errors:
            try:
                self.parsed = parse_upload(upload, self._parser(cleaned))
            except forms.ValidationError as exc:
                self.add_error("file", exc)
        return cleaned

    def _parser(self, cleaned: dict[str, Any]) -> Callable[[IO[bytes]], ParsedDataset] | None:
        """How to read the file: None for an .npz (parse_upload's default)."""
        values: dict[str, Any] = {**IMAGE_DEFAULTS, **TEXT_DEFAULTS}
        values.update({key: value for key, value in cleaned.items() if key in values and value})
        if cleaned.get("format") == FORMAT_IMAGES:
            shape = {key: int(values[key]) for key in IMAGE_DEFAULTS}
            return lambda data: dataset_parse_images(data=data, **shape)
        if cleaned.get("format") == FORMAT_TEXT:
            block, vocabulary = int(values["block_size"]), str(values["vocabulary"])
            return lambda data: dataset_parse_text(data=data, block_size=block, vocabulary=vocabulary)
        return None

    def create(self, *, owner: User) -> Dataset:
        assert self.parsed is not None  # clean() guarantees a parsed upload
        return dataset_create(owner=owner, name=self.cleaned_data["name"], parsed=self.parsed)


class ProjectChangeForm(forms.ModelForm):
    """The admin's change form: a running pipeline project's partition settings are refused, as the API
    refuses them (stages.pipeline_settings_check)."""

    class Meta:
        model = Project
        fields = "__all__"

    def clean(self) -> dict[str, Any]:
        super().clean()
        data = self.cleaned_data
        changes = {name: data[name] for name in self.changed_data if name in data}
        try:
            stages.pipeline_settings_check(project=self.instance, changes=changes)
        except stages.PipelineError as exc:
            raise forms.ValidationError(str(exc)) from None
        return data


class ProjectAddForm(forms.ModelForm):
    """Everything needed to call project_create; `owner` is set by the admin on a per-request subclass."""

    owner: User | None = None

    model_source = forms.ChoiceField(
        choices=[
            (SOURCE_PRESET, "A preset architecture"),
            (SOURCE_UPLOAD, "Upload graph.json + weights.safetensors (manage.py export_model)"),
        ],
        initial=SOURCE_PRESET,
        required=False,
        widget=forms.RadioSelect,
        label="Model source",
    )
    preset = forms.ChoiceField(
        choices=preset_choices, required=False, help_text="The model architecture to train."
    )
    graph_file = forms.FileField(
        label="graph.json",
        required=False,
        widget=forms.ClearableFileInput(attrs={"accept": ".json"}),
        help_text="The model graph (docs/graph-format.md), at most 2 MB.",
    )
    weights_file = forms.FileField(
        label="weights.safetensors",
        required=False,
        widget=forms.ClearableFileInput(attrs={"accept": ".safetensors"}),
        help_text="Initial params and buffers as safetensors (never pickles).",
    )
    dataset = forms.ModelChoiceField(
        queryset=Dataset.objects.none(),
        required=False,
        help_text="One of your datasets, or upload a new one.",
    )
    dataset_file = forms.FileField(
        label="…or upload an .npz", required=False, widget=forms.ClearableFileInput(attrs={"accept": ".npz"})
    )
    dataset_name = forms.CharField(
        max_length=200, required=False, help_text="Name of the uploaded dataset (default: the file name)."
    )
    max_activation_mb = forms.IntegerField(
        label="Max activation MiB",
        required=False,
        min_value=1,
        max_value=MAX_ACTIVATION_BYTES // 2**20,
        help_text=f"{Project._meta.get_field('max_activation_mb').help_text} Default "
        f"{DEFAULT_MAX_ACTIVATION_MB}.",
    )

    class Meta:
        model = Project
        fields = ["name", "description", "max_activation_mb", *TRAINING_SETTINGS]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        datasets = Dataset.objects.order_by("-created_at")
        if self.owner is not None and not getattr(self.owner, "is_superuser", False):
            datasets = datasets.filter(owner=self.owner)
        self.fields["dataset"].queryset = datasets  # type: ignore[attr-defined]
        self.parsed: ParsedDataset | None = None
        self.graph: Graph | None = None
        self.weights: Tensors | None = None

    @property
    def uploads_model(self) -> bool:
        # Blank counts as "preset": forms posted before the choice existed keep working.
        return self.cleaned_data.get("model_source") == SOURCE_UPLOAD

    def clean_max_activation_mb(self) -> int:
        return self.cleaned_data.get("max_activation_mb") or DEFAULT_MAX_ACTIVATION_MB

    def clean_graph_file(self) -> UploadedFile | None:
        upload = self.cleaned_data.get("graph_file")
        if upload and self.uploads_model:
            self.graph = parse_graph_upload(upload)
        return upload

    def clean_weights_file(self) -> UploadedFile | None:
        upload = self.cleaned_data.get("weights_file")
        if upload and self.uploads_model:
            self.weights = parse_weights_upload(upload)
        return upload

    def clean_dataset_file(self) -> UploadedFile | None:
        upload = self.cleaned_data.get("dataset_file")
        if upload:
            self.parsed = parse_upload(upload)
        return upload

    def clean(self) -> dict[str, Any]:
        super().clean()
        cleaned = self.cleaned_data
        dataset, upload = cleaned.get("dataset"), cleaned.get("dataset_file")
        if bool(dataset) == bool(upload) and "dataset_file" not in self.errors:
            self.add_error("dataset", "Choose an existing dataset or upload an .npz file (exactly one).")
        if self.uploads_model:
            self._check_uploaded_model(cleaned)
        else:
            self._check_preset_fits(cleaned)
        return cleaned

    def _check_uploaded_model(self, cleaned: dict[str, Any]) -> None:
        for field in ("graph_file", "weights_file"):
            if not cleaned.get(field) and field not in self.errors:
                self.add_error(field, "Upload this file, or choose a preset as the model source.")
        if self.graph is None or self.weights is None:
            return  # missing or already reported on its field
        problem = weights_mismatch(graph=self.graph, weights=self.weights)
        if problem:
            self.add_error("weights_file", problem)
        elif not self._activations_fit(self.graph, cleaned.get("max_activation_mb")):
            return
        else:
            self._check_graph_fits(self.graph, cleaned.get("dataset") or self.parsed)

    def _activations_fit(self, graph: Graph, max_mb: int | None) -> bool:
        if max_mb is None:
            return False  # reported on its field
        try:
            activation_memory(graph).check(max_mb * 2**20)
        except GraphError as exc:
            self.add_error("graph_file", f"The model is too large for this project: {exc}")
            return False
        return True

    def _check_graph_fits(self, graph: Graph, source: Dataset | ParsedDataset | None) -> None:
        if source is None:
            return  # the dataset error is reported already
        problem = graph_mismatch(
            graph=graph,
            input_shape=source.input_shape,
            num_classes=source.num_classes,
            kind=source.kind,
            target_shape=list(source.target_shape),
        )
        if problem:
            self.add_error("graph_file", problem)

    def _check_preset_fits(self, cleaned: dict[str, Any]) -> None:
        if not cleaned.get("preset") and "preset" not in self.errors:
            self.add_error("preset", "Choose a preset, or upload a graph and weights as the model source.")
        source = cleaned.get("dataset") or self.parsed
        if source is None or not cleaned.get("preset"):
            return
        problem = preset_mismatch(
            preset=cleaned["preset"],
            input_shape=source.input_shape,
            num_classes=source.num_classes,
            kind=source.kind,
        )
        if problem:
            self.add_error("preset", problem)

    @transaction.atomic
    def create(self, *, owner: User) -> Project:
        """Store the uploaded dataset (if any) and create the project, all or nothing."""
        data = self.cleaned_data
        common = {
            "owner": owner,
            "name": data["name"],
            "description": data["description"],
            "dataset": data["dataset"] or self._store_upload(owner=owner),
            "settings": {key: data[key] for key in TRAINING_SETTINGS},
            "max_activation_mb": data["max_activation_mb"],
        }
        if not self.uploads_model:
            return project_create(preset=data["preset"], **common)
        assert self.graph is not None and self.weights is not None  # clean() guarantees both
        return project_create_from_graph(graph_dict=self.graph.to_dict(), weights=self.weights, **common)

    def _store_upload(self, *, owner: User) -> Dataset:
        assert self.parsed is not None  # clean() guarantees a dataset or a valid upload
        name = self.cleaned_data["dataset_name"] or self.cleaned_data["dataset_file"].name
        return dataset_create(owner=owner, name=name, parsed=self.parsed)
