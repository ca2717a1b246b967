from django.urls import path

from projects import views

urlpatterns = [
    path("api/projects/", views.ProjectListApi.as_view(), name="api-projects"),
    path(
        "api/projects/<int:project_id>/metrics/",
        views.ProjectMetricsApi.as_view(),
        name="api-project-metrics",
    ),
]
