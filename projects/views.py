"""HTTP endpoints of the projects app: a small read-only JSON API (blobs are served by blob_server.py)."""

from __future__ import annotations

from django.shortcuts import get_object_or_404
from rest_framework import serializers
from rest_framework.permissions import AllowAny
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from projects.selectors import (
    project_latest_metrics,
    project_list_public,
    project_list_running,
    project_metric_series,
)


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
