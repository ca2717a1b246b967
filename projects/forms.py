"""Admin forms: create a dataset from an .npz upload, and a project from a preset plus a dataset."""

from __future__ import annotations

from typing import Any

from django import forms
from django.conf import settings
from django.contrib.auth.models import User
from django.core.files.uploadedfile import UploadedFile
from django.db import transaction

from engine.presets import PRESETS
from projects.datasets import DatasetError, ParsedDataset, dataset_create, dataset_parse_npz
from projects.models import Dataset, Project
from projects.services import TRAINING_SETTINGS, project_create


def preset_choices() -> list[tuple[str, str]]:
    return [(name, f"{name} — {spec.description}") for name, spec in PRESETS.items()]


def parse_upload(upload: UploadedFile) -> ParsedDataset:
    """Read and validate an uploaded .npz; the size is checked before anything is read."""
    limit = settings.CROWDTRAIN["MAX_DATASET_BYTES"]
    if upload.size is not None and upload.size > limit:
        raise forms.ValidationError(f"The file is {upload.size:,} bytes; the limit is {limit:,} bytes.")
    try:
        return dataset_parse_npz(data=upload.read())
    except DatasetError as exc:
        raise forms.ValidationError(str(exc)) from exc


def preset_mismatch(*, preset: str, input_shape: list[int], num_classes: int) -> str:
    """Why a dataset cannot train a preset ('' if it can)."""
    spec = PRESETS[preset]
    if spec.target != "class":
        return f"The {preset} preset needs sequence targets; .npz datasets have one class label per sample."
    if list(spec.input_shape) != list(input_shape):
        expected = list(spec.input_shape)
        return f"The {preset} preset expects samples of shape {expected}; the dataset has {input_shape}."
    if num_classes > spec.classes:
        return f"The {preset} preset has {spec.classes} outputs; the dataset has {num_classes} classes."
    return ""


class DatasetAddForm(forms.ModelForm):
    file = forms.FileField(
        label=".npz file",
        help_text="Arrays x, y and optionally x_test, y_test (see projects/datasets.py). No pickles.",
        widget=forms.ClearableFileInput(attrs={"accept": ".npz"}),
    )

    class Meta:
        model = Dataset
        fields = ["name"]

    def clean_file(self) -> UploadedFile:
        self.parsed = parse_upload(self.cleaned_data["file"])
        return self.cleaned_data["file"]

    def create(self, *, owner: User) -> Dataset:
        return dataset_create(owner=owner, name=self.cleaned_data["name"], parsed=self.parsed)


class ProjectAddForm(forms.ModelForm):
    """Everything needed to call project_create; `owner` is set by the admin on a per-request subclass."""

    owner: User | None = None

    preset = forms.ChoiceField(choices=preset_choices, help_text="The model architecture to train.")
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

    class Meta:
        model = Project
        fields = ["name", "description", *TRAINING_SETTINGS]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        datasets = Dataset.objects.order_by("-created_at")
        if self.owner is not None and not getattr(self.owner, "is_superuser", False):
            datasets = datasets.filter(owner=self.owner)
        self.fields["dataset"].queryset = datasets  # type: ignore[attr-defined]
        self.parsed: ParsedDataset | None = None

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
        self._check_preset_fits(cleaned)
        return cleaned

    def _check_preset_fits(self, cleaned: dict[str, Any]) -> None:
        source = cleaned.get("dataset") or self.parsed
        if source is None or not cleaned.get("preset"):
            return
        problem = preset_mismatch(
            preset=cleaned["preset"], input_shape=source.input_shape, num_classes=source.num_classes
        )
        if problem:
            self.add_error("preset", problem)

    @transaction.atomic
    def create(self, *, owner: User) -> Project:
        """Store the uploaded dataset (if any) and create the project, all or nothing."""
        data = self.cleaned_data
        return project_create(
            owner=owner,
            name=data["name"],
            description=data["description"],
            dataset=data["dataset"] or self._store_upload(owner=owner),
            preset=data["preset"],
            settings={key: data[key] for key in TRAINING_SETTINGS},
        )

    def _store_upload(self, *, owner: User) -> Dataset:
        assert self.parsed is not None  # clean() guarantees a dataset or a valid upload
        name = self.cleaned_data["dataset_name"] or self.cleaned_data["dataset_file"].name
        return dataset_create(owner=owner, name=name, parsed=self.parsed)
