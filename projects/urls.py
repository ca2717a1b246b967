from django.urls import path

from projects import api

urlpatterns = [
    # The REST API (projects/api.py; /work/agents/api-contract.md).
    path("api/projects/", api.ProjectListApi.as_view(), name="api-projects"),
    path("api/projects/<int:project_id>/", api.ProjectDetailApi.as_view(), name="api-project"),
    path("api/projects/<int:project_id>/start/", api.ProjectStartApi.as_view(), name="api-project-start"),
    path("api/projects/<int:project_id>/pause/", api.ProjectPauseApi.as_view(), name="api-project-pause"),
    path(
        "api/projects/<int:project_id>/metrics/", api.ProjectMetricsApi.as_view(), name="api-project-metrics"
    ),
    path(
        "api/projects/<int:project_id>/versions/",
        api.ProjectVersionsApi.as_view(),
        name="api-project-versions",
    ),
    path(
        "api/projects/<int:project_id>/checkpoint/",
        api.ProjectCheckpointApi.as_view(),
        name="api-project-checkpoint",
    ),
    path("api/datasets/", api.DatasetListApi.as_view(), name="api-datasets"),
    path("api/datasets/<int:dataset_id>/", api.DatasetDetailApi.as_view(), name="api-dataset"),
    path("api/uploads/", api.UploadCreateApi.as_view(), name="api-uploads"),
    path("api/uploads/<uuid:upload_id>/", api.UploadDetailApi.as_view(), name="api-upload"),
]
