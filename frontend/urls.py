from django.urls import path

from frontend import preferences_page, project_page, stats_files, team_pages, views, volunteer_pages

# Sign-up, log in and log out are allauth's (accounts/urls.py: /accounts/signup/, /accounts/login/, ...).
urlpatterns = [
    path("", views.home, name="home"),
    path("leaderboard/", views.leaderboard_page, name="leaderboard"),
    path("contribute/", views.contribute, name="contribute"),
    path("account/preferences/", preferences_page.preferences, name="account-preferences"),
    path("projects/<int:project_id>/", project_page.project_page, name="project-page"),
    path("projects/<int:project_id>/live/", project_page.project_live, name="project-live"),
    path("teams/", team_pages.teams_page, name="teams"),
    path("teams/new/", team_pages.team_create_page, name="team-create"),
    path("teams/<int:team_id>/", team_pages.team_page, name="team"),
    path("teams/<int:team_id>/edit/", team_pages.team_edit_page, name="team-edit"),
    path("teams/<int:team_id>/join/", team_pages.team_join_view, name="team-join"),
    path("teams/<int:team_id>/leave/", team_pages.team_leave_view, name="team-leave"),
    path("teams/<int:team_id>/founder/", team_pages.team_founder_view, name="team-founder"),
    path("teams/<int:team_id>/claim/", team_pages.team_claim_view, name="team-claim"),
    path("volunteers/<int:volunteer_id>/certificate/", volunteer_pages.certificate_page, name="certificate"),
    path("stats/", stats_files.stats_index, name="stats"),
    path("stats/<str:name>", stats_files.stats_file, name="stats-file"),
]
