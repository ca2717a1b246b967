"""/account/preferences/: a volunteer's computing preferences, the defaults of all their browsers or one
browser's own (`?device=<id>`). Saving reaches their open Contribute pages at once (workers.preferences)."""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.utils.translation import gettext as _

from workers.models import Device, Volunteer
from workers.preferences import (
    preferences_devices,
    preferences_forget_device,
    preferences_row,
    preferences_save,
)
from workers.preferences_form import PreferencesForm
from workers.services import volunteer_ensure


@login_required
def preferences(request: HttpRequest) -> HttpResponse:
    volunteer = volunteer_ensure(user=request.user)  # type: ignore[arg-type]
    device = _chosen_device(request=request, volunteer=volunteer)
    own = preferences_row(volunteer=volunteer, device=device)
    if request.method == "POST" and device is not None and "use_defaults" in request.POST:
        preferences_forget_device(volunteer=volunteer, device=device)
        messages.success(request, _("This device now uses your defaults."))
        return redirect(_page_url(device))
    # A device without its own set starts from the volunteer's defaults.
    shown = own or (preferences_row(volunteer=volunteer, device=None) if device else None)
    form = PreferencesForm(request.POST or None, instance=shown if request.method != "POST" else own)
    if request.method == "POST" and form.is_valid():
        preferences_save(
            volunteer=volunteer,
            device=device,
            values=form.values(),
            chosen_projects=form.chosen_project_ids(),
        )
        messages.success(request, _("Preferences saved. Your open Contribute pages use them already."))
        return redirect(_page_url(device))
    context = {
        "form": form,
        "device": device,
        "has_override": own is not None,
        "devices": preferences_devices(volunteer=volunteer),
    }
    return render(request, "frontend/preferences.html", context)


def _chosen_device(*, request: HttpRequest, volunteer: Volunteer) -> Device | None:
    raw = request.GET.get("device", "")
    if not raw:
        return None
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 18:
        raise Http404("No such device.")
    device = Device.objects.filter(pk=int(raw), volunteer=volunteer).first()
    if device is None:
        raise Http404("No such device.")  # another volunteer's is as good as none
    return device


def _page_url(device: Device | None) -> str:
    url = reverse("account-preferences")
    return f"{url}?device={device.pk}" if device else url
