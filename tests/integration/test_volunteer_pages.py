"""The volunteer's certificate (frontend/volunteer_pages.py): public name, credit, projects, since."""

from __future__ import annotations

from django.contrib.auth.models import User
from django.test import Client

from projects.models import Project
from tests.workers.conftest import grant
from workers.models import Volunteer

GFLOP = 10**9


def test_the_certificate_shows_credit_projects_and_since(
    client: Client, mlp_project: Project, second_project: Project, volunteer_user: User, other_volunteer: User
) -> None:
    grant(mlp_project, volunteer_user, 864 * GFLOP)  # 2 credits
    grant(second_project, volunteer_user, 432 * GFLOP)
    grant(mlp_project, other_volunteer, 4320 * GFLOP)
    volunteer = Volunteer.objects.get(user=volunteer_user)
    Volunteer.objects.filter(pk=volunteer.pk).update(display_name="Grace H.")

    response = client.get(f"/volunteers/{volunteer.pk}/certificate/")
    html = response.content.decode()
    assert response.status_code == 200
    assert 'id="certificate-name">Grace H.<' in html and "alice" not in html
    assert 'id="certificate-credit">3.00<' in html
    assert 'id="certificate-rank">#2 of 2<' in html
    assert "MLP" in html and "Second MLP" in html and 'id="print-certificate"' in html
    assert volunteer.created_at.strftime("%Y") in html
    assert client.get("/volunteers/424242/certificate/").status_code == 404
