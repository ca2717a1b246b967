"""A volunteer's certificate (/volunteers/<id>/certificate/): public, printable, public name only."""

from __future__ import annotations

from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import render
from django.utils import timezone
from django.utils.translation import gettext as _
from django.views.decorators.http import require_GET

from workers.leaderboards import volunteer_projects, volunteer_rank
from workers.models import Volunteer


@require_GET
def certificate_page(request: HttpRequest, volunteer_id: int) -> HttpResponse:
    volunteer = Volunteer.objects.select_related("user", "team").filter(pk=volunteer_id).first()
    if volunteer is None:
        raise Http404(_("No such volunteer."))
    now = timezone.now()
    context = {
        "volunteer": volunteer,
        "recent": volunteer.recent_credit(now=now),
        "projects": volunteer_projects(volunteer=volunteer, now=now),
        "rank": volunteer_rank(volunteer=volunteer, now=now),
        "today": now,
    }
    return render(request, "frontend/certificate.html", context)
