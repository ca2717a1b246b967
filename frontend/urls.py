from django.urls import path

from frontend import project_page, views

# Sign-up, log in and log out are allauth's (accounts/urls.py: /accounts/signup/, /accounts/login/, ...).
urlpatterns = [
    path("", views.home, name="home"),
    path("leaderboard/", views.leaderboard_page, name="leaderboard"),
    path("contribute/", views.contribute, name="contribute"),
    path("projects/<int:project_id>/", project_page.project_page, name="project-page"),
    path("projects/<int:project_id>/live/", project_page.project_live, name="project-live"),
]
