"""Projects, datasets, model versions, work units and results: everything training depends on lives here."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

from django.conf import settings
from django.db import models
from django.utils import timezone


class Blob(models.Model):
    """Immutable bytes addressed by their SHA-256: weights, graphs, shards, updates."""

    sha256 = models.CharField(max_length=64, primary_key=True)
    size = models.BigIntegerField()
    content_type = models.CharField(max_length=100, default="application/octet-stream")
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"{self.sha256[:12]} ({self.size} B)"

    @property
    def url(self) -> str:
        return f"/blobs/{self.sha256}"

    @property
    def path(self) -> Path:
        return Path(settings.BLOB_ROOT) / self.sha256[:2] / self.sha256

    def read(self) -> bytes:
        return self.path.read_bytes()


class Dataset(models.Model):
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="datasets")
    name = models.CharField(max_length=200)
    input_shape = models.JSONField(help_text="Shape of one sample, e.g. [784] or [1, 28, 28].")
    num_classes = models.PositiveIntegerField()
    train_samples = models.PositiveIntegerField()
    test_samples = models.PositiveIntegerField()
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"{self.name} ({self.train_samples} train / {self.test_samples} test)"


class DatasetShard(models.Model):
    class Split(models.TextChoices):
        TRAIN = "train"
        TEST = "test"

    dataset = models.ForeignKey(Dataset, on_delete=models.CASCADE, related_name="shards")
    split = models.CharField(max_length=5, choices=Split.choices)
    index = models.PositiveIntegerField()
    count = models.PositiveIntegerField()
    blob = models.ForeignKey(Blob, on_delete=models.PROTECT, related_name="+")

    class Meta:
        constraints = [models.UniqueConstraint(fields=["dataset", "split", "index"], name="unique_shard")]
        ordering = ["dataset", "split", "index"]


class Project(models.Model):
    class Status(models.TextChoices):
        DRAFT = "draft"
        RUNNING = "running"
        PAUSED = "paused"
        FINISHED = "finished"

    class Mode(models.TextChoices):
        SYNC_SGD = "sync_sgd", "Synchronous SGD"

    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="projects")
    name = models.CharField(max_length=200, unique=True)
    description = models.TextField(blank=True)
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.DRAFT)
    dataset = models.ForeignKey(Dataset, on_delete=models.PROTECT, related_name="projects")
    preset = models.CharField(max_length=50, blank=True, help_text="Preset the model was built from, if any.")
    graph = models.ForeignKey(Blob, on_delete=models.PROTECT, related_name="+")
    flops_per_sample = models.BigIntegerField(help_text="Forward + backward FLOPs for one training sample.")
    mode = models.CharField(max_length=20, choices=Mode.choices, default=Mode.SYNC_SGD)
    learning_rate = models.FloatField(default=0.1)
    momentum = models.FloatField(default=0.9)
    weight_decay = models.FloatField(default=0.0)
    batch_size = models.PositiveIntegerField(default=64, help_text="Samples in one work unit.")
    round_samples = models.PositiveIntegerField(default=256, help_text="Samples averaged per server step.")
    max_versions = models.PositiveIntegerField(default=100000, help_text="Stop after this many steps.")
    priority = models.PositiveIntegerField(default=1)
    # Next training sample to hand out; work units walk the training split in order, epoch after epoch.
    data_cursor = models.PositiveBigIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return self.name

    @property
    def is_running(self) -> bool:
        return self.status == self.Status.RUNNING

    def current_version(self) -> ModelVersion:
        return self.versions.order_by("-number").first()  # type: ignore[return-value]

    def work_units_per_round(self) -> int:
        return -(-self.round_samples // self.batch_size)


class ModelVersion(models.Model):
    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="versions")
    number = models.PositiveIntegerField()
    weights = models.ForeignKey(Blob, on_delete=models.PROTECT, related_name="+")
    optimizer_state = models.ForeignKey(
        Blob, on_delete=models.PROTECT, related_name="+", null=True, blank=True
    )
    train_loss = models.FloatField(null=True, blank=True)
    samples = models.PositiveIntegerField(default=0, help_text="Samples aggregated into this version.")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["project", "number"], name="unique_version")]
        ordering = ["project", "number"]

    def __str__(self) -> str:
        return f"{self.project} v{self.number}"


class WorkUnit(models.Model):
    class Status(models.TextChoices):
        READY = "ready"
        ASSIGNED = "assigned"
        DONE = "done"
        CANCELLED = "cancelled"
        EXPIRED = "expired"

    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="work_units")
    version = models.ForeignKey(ModelVersion, on_delete=models.CASCADE, related_name="work_units")
    shard = models.ForeignKey(DatasetShard, on_delete=models.PROTECT, related_name="+")
    offset = models.PositiveIntegerField()
    count = models.PositiveIntegerField()
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.READY, db_index=True)
    assigned_to = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True, related_name="work_units"
    )
    assigned_at = models.DateTimeField(null=True, blank=True)
    deadline = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        indexes = [models.Index(fields=["project", "status"])]

    def __str__(self) -> str:
        return f"WU {self.pk} ({self.project}, v{self.version.number}, {self.status})"

    def assign(self, user: models.Model, seconds: int) -> None:
        self.status = self.Status.ASSIGNED
        self.assigned_to = user  # type: ignore[assignment]
        self.assigned_at = timezone.now()
        self.deadline = self.assigned_at + timedelta(seconds=seconds)

    def is_open_for(self, user: models.Model) -> bool:
        return self.status == self.Status.ASSIGNED and self.assigned_to_id == user.pk


class Result(models.Model):
    class Status(models.TextChoices):
        ACCEPTED = "accepted"
        REJECTED = "rejected"

    work_unit = models.ForeignKey(WorkUnit, on_delete=models.CASCADE, related_name="results")
    volunteer = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="results")
    blob = models.ForeignKey(Blob, on_delete=models.PROTECT, related_name="+", null=True, blank=True)
    status = models.CharField(max_length=10, choices=Status.choices)
    reason = models.CharField(max_length=200, blank=True)
    samples = models.PositiveIntegerField()
    loss = models.FloatField(null=True, blank=True)
    compute_ms = models.PositiveIntegerField(default=0)
    aggregated = models.BooleanField(default=False)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["work_unit", "volunteer"], name="one_result_per_volunteer")
        ]


class Metric(models.Model):
    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="metrics")
    version = models.ForeignKey(ModelVersion, on_delete=models.CASCADE, related_name="metrics")
    name = models.CharField(max_length=50)
    value = models.FloatField()
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["version", "name"], name="one_metric_per_version")]
        ordering = ["project", "created_at"]
