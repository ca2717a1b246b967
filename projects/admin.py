"""Admin for researchers: create projects from presets and .npz uploads, start/pause them, watch them learn.

Non-superusers only ever see and change what they own (projects, datasets and everything hanging off them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.contrib import admin, messages
from django.db.models import Count, Model, QuerySet
from django.forms import ModelForm
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.utils.html import format_html, json_script
from django.utils.safestring import SafeString

from frontend.templatetags.crowdtrain import format_flops
from projects.datasets import DatasetError
from projects.forms import DatasetAddForm, ProjectAddForm, ProjectChangeForm
from projects.models import Blob, Dataset, DatasetShard, Metric, ModelVersion, Project, Result, WorkUnit
from projects.selectors import (
    TEST_ACCURACY,
    project_annotate_current_version,
    project_latest_metrics,
    project_metric_series,
    project_samples_per_second,
)
from projects.services import TRAINING_SETTINGS, ProjectError, project_pause, project_start


class OwnedAdmin(admin.ModelAdmin):
    """Rows visible to a non-superuser are those whose `owner_path` leads to them."""

    owner_path = "owner"

    def get_queryset(self, request: HttpRequest) -> QuerySet[Any]:
        queryset = super().get_queryset(request)
        if request.user.is_superuser:
            return queryset
        return queryset.filter(**{self.owner_path: request.user})

    def owns(self, request: HttpRequest, obj: Model | None) -> bool:
        if obj is None or request.user.is_superuser:
            return True
        return self.get_queryset(request).filter(pk=obj.pk).exists()

    def has_view_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        return super().has_view_permission(request, obj) and self.owns(request, obj)

    def has_change_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        return super().has_change_permission(request, obj) and self.owns(request, obj)

    def has_delete_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        return super().has_delete_permission(request, obj) and self.owns(request, obj)


class ReadOnlyAdmin(OwnedAdmin):
    """Records written by the training machinery: look, never touch (superusers may delete)."""

    def has_add_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        return request.user.is_superuser


def blob_link(blob: Blob | None) -> str:
    if blob is None:
        return "—"
    return format_html('<a href="{}">{}</a> ({} B)', blob.url, blob.sha256[:12], f"{blob.size:,}")


# --- datasets -------------------------------------------------------------------------------------


class DatasetShardInline(admin.TabularInline):
    model = DatasetShard
    fields = readonly_fields = ("split", "index", "count", "blob_link")
    extra = 0
    can_delete = False
    show_change_link = False

    def has_add_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        return False

    @admin.display(description="blob")
    def blob_link(self, shard: DatasetShard) -> str:
        return blob_link(shard.blob)


DATASET_ADD_FIELDSETS = [
    (
        None,
        {
            "fields": ["name", "format", "file"],
            "description": "Uploads are checked whole before anything is saved, and stored as shards of "
            "float32 samples (int32 token ids for text).",
        },
    ),
    (
        "Image folders (.zip)",
        {
            "fields": ["channels", "height", "width"],
            "description": "train/&lt;class&gt;/*.png or *.jpg and optionally test/&lt;class&gt;/…, or only "
            "&lt;class&gt;/… (a tenth is then held out). Classes are the folder names, sorted.",
        },
    ),
    (
        "Text (.txt)",
        {
            "fields": ["block_size", "vocabulary"],
            "description": "UTF-8 text, cut into samples of block size tokens, each labelled with the next "
            "token; the last tenth of the text is the test split.",
        },
    ),
]
DATASET_FIELDS = [field for _, options in DATASET_ADD_FIELDSETS for field in options["fields"]]
MAX_LABELS_SHOWN = 100


@admin.register(Dataset)
class DatasetAdmin(OwnedAdmin):
    list_display = [
        "name",
        "owner",
        "kind",
        "input_shape",
        "num_classes",
        "train_samples",
        "test_samples",
        "shards",
        "created_at",
    ]
    list_filter = [("owner", admin.RelatedOnlyFieldListFilter), "kind", "created_at"]
    search_fields = ["name"]
    readonly_fields = [
        "owner",
        "kind",
        "input_shape",
        "target_shape",
        "num_classes",
        "labels_shown",
        "train_samples",
        "test_samples",
        "created_at",
    ]
    inlines = [DatasetShardInline]

    def get_queryset(self, request: HttpRequest) -> QuerySet[Dataset]:
        return super().get_queryset(request).select_related("owner").annotate(shard_count=Count("shards"))

    @admin.display(description="shards", ordering="shard_count")
    def shards(self, dataset: Dataset) -> int:
        return dataset.shard_count  # type: ignore[attr-defined]

    @admin.display(description="labels")
    def labels_shown(self, dataset: Dataset) -> str:
        """Class names or vocabulary characters, in id order (repr shows spaces and newlines)."""
        labels = list(dataset.labels)
        if not labels:
            return "—"
        shown = ", ".join(repr(label) for label in labels[:MAX_LABELS_SHOWN])
        return shown + (f" … ({len(labels):,} in all)" if len(labels) > MAX_LABELS_SHOWN else "")

    def get_form(
        self, request: HttpRequest, obj: Dataset | None = None, change: bool = False, **kwargs: Any
    ) -> type[ModelForm]:
        if obj is None:
            kwargs["form"] = DatasetAddForm
            kwargs["fields"] = DATASET_FIELDS
        return super().get_form(request, obj, change, **kwargs)

    def get_fieldsets(self, request: HttpRequest, obj: Dataset | None = None) -> Any:
        if obj is None:
            return DATASET_ADD_FIELDSETS
        return [(None, {"fields": ["name", *self.readonly_fields]})]

    def get_inlines(self, request: HttpRequest, obj: Dataset | None) -> Any:
        return self.inlines if obj is not None else []

    def save_form(self, request: HttpRequest, form: ModelForm, change: bool) -> Any:
        if change:
            return super().save_form(request, form, change)
        return form.create(owner=request.user)  # type: ignore[attr-defined]

    def save_model(self, request: HttpRequest, obj: Dataset, form: ModelForm, change: bool) -> None:
        if change:  # only the name is editable; shards are immutable
            obj.save(update_fields=["name"])

    def save_related(self, request: HttpRequest, form: ModelForm, formsets: Any, change: bool) -> None:
        if change:
            super().save_related(request, form, formsets, change)


@admin.register(DatasetShard)
class DatasetShardAdmin(ReadOnlyAdmin):
    owner_path = "dataset__owner"
    list_display = ["dataset", "split", "index", "count", "blob_link"]
    list_filter = ["split", ("dataset", admin.RelatedOnlyFieldListFilter)]
    list_select_related = ["dataset", "blob"]

    @admin.display(description="blob")
    def blob_link(self, shard: DatasetShard) -> str:
        return blob_link(shard.blob)


# --- projects -------------------------------------------------------------------------------------

PROJECT_ADD_FIELDSETS = [
    (None, {"fields": ["name", "description"]}),
    (
        "Model",
        {
            "fields": ["model_source", "preset", "graph_file", "weights_file", "max_activation_mb"],
            "description": "A preset architecture, or your own model exported with "
            "<code>manage.py export_model</code> (graph.json + weights.safetensors).",
        },
    ),
    (
        "Dataset",
        {
            "fields": ["dataset", "dataset_file", "dataset_name"],
            "description": "Choose one of your datasets, or upload an .npz (x, y, optional x_test, y_test).",
        },
    ),
    ("Training", {"fields": list(TRAINING_SETTINGS)}),
]
PROJECT_PROGRESS_FIELDS = (
    "public_page",
    "status",
    "current_version",
    "samples_per_second",
    "latest_test_accuracy",
    "metrics_chart",
)
PROJECT_MODEL_FIELDS = (
    "owner",
    "dataset",
    "preset",
    "graph_link",
    "flops",
    "max_activation_mb",
    "data_cursor",
    "created_at",
)


@admin.register(Project)
class ProjectAdmin(OwnedAdmin):
    list_display = [
        "name",
        "owner",
        "status",
        "preset",
        "dataset",
        "version",
        "resource_share",
        "flops",
        "created_at",
    ]
    list_filter = ["status", "preset", ("owner", admin.RelatedOnlyFieldListFilter)]
    search_fields = ["name", "description"]
    actions = ["start", "pause"]
    form = ProjectChangeForm  # the add form is get_form's
    readonly_fields = [*PROJECT_PROGRESS_FIELDS, *PROJECT_MODEL_FIELDS]
    fieldsets = [
        (None, {"fields": ["name", "description"]}),
        ("Progress", {"fields": PROJECT_PROGRESS_FIELDS}),
        ("Training", {"fields": list(TRAINING_SETTINGS)}),
        (
            "Scheduling",
            {
                "fields": ["resource_share"],
                "description": "Set by staff: running projects get volunteer compute in proportion to their "
                "resource shares.",
            },
        ),
        ("Model and data", {"fields": PROJECT_MODEL_FIELDS}),
    ]

    class Media:
        js = ["vendor/chart.umd.min.js", "frontend/charts.js"]

    def get_queryset(self, request: HttpRequest) -> QuerySet[Project]:
        queryset = super().get_queryset(request).select_related("owner", "graph")
        return project_annotate_current_version(queryset=queryset)

    # add form: a preset or an uploaded graph + weights, a dataset (chosen or uploaded) and training
    # settings, saved by project_create / project_create_from_graph

    def get_form(
        self, request: HttpRequest, obj: Project | None = None, change: bool = False, **kwargs: Any
    ) -> type[ModelForm]:
        if obj is not None:
            return super().get_form(request, obj, change, **kwargs)
        kwargs["form"] = type("ProjectAddForm", (ProjectAddForm,), {"owner": request.user})
        return super().get_form(request, obj, change, **kwargs)

    def get_fieldsets(self, request: HttpRequest, obj: Project | None = None) -> Any:
        return PROJECT_ADD_FIELDSETS if obj is None else self.fieldsets

    def get_readonly_fields(self, request: HttpRequest, obj: Project | None = None) -> Any:
        if obj is None:
            return []
        # A researcher must not be able to starve the other projects: only superusers set shares.
        return [*self.readonly_fields, *([] if request.user.is_superuser else ["resource_share"])]

    def save_form(self, request: HttpRequest, form: ModelForm, change: bool) -> Any:
        if change:
            return super().save_form(request, form, change)
        return form.create(owner=request.user)  # type: ignore[attr-defined]

    def save_model(self, request: HttpRequest, obj: Project, form: ModelForm, change: bool) -> None:
        if change:  # on add, project_create has saved everything already
            super().save_model(request, obj, form, change)

    def save_related(self, request: HttpRequest, form: ModelForm, formsets: Any, change: bool) -> None:
        if change:
            super().save_related(request, form, formsets, change)

    def add_view(self, request: HttpRequest, form_url: str = "", extra_context: Any = None) -> HttpResponse:
        try:
            return super().add_view(request, form_url, extra_context)
        except (
            ProjectError,
            DatasetError,
        ) as exc:  # raised inside the admin's transaction: nothing was saved
            self.message_user(request, f"The project was not created: {exc}", messages.ERROR)
            return HttpResponseRedirect(request.get_full_path())

    # actions

    @admin.action(description="Start training the selected projects", permissions=["change"])
    def start(self, request: HttpRequest, queryset: QuerySet[Project]) -> None:
        self._apply(request, queryset, project_start, "started")

    @admin.action(description="Pause the selected projects", permissions=["change"])
    def pause(self, request: HttpRequest, queryset: QuerySet[Project]) -> None:
        self._apply(request, queryset, project_pause, "paused")

    def _apply(
        self, request: HttpRequest, queryset: QuerySet[Project], service: Callable[..., Project], verb: str
    ) -> None:
        for project in queryset:
            try:
                service(project=project)
            except ProjectError as exc:
                self.message_user(request, f"{project}: {exc}", messages.ERROR)
            else:
                self.message_user(request, f"{project}: {verb}.", messages.SUCCESS)

    # computed columns and fields

    @admin.display(description="version", ordering="current_version_number")
    def version(self, project: Project) -> Any:
        return getattr(project, "current_version_number", None)

    @admin.display(description="FLOPs / sample", ordering="flops_per_sample")
    def flops(self, project: Project) -> str:
        return format_flops(project.flops_per_sample)

    @admin.display(description="graph")
    def graph_link(self, project: Project) -> str:
        return blob_link(project.graph)

    @admin.display(description="current version")
    def current_version(self, project: Project) -> str:
        version = project.current_version()
        if version is None:
            return "—"
        return f"v{version.number} of {project.max_versions} (created {version.created_at:%Y-%m-%d %H:%M:%S})"

    @admin.display(description="samples / s (last 5 min)")
    def samples_per_second(self, project: Project) -> str:
        return f"{project_samples_per_second(project=project, seconds=300):.1f}"

    @admin.display(description="latest test accuracy")
    def latest_test_accuracy(self, project: Project) -> str:
        value = project_latest_metrics(project_ids=[project.pk])[project.pk].get(TEST_ACCURACY)
        return "—" if value is None else f"{value:.2%}"

    @admin.display(description="public page")
    def public_page(self, project: Project) -> str:
        """Curves, ETA, the one-CPU comparison and checkpoint downloads (drafts: their owner only)."""
        url = project.get_absolute_url()
        return format_html('<a href="{}">{}</a>', url, url)

    @admin.display(description="metrics per version")
    def metrics_chart(self, project: Project) -> SafeString | str:
        points = [
            {"version": p.version, "name": p.name, "value": p.value}
            for p in project_metric_series(project=project)
        ]
        if not points:
            return "No metrics yet: versions are evaluated on the test split as training runs."
        return format_html(
            '<div style="position:relative;height:300px;width:720px;max-width:100%">'
            '<canvas id="metrics-chart"></canvas></div>{}'
            '<script>crowdtrainMetricsChart("metrics-chart", '
            'JSON.parse(document.getElementById("metrics-data").textContent));</script>',
            json_script(points, "metrics-data"),
        )


@admin.register(ModelVersion)
class ModelVersionAdmin(ReadOnlyAdmin):
    owner_path = "project__owner"
    list_display = ["project", "number", "train_loss", "samples", "weights_link", "created_at", "pruned_at"]
    list_filter = [("project", admin.RelatedOnlyFieldListFilter)]
    list_select_related = ["project", "weights"]
    search_fields = ["project__name"]
    readonly_fields = ["weights_link", "optimizer_state_link", "pruned_at"]
    exclude = ["weights", "optimizer_state", "wire_weights", "wire_delta", "wire_base"]

    @admin.display(description="weights")
    def weights_link(self, version: ModelVersion) -> str:
        return "pruned" if version.is_pruned else blob_link(version.weights)

    @admin.display(description="optimizer state")
    def optimizer_state_link(self, version: ModelVersion) -> str:
        return blob_link(version.optimizer_state)


@admin.register(WorkUnit)
class WorkUnitAdmin(ReadOnlyAdmin):
    owner_path = "project__owner"
    list_display = [
        "id",
        "project",
        "version_number",
        "status",
        "offset",
        "count",
        "wanted",
        "target_results",
        "min_quorum",
        "total_results",
        "error_results",
        "canonical_result",
        "created_at",
    ]
    list_filter = ["status", ("project", admin.RelatedOnlyFieldListFilter)]
    list_select_related = ["project", "version", "canonical_result"]
    raw_id_fields = ["version", "shard", "canonical_result"]

    @admin.display(description="version", ordering="version__number")
    def version_number(self, work_unit: WorkUnit) -> int:
        return work_unit.version.number


@admin.register(Result)
class ResultAdmin(ReadOnlyAdmin):
    owner_path = "work_unit__project__owner"
    list_display = [
        "id",
        "work_unit",
        "volunteer",
        "status",
        "validation",
        "spot_checked",
        "samples",
        "loss",
        "compute_ms",
        "aggregated",
        "sent_at",
    ]
    list_filter = [
        "status",
        "validation",
        "spot_checked",
        "checked",
        "aggregated",
        ("work_unit__project", admin.RelatedOnlyFieldListFilter),
    ]
    list_select_related = ["work_unit__project", "work_unit__version", "volunteer"]
    search_fields = ["volunteer__username", "reason"]
    raw_id_fields = ["work_unit", "volunteer", "blob", "device"]


@admin.register(Metric)
class MetricAdmin(ReadOnlyAdmin):
    owner_path = "project__owner"
    list_display = ["project", "version", "name", "value", "created_at"]
    list_filter = ["name", ("project", admin.RelatedOnlyFieldListFilter)]
    list_select_related = ["project", "version__project"]
    raw_id_fields = ["version"]


@admin.register(Blob)
class BlobAdmin(admin.ModelAdmin):
    """Raw content-addressed storage: superusers only (blobs have no owner)."""

    list_display = ["sha256", "size", "content_type", "created_at", "link"]
    list_filter = ["content_type"]
    search_fields = ["sha256"]

    def has_module_permission(self, request: HttpRequest) -> bool:
        return request.user.is_superuser

    def has_view_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        return request.user.is_superuser

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        return False

    @admin.display(description="download")
    def link(self, blob: Blob) -> str:
        return format_html('<a href="{}">/blobs/{}…</a>', blob.url, blob.sha256[:12])
