"""HTTP endpoints of the projects app: content-addressed blobs and a small read-only JSON API."""

from __future__ import annotations

import re

from django.http import FileResponse, Http404, HttpRequest, HttpResponseBase, HttpResponseNotModified
from django.shortcuts import get_object_or_404
from django.views.decorators.http import require_safe
from rest_framework import serializers
from rest_framework.permissions import AllowAny
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from projects.models import Blob
from projects.selectors import (
    project_latest_metrics,
    project_list_public,
    project_list_running,
    project_metric_series,
)

SHA256 = re.compile(r"[0-9a-f]{64}")
IMMUTABLE = "public, max-age=31536000, immutable"


@require_safe
def blob_detail(request: HttpRequest, sha256: str) -> HttpResponseBase:
    """Serve a blob's bytes; they never change, so browsers and proxies may keep them forever."""
    if not SHA256.fullmatch(sha256):
        raise Http404("Malformed blob hash.")
    blob = get_object_or_404(Blob, sha256=sha256)
    etag = f'"{sha256}"'
    if etag in request.headers.get("If-None-Match", ""):
        return _cacheable(HttpResponseNotModified(), etag)
    try:
        handle = blob.path.open("rb")
    except FileNotFoundError as exc:
        raise Http404("Blob content is missing.") from exc
    return _cacheable(FileResponse(handle, content_type=blob.content_type), etag)


def _cacheable(response: HttpResponseBase, etag: str) -> HttpResponseBase:
    response["Cache-Control"] = IMMUTABLE
    response["ETag"] = etag
    return response


class ProjectListApi(APIView):
    """GET /api/projects/: running projects with their current version and latest metrics."""

    permission_classes = [AllowAny]

    class OutputSerializer(serializers.Serializer):
        id = serializers.IntegerField()
        name = serializers.CharField()
        description = serializers.CharField()
        status = serializers.CharField()
        preset = serializers.CharField()
        dataset = serializers.CharField(source="dataset.name")
        flops_per_sample = serializers.IntegerField()
        current_version = serializers.IntegerField(source="current_version_number", allow_null=True)
        metrics = serializers.DictField(source="latest_metrics", child=serializers.FloatField())

    def get(self, request: Request) -> Response:
        projects = list(project_list_running())
        metrics = project_latest_metrics(project_ids=[project.pk for project in projects])
        for project in projects:
            project.latest_metrics = metrics[project.pk]  # type: ignore[attr-defined]
        return Response(self.OutputSerializer(projects, many=True).data)


class ProjectMetricsApi(APIView):
    """GET /api/projects/<id>/metrics/: every metric of a (non-draft) project, in version order."""

    permission_classes = [AllowAny]

    class OutputSerializer(serializers.Serializer):
        version = serializers.IntegerField()
        name = serializers.CharField()
        value = serializers.FloatField()
        created_at = serializers.DateTimeField()

    def get(self, request: Request, project_id: int) -> Response:
        project = get_object_or_404(project_list_public(), pk=project_id)
        series = project_metric_series(project=project)
        return Response({"project": project.pk, "metrics": self.OutputSerializer(series, many=True).data})
