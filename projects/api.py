"""The researchers' REST API (/work/agents/api-contract.md): projects, datasets, resumable uploads, versions,
metrics and checkpoints. Thin views: serializers validate, services act, selectors read.

Who may do what: reads of non-draft projects are public; a project's owner (and superusers) read its drafts
and change, start, pause or delete it; datasets and uploads are their owner's alone. Writes need an approved
researcher (accounts.selectors.user_is_researcher). Another user's draft, dataset or upload answers 404, as
if it did not exist; another user's public project answers 403 to a write.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, cast
from uuid import UUID

from django import forms
from django.conf import settings
from django.contrib.auth.models import User
from django.db import IntegrityError, transaction
from django.http import FileResponse
from django.utils.text import slugify
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import (
    OpenApiParameter,
    OpenApiResponse,
    extend_schema,
    extend_schema_field,
    inline_serializer,
)
from rest_framework import serializers, status
from rest_framework.exceptions import (
    APIException,
    NotAuthenticated,
    NotFound,
    PermissionDenied,
    ValidationError,
)
from rest_framework.parsers import FormParser, JSONParser, MultiPartParser
from rest_framework.permissions import SAFE_METHODS, AllowAny, BasePermission
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from accounts.selectors import user_is_researcher
from config.api import COMMON, DETAIL, FIELD_ERRORS, Pages, paginated
from engine.graph import MAX_ACTIVATION_BYTES
from engine.presets import PRESETS
from projects.datasets import (
    DatasetError,
    dataset_create,
    dataset_delete,
    dataset_parse_images,
    dataset_parse_npz,
    dataset_parse_text,
)
from projects.forms import (
    IMAGE_DEFAULTS,
    TEXT_DEFAULTS,
    parse_graph_upload,
    parse_weights_upload,
    preset_mismatch,
    weights_mismatch,
)
from projects.models import DEFAULT_MAX_ACTIVATION_MB, Dataset, ModelVersion, Project
from projects.selectors import (
    dataset_list_owned,
    project_latest_metrics,
    project_list_api,
    project_metric_series,
    project_owned,
    project_progress,
    project_visible,
    version_list,
    version_numbers_kept,
    version_pick,
)
from projects.services import (
    TRAINING_SETTINGS,
    ProjectError,
    project_create,
    project_create_from_graph,
    project_delete,
    project_pause,
    project_start,
    project_update,
)
from uploads.models import Upload
from uploads.services import OffsetMismatch, UploadError, upload_append, upload_consume, upload_create

MAX_DESCRIPTION = 10_000


class IsResearcher(BasePermission):
    message = "Only approved researchers may do this: request a researcher account on the site (/account/)."

    def has_permission(self, request: Request, view: Any) -> bool:
        return user_is_researcher(user=request.user)


class PublicReads(APIView):
    """Reads are public (and documented so: the schema lists no auth as one option); writes need an approved
    researcher."""

    def get_permissions(self) -> list[BasePermission]:
        return [AllowAny()] if self.request.method in SAFE_METHODS else [IsResearcher()]


def _paginate(
    view: APIView, request: Request, rows: Any, serializer: type[serializers.Serializer]
) -> Response:
    paginator = Pages()
    page: list[Any] = paginator.paginate_queryset(rows, request, view=view) or []
    return paginator.get_paginated_response(serializer(page, many=True).data)


@contextmanager
def _field_errors(field: str) -> Iterator[None]:
    """The projects forms' parse helpers raise Django's ValidationError: the API's field errors instead."""
    try:
        yield
    except forms.ValidationError as exc:
        raise ValidationError({field: exc.messages}) from exc


# --- serializers ----------------------------------------------------------------------------------


class ProjectSummarySerializer(serializers.Serializer):
    id = serializers.IntegerField()
    name = serializers.CharField()
    description = serializers.CharField()
    owner = serializers.CharField(source="owner.username")
    status = serializers.ChoiceField(choices=Project.Status.choices)
    preset = serializers.CharField()
    dataset = serializers.CharField(source="dataset.name")
    mode = serializers.ChoiceField(choices=Project.Mode.choices)
    flops_per_sample = serializers.IntegerField()
    current_version = serializers.IntegerField(source="current_version_number", allow_null=True)
    metrics = serializers.DictField(source="latest_metrics", child=serializers.FloatField())
    url = serializers.SerializerMethodField()
    target_metric = serializers.ChoiceField(choices=Project.TargetMetric.choices)
    target_value = serializers.FloatField(allow_null=True)

    def get_url(self, project: Project) -> str:
        return f"/projects/{project.pk}/"


class ProgressSerializer(serializers.Serializer):
    samples_per_second = serializers.FloatField()
    volunteers_active = serializers.IntegerField()
    flops = serializers.IntegerField()
    versions = serializers.IntegerField()
    eta_seconds = serializers.FloatField(allow_null=True)


class ProjectDetailSerializer(ProjectSummarySerializer):
    settings = serializers.SerializerMethodField()
    progress = serializers.SerializerMethodField()

    @extend_schema_field(OpenApiTypes.OBJECT)
    def get_settings(self, project: Project) -> dict[str, Any]:
        return {key: getattr(project, key) for key in TRAINING_SETTINGS}

    @extend_schema_field(ProgressSerializer)
    def get_progress(self, project: Project) -> dict[str, Any]:
        return dict(ProgressSerializer(project_progress(project=project)).data)


# Bounds on what a researcher may set: the model fields take any float or any 32-bit integer.
SETTING_BOUNDS: dict[str, dict[str, Any]] = {
    "learning_rate": {"min_value": 0.0, "max_value": 100.0},
    "momentum": {"min_value": 0.0, "max_value": 0.999},
    "weight_decay": {"min_value": 0.0, "max_value": 1.0},
    "local_learning_rate": {"min_value": 0.0, "max_value": 100.0},
    "local_momentum": {"min_value": 0.0, "max_value": 0.999},
    "local_batch_size": {"min_value": 1, "max_value": 100_000},
    "batch_size": {"min_value": 1, "max_value": 100_000},
    "round_samples": {"min_value": 1, "max_value": 10_000_000},
    "round_timeout": {"min_value": 1, "max_value": 86_400},
    "staleness_bound": {"min_value": 1, "max_value": 10_000},
    "target_seconds": {"min_value": 1, "max_value": 3_600},
    "spot_check_rate": {"min_value": 0.0, "max_value": 1.0},
    "trust_threshold": {"min_value": 0, "max_value": 1_000_000},
    "max_versions": {"min_value": 1, "max_value": 1_000_000_000},
    "target_value": {"min_value": -1e12, "max_value": 1e12},
}


class ProjectSettingsSerializer(serializers.ModelSerializer):
    """PATCH /api/projects/<id>/: any subset of name, description and the training settings."""

    class Meta:
        model = Project
        fields = ["name", "description", *TRAINING_SETTINGS]
        extra_kwargs = {
            "description": {"max_length": MAX_DESCRIPTION},
            **{key: {**bounds, "required": False} for key, bounds in SETTING_BOUNDS.items()},
        }


class ProjectCreateSerializer(ProjectSettingsSerializer):
    """POST /api/projects/ (multipart): a dataset of one's own and a preset, or a graph and its weights."""

    dataset = serializers.IntegerField(min_value=1, max_value=2**62)
    preset = serializers.ChoiceField(choices=sorted(PRESETS), required=False)
    graph = serializers.FileField(
        required=False, help_text="graph.json (docs/graph-format.md), at most 2 MB."
    )
    weights = serializers.FileField(
        required=False, help_text="weights.safetensors: the graph's params and buffers."
    )
    max_activation_mb = serializers.IntegerField(
        min_value=1, max_value=MAX_ACTIVATION_BYTES // 2**20, default=DEFAULT_MAX_ACTIVATION_MB
    )
    start = serializers.BooleanField(default=False)

    class Meta(ProjectSettingsSerializer.Meta):
        fields = [
            *ProjectSettingsSerializer.Meta.fields,
            "dataset",
            "preset",
            "graph",
            "weights",
            "max_activation_mb",
            "start",
        ]

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        has_preset, has_files = "preset" in attrs, "graph" in attrs or "weights" in attrs
        if has_preset == has_files:
            raise ValidationError(
                {"preset": ["Give a preset, or a graph and weights (exactly one of the two)."]}
            )
        if has_files and not ("graph" in attrs and "weights" in attrs):
            raise ValidationError({"weights": ["Upload both the graph and its weights."]})
        return attrs


class VersionSerializer(serializers.Serializer):
    number = serializers.IntegerField()
    created_at = serializers.DateTimeField()
    samples = serializers.IntegerField(allow_null=True)
    metrics = serializers.SerializerMethodField()

    @extend_schema_field(serializers.DictField(child=serializers.FloatField()))
    def get_metrics(self, version: ModelVersion) -> dict[str, float]:
        return {metric.name: metric.value for metric in version.metrics.all()}


class MetricPointSerializer(serializers.Serializer):
    version = serializers.IntegerField()
    name = serializers.CharField()
    value = serializers.FloatField()
    created_at = serializers.DateTimeField()


class DatasetSerializer(serializers.ModelSerializer):
    class Meta:
        model = Dataset
        fields = [
            "id",
            "name",
            "kind",
            "input_shape",
            "target_shape",
            "num_classes",
            "train_samples",
            "test_samples",
            "created_at",
        ]


FORMATS = ("npz", "images", "text")


class DatasetCreateSerializer(serializers.Serializer):
    name = serializers.CharField(max_length=200)
    upload = serializers.UUIDField()
    format = serializers.ChoiceField(choices=FORMATS, default="npz")
    channels = serializers.ChoiceField(choices=[1, 3], default=IMAGE_DEFAULTS["channels"])
    height = serializers.IntegerField(min_value=1, max_value=1024, default=IMAGE_DEFAULTS["height"])
    width = serializers.IntegerField(min_value=1, max_value=1024, default=IMAGE_DEFAULTS["width"])
    block_size = serializers.IntegerField(
        min_value=1, max_value=4096, default=cast(int, TEXT_DEFAULTS["block_size"])
    )
    vocabulary = serializers.ChoiceField(
        choices=["chars", "bytes"], default=cast(str, TEXT_DEFAULTS["vocabulary"])
    )


class UploadCreateSerializer(serializers.Serializer):
    filename = serializers.CharField(max_length=255)
    size = serializers.IntegerField(min_value=1, max_value=2**62)


class UploadSerializer(serializers.Serializer):
    id = serializers.UUIDField()
    offset = serializers.IntegerField()
    size = serializers.IntegerField()


# --- projects -------------------------------------------------------------------------------------


def _with_metrics(projects: list[Project]) -> list[Project]:
    metrics = project_latest_metrics(project_ids=[project.pk for project in projects])
    for project in projects:
        project.latest_metrics = metrics[project.pk]  # type: ignore[attr-defined]
    return projects


def _readable(request: Request, project_id: int) -> Project:
    project = project_visible(user=request.user, project_id=project_id)
    if project is None:
        raise NotFound("No such project.")
    return project


def _owned(request: Request, project_id: int) -> Project:
    """The project, for its owner's writes: 404 if the user cannot see it, 403 if it is someone else's."""
    project = _readable(request, project_id)
    if not project_owned(user=request.user, project=project):
        raise PermissionDenied("This project is not yours.")
    return project


def _detail(project_id: int, request: Request) -> Response:
    project = _with_metrics([_readable(request, project_id)])[0]
    return Response(ProjectDetailSerializer(project).data)


class ProjectListApi(PublicReads):
    parser_classes = [MultiPartParser, FormParser]

    @extend_schema(
        operation_id="projects_list",
        parameters=[
            OpenApiParameter(
                "mine", OpenApiTypes.BOOL, description="Only your own projects, drafts included."
            ),
            OpenApiParameter("page", OpenApiTypes.INT),
        ],
        responses={
            200: paginated("PaginatedProjectSummaryList", ProjectSummarySerializer(many=True)),
            400: FIELD_ERRORS,
            **COMMON,
        },
    )
    def get(self, request: Request) -> Response:
        mine = request.query_params.get("mine", "").lower() in ("1", "true", "yes")
        if mine and not request.user.is_authenticated:
            raise NotAuthenticated("Log in (a token) to list your own projects.")
        projects = project_list_api(user=request.user, mine=mine)
        paginator = Pages()
        page = _with_metrics(list(paginator.paginate_queryset(projects, request, view=self) or []))
        return paginator.get_paginated_response(ProjectSummarySerializer(page, many=True).data)

    @extend_schema(
        operation_id="projects_create",
        request={"multipart/form-data": ProjectCreateSerializer},
        responses={201: ProjectDetailSerializer, 400: FIELD_ERRORS, **COMMON},
    )
    def post(self, request: Request) -> Response:
        serializer = ProjectCreateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = dict(serializer.validated_data)
        project = _project_create(owner=request.user, data=data)  # type: ignore[arg-type]
        return Response(
            ProjectDetailSerializer(_with_metrics([_readable(request, project.pk)])[0]).data, status=201
        )


def _own_dataset(*, owner: User, dataset_id: int) -> Dataset:
    dataset = dataset_list_owned(user=owner).filter(pk=dataset_id).first()
    if dataset is None:
        raise ValidationError({"dataset": ["No dataset of yours has this id."]})
    return dataset


def _project_create(*, owner: User, data: dict[str, Any]) -> Project:
    dataset = _own_dataset(owner=owner, dataset_id=data.pop("dataset"))
    start, preset = data.pop("start"), data.pop("preset", None)
    graph_file, weights_file = data.pop("graph", None), data.pop("weights", None)
    common = {
        "owner": owner,
        "name": data.pop("name"),
        "description": data.pop("description", ""),
        "dataset": dataset,
        "max_activation_mb": data.pop("max_activation_mb"),
        "settings": data,
    }
    try:
        with transaction.atomic():
            if preset is not None:
                project = _from_preset(preset=preset, common=common)
            else:
                project = _from_graph(graph_file=graph_file, weights_file=weights_file, common=common)
            return project_start(project=project) if start else project
    except ProjectError as exc:
        raise ValidationError({"detail": str(exc)}) from exc
    except IntegrityError as exc:  # a project of the same name was created meanwhile
        raise ValidationError({"name": ["A project with this name exists already."]}) from exc


def _from_preset(*, preset: str, common: dict[str, Any]) -> Project:
    dataset: Dataset = common["dataset"]
    problem = preset_mismatch(
        preset=preset,
        input_shape=list(dataset.input_shape),
        num_classes=dataset.num_classes,
        kind=dataset.kind,
    )
    if problem:
        raise ValidationError({"preset": [problem]})
    return project_create(preset=preset, **common)


def _from_graph(*, graph_file: Any, weights_file: Any, common: dict[str, Any]) -> Project:
    with _field_errors("graph"):
        graph = parse_graph_upload(graph_file)
    with _field_errors("weights"):
        weights = parse_weights_upload(weights_file)
    problem = weights_mismatch(graph=graph, weights=weights)
    if problem:
        raise ValidationError({"weights": [problem]})
    return project_create_from_graph(graph_dict=graph.to_dict(), weights=weights, **common)


class ProjectDetailApi(PublicReads):
    parser_classes = [JSONParser]

    @extend_schema(operation_id="projects_retrieve", responses={200: ProjectDetailSerializer, **COMMON})
    def get(self, request: Request, project_id: int) -> Response:
        return _detail(project_id, request)

    @extend_schema(
        operation_id="projects_partial_update",
        request=ProjectSettingsSerializer,
        responses={200: ProjectDetailSerializer, 400: FIELD_ERRORS, **COMMON},
    )
    def patch(self, request: Request, project_id: int) -> Response:
        project = _owned(request, project_id)
        serializer = ProjectSettingsSerializer(project, data=request.data, partial=True)
        serializer.is_valid(raise_exception=True)
        try:
            project_update(project=project, changes=dict(serializer.validated_data))
        except IntegrityError as exc:
            raise ValidationError({"name": ["A project with this name exists already."]}) from exc
        except ProjectError as exc:  # settings that do not go together (a pipeline that cannot be cut)
            raise ValidationError({"non_field_errors": [str(exc)]}) from exc
        return _detail(project_id, request)

    @extend_schema(operation_id="projects_destroy", responses={204: None, 409: DETAIL, **COMMON})
    def delete(self, request: Request, project_id: int) -> Response:
        project = _owned(request, project_id)
        try:
            project_delete(project=project)
        except ProjectError as exc:
            return Response({"detail": str(exc)}, status=status.HTTP_409_CONFLICT)
        return Response(status=status.HTTP_204_NO_CONTENT)


class ProjectStartApi(APIView):
    permission_classes = [IsResearcher]

    @extend_schema(
        operation_id="projects_start",
        request=None,
        responses={200: ProjectDetailSerializer, 409: DETAIL, **COMMON},
    )
    def post(self, request: Request, project_id: int) -> Response:
        project = _owned(request, project_id)
        try:
            project_start(project=project)
        except ProjectError as exc:
            return Response({"detail": str(exc)}, status=status.HTTP_409_CONFLICT)
        return _detail(project_id, request)


class ProjectPauseApi(APIView):
    permission_classes = [IsResearcher]

    @extend_schema(
        operation_id="projects_pause", request=None, responses={200: ProjectDetailSerializer, **COMMON}
    )
    def post(self, request: Request, project_id: int) -> Response:
        project_pause(project=_owned(request, project_id))
        return _detail(project_id, request)


class ProjectMetricsApi(APIView):
    """Every metric of a project, in version order (for charts)."""

    permission_classes = [AllowAny]

    @extend_schema(
        operation_id="projects_metrics",
        responses={
            200: inline_serializer(
                "ProjectMetrics",
                {"project": serializers.IntegerField(), "metrics": MetricPointSerializer(many=True)},
            ),
            **COMMON,
        },
    )
    def get(self, request: Request, project_id: int) -> Response:
        project = _readable(request, project_id)
        series = project_metric_series(project=project)
        return Response({"project": project.pk, "metrics": MetricPointSerializer(series, many=True).data})


class ProjectVersionsApi(APIView):
    permission_classes = [AllowAny]

    @extend_schema(
        operation_id="projects_versions",
        parameters=[OpenApiParameter("page", OpenApiTypes.INT)],
        responses={
            200: paginated("PaginatedVersionList", VersionSerializer(many=True)),
            400: FIELD_ERRORS,
            **COMMON,
        },
    )
    def get(self, request: Request, project_id: int) -> Response:
        return _paginate(
            self, request, version_list(project=_readable(request, project_id)), VersionSerializer
        )


class ProjectCheckpointApi(APIView):
    permission_classes = [AllowAny]

    @extend_schema(
        operation_id="projects_checkpoint",
        parameters=[
            OpenApiParameter(
                "version",
                OpenApiTypes.STR,
                pattern=r"^(latest|best|[0-9]{1,9})$",
                description='"latest" (default), "best" (by the target metric) or a version number.',
            )
        ],
        responses={
            (200, "application/octet-stream"): OpenApiResponse(
                OpenApiTypes.BINARY, description="safetensors"
            ),
            **COMMON,
        },
    )
    def get(self, request: Request, project_id: int) -> FileResponse:
        project = _readable(request, project_id)
        which = request.query_params.get("version", "latest")
        version = version_pick(project=project, which=which)
        if version is None:
            raise NotFound(f"No version {which!r}: give latest, best (once evaluated) or a version number.")
        if version.weights is None:
            kept = version_numbers_kept(project=project)
            raise NotFound(f"version {version.number}'s weights were pruned; kept: {kept}")
        return _checkpoint_response(project=project, version=version)


def _checkpoint_response(*, project: Project, version: ModelVersion) -> FileResponse:
    metrics = {metric.name: metric.value for metric in version.metrics.all()}
    name = f"{slugify(project.name) or 'project'}-v{version.number}.safetensors"
    assert version.weights is not None  # checked by the caller
    response = FileResponse(version.weights.open(), as_attachment=True, filename=name)
    response["Content-Type"] = "application/octet-stream"
    response["X-Crowdtrain-Version"] = str(version.number)
    response["X-Crowdtrain-Metrics"] = json.dumps(metrics, sort_keys=True)
    return response


# --- datasets and uploads -------------------------------------------------------------------------


class DatasetListApi(APIView):
    permission_classes = [IsResearcher]
    parser_classes = [JSONParser]

    @extend_schema(
        operation_id="datasets_list",
        parameters=[OpenApiParameter("page", OpenApiTypes.INT)],
        responses={
            200: paginated("PaginatedDatasetList", DatasetSerializer(many=True)),
            400: FIELD_ERRORS,
            **COMMON,
        },
    )
    def get(self, request: Request) -> Response:
        return _paginate(self, request, dataset_list_owned(user=request.user), DatasetSerializer)  # type: ignore[arg-type]

    @extend_schema(
        operation_id="datasets_create",
        request=DatasetCreateSerializer,
        responses={201: DatasetSerializer, 400: FIELD_ERRORS, **COMMON},
    )
    def post(self, request: Request) -> Response:
        serializer = DatasetCreateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        dataset = _dataset_from_upload(owner=request.user, data=serializer.validated_data)  # type: ignore[arg-type]
        return Response(DatasetSerializer(dataset).data, status=status.HTTP_201_CREATED)


def _parser(data: dict[str, Any]) -> Any:
    if data["format"] == "images":
        shape = {key: int(data[key]) for key in ("channels", "height", "width")}
        return lambda handle: dataset_parse_images(data=handle, **shape)
    if data["format"] == "text":
        return lambda handle: dataset_parse_text(
            data=handle, block_size=data["block_size"], vocabulary=data["vocabulary"]
        )
    return lambda handle: dataset_parse_npz(data=handle)


def _dataset_from_upload(*, owner: User, data: dict[str, Any]) -> Dataset:
    """Parse the complete upload (a chunk at a time, from its file) and store it; the upload is consumed
    whatever happens, and nothing is stored from a bad file."""
    try:
        with upload_consume(upload_id=data["upload"], owner=owner) as handle:
            parsed = _parser(data)(handle)
            return dataset_create(owner=owner, name=data["name"], parsed=parsed)
    except (UploadError, DatasetError) as exc:
        raise ValidationError({"detail": str(exc)}) from exc


class DatasetDetailApi(APIView):
    permission_classes = [IsResearcher]

    @extend_schema(operation_id="datasets_retrieve", responses={200: DatasetSerializer, **COMMON})
    def get(self, request: Request, dataset_id: int) -> Response:
        return Response(DatasetSerializer(_own(request, dataset_id)).data)

    @extend_schema(operation_id="datasets_destroy", responses={204: None, 409: DETAIL, **COMMON})
    def delete(self, request: Request, dataset_id: int) -> Response:
        try:
            dataset_delete(dataset=_own(request, dataset_id))
        except DatasetError as exc:
            return Response({"detail": str(exc)}, status=status.HTTP_409_CONFLICT)
        return Response(status=status.HTTP_204_NO_CONTENT)


def _own(request: Request, dataset_id: int) -> Dataset:
    dataset = dataset_list_owned(user=request.user).filter(pk=dataset_id).first()  # type: ignore[arg-type]
    if dataset is None:
        raise NotFound("No dataset of yours has this id.")
    return dataset


class UploadCreateApi(APIView):
    permission_classes = [IsResearcher]
    parser_classes = [JSONParser]

    @extend_schema(
        operation_id="uploads_create",
        request=UploadCreateSerializer,
        responses={201: UploadSerializer, 400: FIELD_ERRORS, **COMMON},
    )
    def post(self, request: Request) -> Response:
        serializer = UploadCreateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        try:
            upload = upload_create(owner=request.user, **serializer.validated_data)  # type: ignore[arg-type]
        except UploadError as exc:
            raise ValidationError({"detail": str(exc)}) from exc
        return Response(UploadSerializer(upload).data, status=status.HTTP_201_CREATED)


class UploadDetailApi(APIView):
    """PUT's body is read from the request's stream by the service, never parsed whole by DRF."""

    permission_classes = [IsResearcher]

    @extend_schema(operation_id="uploads_retrieve", responses={200: UploadSerializer, **COMMON})
    def get(self, request: Request, upload_id: UUID) -> Response:
        upload = Upload.objects.filter(pk=upload_id, owner=request.user).first()  # type: ignore[misc]
        if upload is None:
            raise NotFound("No upload of yours has this id.")
        return Response(UploadSerializer(upload).data)

    @extend_schema(
        operation_id="uploads_append",
        request={"application/octet-stream": OpenApiTypes.BINARY},
        parameters=[
            OpenApiParameter(
                "Upload-Offset",
                OpenApiTypes.INT,
                OpenApiParameter.HEADER,
                required=True,
                description="The upload's current offset (GET it to resume).",
            )
        ],
        responses={
            200: UploadSerializer,
            400: DETAIL,
            409: inline_serializer(
                "OffsetConflict", {"detail": serializers.CharField(), "offset": serializers.IntegerField()}
            ),
            411: DETAIL,
            413: DETAIL,
            **COMMON,
        },
    )
    def put(self, request: Request, upload_id: UUID) -> Response:
        offset, length = _put_headers(request)
        if not Upload.objects.filter(pk=upload_id, owner=request.user).exists():  # type: ignore[misc]
            raise NotFound("No upload of yours has this id.")
        try:
            upload = upload_append(
                upload_id=upload_id,
                owner=request.user,  # type: ignore[arg-type]
                offset=offset,
                length=length,
                stream=request._request,  # type: ignore[arg-type]
            )
        except OffsetMismatch as exc:
            return Response({"detail": str(exc), "offset": exc.offset}, status=status.HTTP_409_CONFLICT)
        except UploadError as exc:
            return Response({"detail": str(exc)}, status=status.HTTP_400_BAD_REQUEST)
        return Response(UploadSerializer(upload).data)


def _put_headers(request: Request) -> tuple[int, int]:
    """(Upload-Offset, Content-Length), both checked before a byte of the body is read."""
    offset_text = request.headers.get("Upload-Offset", "")
    if not (offset_text.isdigit() and len(offset_text) <= 18):
        raise ValidationError(
            {"detail": "Send the Upload-Offset header: the upload's current offset in bytes."}
        )
    length_text = request.headers.get("Content-Length", "")
    if not (length_text.isdigit() and len(length_text) <= 18):
        raise LengthRequired()
    limit = settings.CROWDTRAIN["MAX_UPLOAD_CHUNK_BYTES"]
    if int(length_text) > limit:
        raise ChunkTooLarge(f"A chunk is at most {limit:,} bytes; send the file in several PUTs.")
    return int(offset_text), int(length_text)


class LengthRequired(APIException):
    status_code = 411
    default_detail = "Send a Content-Length header with the chunk."


class ChunkTooLarge(APIException):
    status_code = 413
    default_detail = "The chunk is too large."
