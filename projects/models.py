"""Projects, datasets, model versions, work units and results: everything training depends on lives here."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.files import File
from django.core.files.storage import storages
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models
from django.db.models import Q
from django.urls import reverse
from django.utils import timezone

from engine.graph import MAX_ACTIVATION_BYTES

# A project's default bound on activations per training sample: 4x what the largest preset needs.
DEFAULT_MAX_ACTIVATION_MB = 64


class PrunedError(LookupError):
    """The weights of a version pruned from storage were asked for (only every Kth, the best and the latest
    versions keep theirs: projects/storage.py)."""


class Blob(models.Model):
    """Immutable bytes addressed by their SHA-256: weights, graphs, shards, updates."""

    sha256 = models.CharField(max_length=64, primary_key=True)
    size = models.BigIntegerField()
    content_type = models.CharField(max_length=100, default="application/octet-stream")
    created_at = models.DateTimeField(auto_now_add=True)
    # Refreshed each time blob_put stores these bytes again: the garbage collector's grace period counts
    # from it, so a blob just stored for a row not yet committed is never collected (projects/storage.py).
    stored_at = models.DateTimeField(default=timezone.now, db_index=True)

    def __str__(self) -> str:
        return f"{self.sha256[:12]} ({self.size} B)"

    @property
    def url(self) -> str:
        return f"/blobs/{self.sha256}"

    @property
    def path(self) -> Path:
        """The local file (blobs in a bucket have none: projects/blob_store.py)."""
        return Path(settings.BLOB_ROOT) / self.sha256[:2] / self.sha256

    @staticmethod
    def storage_name(sha256: str) -> str:
        """Its name in STORAGES["blobs"]: a file under BLOB_ROOT, or an object in a bucket."""
        return f"{sha256[:2]}/{sha256}"

    def open(self) -> File:
        """Its bytes for reading, wherever they are stored; FileNotFoundError if they are missing."""
        return storages["blobs"].open(self.storage_name(self.sha256), "rb")

    def read(self) -> bytes:
        with self.open() as handle:
            return bytes(handle.read())


class Dataset(models.Model):
    class Kind(models.TextChoices):
        CLASSES = "classes", "One class label per sample"
        TOKENS = "tokens", "Token sequences, each position labelled with the next token"
        REGRESSION = "regression", "Float targets (regression, dense outputs)"

    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="datasets")
    name = models.CharField(max_length=200)
    kind = models.CharField(max_length=12, choices=Kind.choices, default=Kind.CLASSES)
    input_shape = models.JSONField(help_text="Shape of one sample, e.g. [1, 28, 28], or [64] token ids.")
    target_shape = models.JSONField(
        default=list,
        help_text="Shape of one target: [] for a class label, [T] for next tokens, any for floats.",
    )
    num_classes = models.PositiveIntegerField(
        help_text="Classes, or the vocabulary's size for tokens; 0 for float targets (no classes)."
    )
    labels = models.JSONField(
        default=list,
        blank=True,
        help_text="What each class id stands for, in id order: image folder names, or the characters of a "
        "character-level vocabulary. Empty when ids are plain numbers (.npz labels) or bytes.",
    )
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
        SYNC_SGD = "sync_sgd", "Synchronous SGD (gradients, one server step per round)"
        AVERAGING = "averaging", "Averaging (local steps, outer optimizer on averaged deltas)"
        ASYNC_SGD = "async_sgd", "Asynchronous SGD (applied on arrival, staleness-weighted)"
        PIPELINE = "pipeline", "Pipeline (the model cut into stages, GPipe micro-batches, one step each)"

    class Codec(models.TextChoices):
        FP32 = "fp32"
        FP16 = "fp16"
        INT8 = "int8", "int8 (blockwise, with error feedback)"
        INT4 = "int4", "int4 (blockwise 4-bit, with error feedback)"
        TOPK = "topk", "top-k (1 value in 64 per block of 4,096, with error feedback)"

    class WeightsCodec(models.TextChoices):
        """Weights are sent whole, so not sparse (topk would zero most of them)."""

        FP32 = "fp32"
        FP16 = "fp16"
        INT8 = "int8", "int8 (blockwise)"
        INT4 = "int4", "int4 (blockwise 4-bit)"

    class DeltaCodec(models.TextChoices):
        """New versions as their difference to the last, compressed; sparse is fine here (error feedback)."""

        NONE = "", "None: whole weights every version"
        INT8 = "int8", "int8 (blockwise)"
        INT4 = "int4", "int4 (blockwise 4-bit)"
        TOPK = "topk", "top-k (the largest 1 in 64 changes)"

    class Aggregator(models.TextChoices):
        MEAN = "mean", "Mean weighted by samples"
        TRIMMED_MEAN = "trimmed_mean", "Trimmed mean (drops the extremes per coordinate)"
        MEDIAN = "median", "Coordinate-wise median"

    class TargetMetric(models.TextChoices):
        TEST_ACCURACY = "test_accuracy", "Test accuracy (higher is better)"
        TEST_LOSS = "test_loss", "Test loss (lower is better)"

    class SpotCheckBy(models.TextChoices):
        SERVER = "server", "Recompute the update on the server"
        REPLICA = "replica", "Send the work unit to a second volunteer and compare the two updates"

    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="projects")
    name = models.CharField(max_length=200, unique=True)
    description = models.TextField(blank=True)
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.DRAFT)
    dataset = models.ForeignKey(Dataset, on_delete=models.PROTECT, related_name="projects")
    preset = models.CharField(max_length=50, blank=True, help_text="Preset the model was built from, if any.")
    graph = models.ForeignKey(Blob, on_delete=models.PROTECT, related_name="+")
    flops_per_sample = models.BigIntegerField(help_text="Forward + backward FLOPs for one training sample.")
    mode = models.CharField(max_length=20, choices=Mode.choices, default=Mode.SYNC_SGD)
    codec = models.CharField(
        max_length=10,
        choices=Codec.choices,
        default=Codec.INT8,
        help_text="How volunteers compress their updates on the wire.",
    )
    weights_codec = models.CharField(
        max_length=10,
        choices=WeightsCodec.choices,
        default=WeightsCodec.FP32,
        help_text="How model weights go down to volunteers; they train from exactly these (decoded) weights.",
    )
    weights_delta_codec = models.CharField(
        max_length=10,
        choices=DeltaCodec.choices,
        default=DeltaCodec.NONE,
        blank=True,
        help_text=(
            "Volunteers holding the previous version download the next as its difference, compressed; what "
            "that drops goes down with the next one. They train from exactly the weights the deltas build. "
            "Pipeline projects send their stages' weights whole."
        ),
    )
    aggregator = models.CharField(max_length=20, choices=Aggregator.choices, default=Aggregator.MEAN)
    learning_rate = models.FloatField(
        default=0.1, help_text="Server learning rate (outer rate in averaging)."
    )
    momentum = models.FloatField(
        default=0.9, help_text="Server momentum (outer Nesterov momentum in averaging)."
    )
    weight_decay = models.FloatField(default=0.0)
    local_learning_rate = models.FloatField(default=0.05, help_text="Averaging: the browsers' SGD rate.")
    local_momentum = models.FloatField(default=0.9, help_text="Averaging: the browsers' SGD momentum.")
    local_batch_size = models.PositiveIntegerField(
        default=64, help_text="Averaging: the mini-batch of each local step (work units hold many)."
    )
    batch_size = models.PositiveIntegerField(
        default=64, help_text="Largest work unit in samples (and the browsers' mini-batch in averaging)."
    )
    round_samples = models.PositiveIntegerField(
        default=256, help_text="Samples per server step: the round size, or the target batch size."
    )
    round_timeout = models.PositiveIntegerField(
        default=60, help_text="Seconds after which a round closes with whatever valid results arrived."
    )
    staleness_bound = models.PositiveIntegerField(
        default=4,
        help_text="Async and overlapping rounds: results computed on a version this many steps old or more "
        "are dropped.",
    )
    target_seconds = models.PositiveIntegerField(
        default=20, help_text="Work units are sized to take this long."
    )
    spot_check_rate = models.FloatField(
        default=0.1, help_text="Share of trusted volunteers' results that are spot-checked."
    )
    spot_check_by = models.CharField(
        max_length=10,
        choices=SpotCheckBy.choices,
        default=SpotCheckBy.SERVER,
        help_text="How a spot check is done: a server recomputation, or a replica on a second volunteer.",
    )
    trust_threshold = models.PositiveIntegerField(
        default=5, help_text="Consecutive valid results after which a volunteer is trusted."
    )
    max_activation_mb = models.PositiveIntegerField(
        default=DEFAULT_MAX_ACTIVATION_MB,
        validators=[MinValueValidator(1), MaxValueValidator(MAX_ACTIVATION_BYTES // 2**20)],
        help_text="Refuse models whose activations need more MiB than this per training sample (every node's "
        "output, twice for the backward pass; ResNet-18 on 32x32 needs 16).",
    )
    device_memory_mb = models.PositiveIntegerField(
        null=True,
        blank=True,
        help_text="Per-device memory budget in MiB (parameters, gradients, optimizer state, one "
        "micro-batch's activations): data-parallel modes refuse models over it, pipeline mode cuts them "
        "into stages under it.",
    )
    pipeline_stages = models.PositiveSmallIntegerField(
        default=0,
        validators=[MaxValueValidator(64)],
        help_text="Pipeline: stages the model is cut into; 0: the fewest that fit the per-device memory "
        "budget.",
    )
    micro_batches = models.PositiveSmallIntegerField(
        default=4,
        validators=[MinValueValidator(1), MaxValueValidator(64)],
        help_text="Pipeline: micro-batches of batch_size samples per step (GPipe's M).",
    )
    activation_codec = models.CharField(
        max_length=10,
        choices=[("fp32", "fp32"), ("fp16", "fp16"), ("int8", "int8")],
        default="fp16",
        help_text="Pipeline: how activations and their gradients travel (engine/activations.py).",
    )
    pipeline_ring = models.BooleanField(
        default=False,
        help_text="Pipeline: activations and their gradients go straight from one stage's volunteer to the "
        "next one's over WebRTC, with the server as the fallback. Peers see each other's network addresses.",
    )
    max_versions = models.PositiveIntegerField(default=100000, help_text="Stop after this many steps.")
    # Set by staff, never by the project's researcher: a researcher must not be able to starve other projects.
    resource_share = models.PositiveIntegerField(
        default=100,
        help_text="BOINC-style resource share: running projects get volunteer time in proportion.",
    )
    target_metric = models.CharField(
        max_length=20,
        choices=TargetMetric.choices,
        default=TargetMetric.TEST_ACCURACY,
        help_text="The metric that picks the best checkpoint and the ETA's goal.",
    )
    target_value = models.FloatField(
        null=True, blank=True, help_text="Goal for the target metric (e.g. 0.95 accuracy, or a loss of 0.1)."
    )
    crowd_rounds = models.BooleanField(
        default=False,
        help_text="Rounds grow with the volunteers connected: a work unit for each of them. Sync SGD shares "
        "round_samples (the target batch) between them; averaging sizes each unit to take target_seconds.",
    )
    overlap_rounds = models.BooleanField(
        default=False,
        help_text="Crowd-sized averaging: devices never wait for a round to close. Work in flight when it "
        "closes is folded into the next round (DiLoCo's one-step-delayed outer update; within "
        "staleness_bound), and every unit takes target_seconds.",
    )
    # Next training sample to hand out; work units walk the training split in order, epoch after epoch.
    data_cursor = models.PositiveBigIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return self.name

    def get_absolute_url(self) -> str:
        return reverse("project-page", args=[self.pk])

    @property
    def is_running(self) -> bool:
        return self.status == self.Status.RUNNING

    @property
    def task(self) -> str:
        return "local_steps" if self.mode == self.Mode.AVERAGING else "gradient"

    @property
    def is_pipeline(self) -> bool:
        return self.mode == self.Mode.PIPELINE

    @property
    def task_recipe(self) -> str:
        """Everything besides the slice and the weights that an honest update depends on: a stored
        reference computed under other settings (changed mid-round) is not this update's reference."""
        recipe: dict[str, object] = {"task": self.task}
        if self.task == "local_steps":
            recipe.update(
                batch=self.local_batch_size, lr=self.local_learning_rate, momentum=self.local_momentum
            )
        return json.dumps(recipe, sort_keys=True)

    @property
    def max_activation_bytes(self) -> int:
        return self.max_activation_mb * 2**20

    def current_version(self) -> ModelVersion:
        return self.versions.order_by("-number").first()  # type: ignore[return-value]

    def work_unit_samples(self, *, gflops: float, seconds: float | None = None) -> int:
        """Samples a device of `gflops` computes in about `seconds` (default `target_seconds`; 1 to
        max_unit_samples)."""
        seconds = self.target_seconds if seconds is None else seconds
        fits = int(seconds * gflops * 1e9 / max(self.flops_per_sample, 1))
        return max(1, min(self.max_unit_samples, fits))

    @property
    def crowd_averaging(self) -> bool:
        """Averaging in crowd-sized rounds: a unit per device, sized to take target_seconds on it."""
        return self.crowd_rounds and self.mode == self.Mode.AVERAGING

    @property
    def rounds_overlap(self) -> bool:
        """overlap_rounds, where it applies: a round's units on the version before count in it too."""
        return self.overlap_rounds and self.crowd_averaging

    def unit_seconds(self, *, round_age: float) -> float:
        """How long a work unit sent `round_age` seconds into its round should take: target_seconds, except in
        a crowd-sized averaging round, where a unit ends with the round's target_seconds (at least a quarter
        of them from now), so that devices that started late or came back for more finish with the others
        rather than hold the round. That quarter is also what a unit sent after them takes: the round is late
        (its devices that started late computed less than it planned), and whole target_seconds units of what
        was left kept 32 devices waiting a second target_seconds for a few (scaling-heterogeneous: its first
        round closed 70-80 s after it opened, most devices idle from 43 s). Not when rounds overlap: a unit
        then counts in whichever round is open when it ends."""
        if not self.units_end_with_round:
            return float(self.target_seconds)
        return max(self.target_seconds / 4, self.target_seconds - round_age)

    def round_open_to_joiners(self, *, round_age: float) -> bool:
        """Does a round `round_age` seconds old still take devices that connected after it was planned
        (lifecycle._joiners_feed)? Where its units end with it, while at least a quarter of its
        target_seconds is left: a unit sent later still takes that quarter (unit_seconds), so it would end
        after the round."""
        return self.units_end_with_round and round_age <= self.target_seconds * 3 / 4

    @property
    def units_end_with_round(self) -> bool:
        """Does a unit sent during a round end with it (unit_seconds)? Then a device computing one has
        nothing more to do in that round (lifecycle._not_computing_its_round)."""
        return self.crowd_averaging and not self.overlap_rounds

    @classmethod
    def units_end_with_round_q(cls, prefix: str = "") -> Q:
        """units_end_with_round as a condition on projects (`prefix`: the path to them, e.g. "project__")."""
        fields = {"crowd_rounds": True, "mode": cls.Mode.AVERAGING, "overlap_rounds": False}
        return Q(**{prefix + name: value for name, value in fields.items()})

    @property
    def max_unit_samples(self) -> int:
        """batch_size, except in crowd-sized averaging: its units hold as many local steps as target_seconds
        allows, up to the training split (a unit reads on across shards, datasets.shard_slices), since
        batch_size would cap a small model at milliseconds. What a device's memory and download allow is
        fitting's business."""
        if self.crowd_averaging:
            return max(self.batch_size, self.dataset.train_samples)
        return self.batch_size

    def staleness_weight(self, *, staleness: int) -> float:
        return 1.0 / (1 + staleness) if staleness < self.staleness_bound else 0.0


class ModelVersion(models.Model):
    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="versions")
    number = models.PositiveIntegerField()
    # None once pruned from storage (projects/storage.py): the row and its metrics stay.
    weights = models.ForeignKey(Blob, on_delete=models.PROTECT, related_name="+", null=True, blank=True)
    optimizer_state = models.ForeignKey(
        Blob, on_delete=models.PROTECT, related_name="+", null=True, blank=True
    )
    # The weights as volunteers download them (the project's weights_codec); None: the fp32 weights.
    wire_weights = models.ForeignKey(Blob, on_delete=models.PROTECT, related_name="+", null=True, blank=True)
    # With the project's weights_delta_codec: the blob taking the wire weights whose sha256 is `wire_base`
    # (the previous version's) to this version's. Not a foreign key: that blob may be pruned first.
    wire_delta = models.ForeignKey(Blob, on_delete=models.PROTECT, related_name="+", null=True, blank=True)
    wire_base = models.CharField(max_length=64, blank=True, default="")
    train_loss = models.FloatField(null=True, blank=True)
    samples = models.PositiveIntegerField(default=0, help_text="Samples aggregated into this version.")
    # Its round: the samples the feeder planned (None: the project's round_samples), and the samples of the
    # canonical valid results so far, counted in each verdict's transaction so that deciding whether the
    # round is complete reads one row rather than every pending result (training.round_ready).
    round_target = models.PositiveBigIntegerField(null=True, blank=True)
    valid_samples = models.PositiveBigIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)
    pruned_at = models.DateTimeField(
        null=True, blank=True, help_text="When its weights and optimizer state were deleted to save space."
    )

    class Meta:
        constraints = [models.UniqueConstraint(fields=["project", "number"], name="unique_version")]
        ordering = ["project", "number"]

    def __str__(self) -> str:
        return f"{self.project} v{self.number}"

    @property
    def wire_blob(self) -> Blob:
        """The wire weights' blob, the one volunteers download: `wire_weights`, or `weights` under fp32."""
        blob = self.wire_weights or self.weights
        if blob is None:
            raise PrunedError(f"version {self.number}'s weights were pruned")
        return blob

    @property
    def weights_blob(self) -> Blob:
        if self.weights is None:
            raise PrunedError(f"version {self.number}'s weights were pruned")
        return self.weights

    @property
    def is_pruned(self) -> bool:
        return self.pruned_at is not None


class WorkUnit(models.Model):
    """A slice of training data on one model version (BOINC's workunit); results are its instances.

    Like BOINC's, it wants `target_results` successful results, of which `min_quorum` must agree before
    one of them becomes `canonical_result`: the only one aggregated. Both are 1 unless the work unit is
    spot-checked by replication (Project.spot_check_by "replica"), which raises them to 2. Spot checks by
    the server instead set `spot_check`, and `reference` holds the server's update once computed.
    """

    class Status(models.TextChoices):
        OPEN = "open"
        VALIDATED = "validated"
        ERRORED = "errored"
        CANCELLED = "cancelled"

    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="work_units")
    version = models.ForeignKey(ModelVersion, on_delete=models.CASCADE, related_name="work_units")
    shard = models.ForeignKey(DatasetShard, on_delete=models.PROTECT, related_name="+")
    offset = models.PositiveIntegerField()
    count = models.PositiveIntegerField()
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.OPEN, db_index=True)
    # Instances still to send: target results (plus one for each failed instance) minus those in flight or
    # received. Kept as a counter so the scheduler can lock candidate rows (FOR UPDATE SKIP LOCKED) without
    # a GROUP BY.
    wanted = models.PositiveSmallIntegerField(default=1)
    target_results = models.PositiveSmallIntegerField(default=1)
    min_quorum = models.PositiveSmallIntegerField(default=1)
    canonical_result = models.OneToOneField(
        "Result", on_delete=models.SET_NULL, null=True, blank=True, related_name="canonical_for"
    )
    # Spot check by the server (Project.spot_check_by "server"), decided when an instance is sent; the
    # server's own update for the slice is computed while the volunteer computes (validation.py).
    spot_check = models.BooleanField(default=False)
    reference = models.ForeignKey(Blob, on_delete=models.PROTECT, related_name="+", null=True, blank=True)
    max_error_results = models.PositiveSmallIntegerField(default=3)
    max_total_results = models.PositiveSmallIntegerField(default=6)
    error_results = models.PositiveSmallIntegerField(default=0)
    total_results = models.PositiveSmallIntegerField(default=0)
    # Pipeline mode (projects/pipeline.py): a stage unit of micro-batch `micro_batch` in the step on
    # `version`. Blank `stage_kind`: a data-parallel unit. `input_blob`: the stage's input activation (None
    # for stage 0, which reads the shard); `grad_blob`: the gradient of its output (backward, not last).
    stage_kind = models.CharField(max_length=8, blank=True, default="")
    stage = models.PositiveSmallIntegerField(null=True, blank=True)
    micro_batch = models.PositiveSmallIntegerField(null=True, blank=True)
    input_blob = models.ForeignKey(Blob, on_delete=models.PROTECT, related_name="+", null=True, blank=True)
    grad_blob = models.ForeignKey(Blob, on_delete=models.PROTECT, related_name="+", null=True, blank=True)
    loss_scale = models.FloatField(null=True, blank=True)
    # The stage's graph and its weights on `version` as the volunteer downloads them (and the server's
    # recomputation reads): referenced here, so they are served with a grant and kept from the collector.
    stage_graph = models.ForeignKey(Blob, on_delete=models.PROTECT, related_name="+", null=True, blank=True)
    stage_weights = models.ForeignKey(Blob, on_delete=models.PROTECT, related_name="+", null=True, blank=True)
    # The peer ring (projects/ring.py): the SHA-256 of the input activation and of the output gradient when
    # they went from volunteer to volunteer; `input_blob` / `grad_blob` stay None until relayed through here.
    input_digest = models.CharField(max_length=64, blank=True, default="")
    grad_digest = models.CharField(max_length=64, blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        indexes = [
            models.Index(fields=["project", "status"]),
            # The scheduler's candidates (lifecycle._sendable): a round's worth per project, any history.
            models.Index(
                fields=["project", "version", "id"],
                condition=models.Q(status="open", wanted__gt=0),
                name="workunit_sendable",
            ),
            # Stage units still holding their stage blobs (projects/storage.py releases them after the step).
            models.Index(
                fields=["version"],
                condition=models.Q(stage_weights__isnull=False),
                name="workunit_stage_blobs",
            ),
        ]
        constraints = [
            # Cancelled units are left out: a step a pause interrupted starts over (stages.step_feed).
            models.UniqueConstraint(
                fields=["version", "stage_kind", "stage", "micro_batch"],
                condition=~models.Q(stage_kind="") & ~models.Q(status="cancelled"),
                name="one_stage_unit_per_step",
            )
        ]

    def __str__(self) -> str:
        return f"WU {self.pk} ({self.project}, v{self.version.number}, {self.status})"

    @property
    def is_open(self) -> bool:
        return self.status == self.Status.OPEN

    @property
    def spans_shards(self) -> bool:
        """Whether its samples run on past the end of its first shard (datasets.shard_slices)."""
        return self.offset + self.count > self.shard.count

    def record_failure(self) -> None:
        """An instance timed out or was invalid: send another, unless this slice keeps failing."""
        self.error_results += 1
        if self.error_results >= self.max_error_results or self.total_results >= self.max_total_results:
            self.status = self.Status.ERRORED
        else:
            self.wanted += 1

    def replicate(self) -> None:
        """Spot check by replication: one more volunteer computes this slice and the two must agree."""
        self.target_results = self.min_quorum = 2
        self.wanted += 1

    def record_disagreement(self) -> None:
        """Its results disagree with no quorum: send one more instance, unless it was sent too often."""
        if self.total_results >= self.max_total_results:
            self.status = self.Status.ERRORED
        else:
            self.target_results += 1
            self.wanted += 1


class Result(models.Model):
    """One instance of a work unit sent to one volunteer (BOINC's result)."""

    class Status(models.TextChoices):
        IN_PROGRESS = "in_progress"
        RECEIVED = "received"
        TIMED_OUT = "timed_out"
        CANCELLED = "cancelled"
        RELEASED = "released"

    class Validation(models.TextChoices):
        PENDING = "pending"
        VALID = "valid"
        INVALID = "invalid"

    work_unit = models.ForeignKey(WorkUnit, on_delete=models.CASCADE, related_name="results")
    volunteer = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="results")
    device = models.ForeignKey("workers.Device", on_delete=models.SET_NULL, null=True, blank=True)
    status = models.CharField(
        max_length=12, choices=Status.choices, default=Status.IN_PROGRESS, db_index=True
    )
    validation = models.CharField(max_length=10, choices=Validation.choices, default=Validation.PENDING)
    reason = models.CharField(max_length=200, blank=True)
    spot_checked = models.BooleanField(default=False)
    # Passed its own checks (names, shapes, finite values, samples, replays, norm). While still pending, it
    # waits for its work unit's quorum, not in the validation queue.
    checked = models.BooleanField(default=False)
    sent_at = models.DateTimeField(auto_now_add=True)
    deadline = models.DateTimeField()
    received_at = models.DateTimeField(null=True, blank=True)
    blob = models.ForeignKey(Blob, on_delete=models.PROTECT, related_name="+", null=True, blank=True)
    # The update's SHA-256, kept after its blob is released (projects/storage.py): replays are caught by it.
    digest = models.CharField(max_length=64, blank=True, db_index=True)
    # A stage result whose payload (activation, input gradient) went by the peer ring: its SHA-256, as the
    # volunteer reported it; the payload itself is not in `blob` (projects/ring.py).
    sent_digest = models.CharField(max_length=64, blank=True, default="")
    samples = models.PositiveIntegerField(default=0)
    loss = models.FloatField(null=True, blank=True)
    compute_ms = models.PositiveIntegerField(default=0)
    download_ms = models.PositiveIntegerField(default=0)
    update_norm = models.FloatField(null=True, blank=True)
    aggregated = models.BooleanField(default=False)

    DEAD = (Status.TIMED_OUT, Status.RELEASED, Status.CANCELLED)

    def reopen(self, *, device: Any, deadline: datetime) -> None:
        """Send this dead instance again, as new (lifecycle: a stage unit back to its stage's member; the
        database keeps one row per volunteer and work unit)."""
        self.status, self.validation, self.reason = self.Status.IN_PROGRESS, self.Validation.PENDING, ""
        self.device, self.sent_at, self.deadline = device, timezone.now(), deadline
        self.received_at, self.blob, self.digest, self.sent_digest = None, None, "", ""
        self.samples, self.loss, self.compute_ms, self.download_ms, self.update_norm = 0, None, 0, 0, None
        self.spot_checked = self.checked = self.aggregated = False
        self.save()

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["work_unit", "volunteer"], name="one_result_per_volunteer")
        ]
        indexes = [
            models.Index(fields=["status", "deadline"]),
            # The storage sweep looks only at results still holding an update (a few rounds' worth).
            models.Index(
                fields=["work_unit"], condition=models.Q(blob__isnull=False), name="result_holding_blob"
            ),
            # The hot paths, each a small share of the table however long the history (0012_hot_path_indexes):
            # a work unit's results by state (quorums, arrivals held by the step, cancellations),
            models.Index(fields=["work_unit", "status"], name="result_unit_status"),
            # the validation queue (a round waits for it; the transitioner retries it),
            models.Index(
                fields=["work_unit", "received_at"],
                condition=models.Q(status="received", validation="pending", checked=False),
                name="result_awaiting_validation",
            ),
            # valid updates not yet aggregated (async steps),
            models.Index(
                fields=["work_unit"],
                condition=models.Q(validation="valid", aggregated=False, status="received"),
                name="result_unaggregated",
            ),
            # what each device holds in flight (projects/swarms.py routes a stage unit by it),
            models.Index(
                fields=["device"], condition=models.Q(status="in_progress"), name="result_device_in_flight"
            ),
            # and the latest valid norms (validation._norm_problem), newest first.
            models.Index(
                fields=["-id"],
                condition=models.Q(validation="valid", update_norm__isnull=False),
                name="result_valid_norm",
            ),
            # a device's latest valid norm (validation._carried: what error feedback may carry).
            models.Index(
                fields=["device", "-id"],
                condition=models.Q(validation="valid", update_norm__isnull=False),
                name="result_device_valid_norm",
            ),
        ]

    def __str__(self) -> str:
        return f"result {self.pk} of WU {self.work_unit_id} ({self.status}, {self.validation})"

    @property
    def is_valid(self) -> bool:
        return self.validation == self.Validation.VALID


class StageMember(models.Model):
    """A connected device serving one stage of a pipeline project (issue 14, item 4; projects/swarms.py).
    While a member it is offered only that stage's units, so it keeps the stage's weights cached; it leaves
    when it disconnects, and the rebalancer may move it to another stage."""

    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="stage_members")
    device = models.ForeignKey("workers.Device", on_delete=models.CASCADE, related_name="stage_memberships")
    stage = models.PositiveSmallIntegerField()
    joined_at = models.DateTimeField(default=timezone.now, help_text="When it joined this stage.")
    # FLOPs over compute time of its valid stage results in this project, averaged (0: none yet). Routing
    # reads it; a device's speed differs by stage and backend, so the stage's own results are what count.
    speed_gflops = models.FloatField(default=0.0)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["project", "device"], name="one_stage_per_device_and_project")
        ]
        indexes = [models.Index(fields=["project", "stage"], name="stagemember_project_stage")]

    def __str__(self) -> str:
        return f"device {self.device_id} on stage {self.stage} of project {self.project_id}"

    def observe(self, *, flops: int, compute_ms: int) -> None:
        """One valid stage result: its server-side FLOPs over its reported compute time (bounded by the
        time the unit was out, lifecycle._record_arrival)."""
        if flops <= 0 or compute_ms <= 0:
            return
        measured = flops / (compute_ms * 1e6)
        self.speed_gflops = measured if not self.speed_gflops else 0.7 * self.speed_gflops + 0.3 * measured


class ProjectUsage(models.Model):
    """A running project's recent volunteer compute for the fair-share scheduler (BOINC's "recent estimated
    credit"): FLOPs of the work sent to volunteers, decayed exponentially with a half-life of
    CROWDTRAIN["SHARE_HALF_LIFE_SECONDS"]. One row per project, so choosing a project costs no scan."""

    project = models.OneToOneField(Project, on_delete=models.CASCADE, primary_key=True, related_name="usage")
    recent_flops = models.FloatField(default=0.0)
    updated_at = models.DateTimeField(default=timezone.now)

    def __str__(self) -> str:
        return f"{self.project}: {self.recent_flops:.3g} recent FLOPs"


class Metric(models.Model):
    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="metrics")
    version = models.ForeignKey(ModelVersion, on_delete=models.CASCADE, related_name="metrics")
    name = models.CharField(max_length=50)
    value = models.FloatField()
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["version", "name"], name="one_metric_per_version")]
        ordering = ["project", "created_at"]


class Baseline(models.Model):
    """The time-to-accuracy baseline: the project's graph and optimizer settings trained by one CPU process of
    the server's own, within a budget, to compare the platform's curve with (engine/baseline.py)."""

    class Status(models.TextChoices):
        PENDING = "pending"
        RUNNING = "running"
        DONE = "done"
        SKIPPED = "skipped"
        FAILED = "failed"

    project = models.OneToOneField(Project, on_delete=models.CASCADE, related_name="baseline")
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.PENDING)
    reason = models.CharField(max_length=300, blank=True, help_text="Why it was skipped, failed or stopped.")
    budget_seconds = models.FloatField()
    budget_samples = models.PositiveBigIntegerField()
    queued_at = models.DateTimeField(null=True, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"baseline of {self.project} ({self.status})"


class BaselinePoint(models.Model):
    """One evaluation of the baseline on the test split: after `seconds` of training (evaluation time not
    counted, as the platform evaluates beside training) and `samples` training samples."""

    baseline = models.ForeignKey(Baseline, on_delete=models.CASCADE, related_name="points")
    seconds = models.FloatField()
    samples = models.PositiveBigIntegerField()
    metrics = models.JSONField(help_text="{metric name: value}, e.g. test_loss, test_accuracy.")

    class Meta:
        ordering = ["baseline", "samples"]
        constraints = [
            models.UniqueConstraint(fields=["baseline", "samples"], name="one_baseline_point_per_samples")
        ]
