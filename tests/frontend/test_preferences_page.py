"""/account/preferences/: the volunteer's defaults and one device's own set, a validated form, nobody else's
devices, and each save told to the volunteer's open Contribute pages (notify.preferences_changed)."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth.models import User
from django.test import Client

from projects import notify
from projects.models import Project
from workers.models import ComputingPreferences, Device
from workers.preferences import preferences_effective
from workers.services import device_register, volunteer_ensure

pytestmark = pytest.mark.django_db
URL = "/account/preferences/"
FORM: dict[str, Any] = {
    "duty_cycle": "50",
    "pause_when_hidden": "on",
    "battery_min_percent": "15",
    "projects": "any",
    "max_work_unit_mb": "200",
    "max_download_mb_per_day": "",
}


@pytest.fixture
def client_of(volunteer_user: User) -> Client:
    client = Client()
    client.force_login(volunteer_user)
    return client


@pytest.fixture
def told(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """User ids whose browsers were told of new preferences (after the commit)."""
    calls: list[int] = []
    monkeypatch.setattr(notify, "preferences_changed", lambda *, user_id: calls.append(user_id))
    return calls


def laptop(user: User) -> Device:
    return device_register(user=user, client_id="laptop-0001", backend="webgl", gflops=10, user_agent="")


def test_the_page_needs_a_login() -> None:
    response = Client().get(URL)
    assert response.status_code == 302 and "/accounts/login/" in response["Location"]


def test_the_defaults_are_saved_and_the_browsers_told(
    client_of: Client, volunteer_user: User, told: list[int], django_capture_on_commit_callbacks: Any
) -> None:
    page = client_of.get(URL)
    assert page.status_code == 200 and b'id="preferences-form"' in page.content
    # Nothing stored yet: the form shows the defaults, so that saving it unchanged is valid.
    assert (
        b'name="duty_cycle" value="100"' in page.content and page.context["form"].initial["pause_when_hidden"]
    )
    with django_capture_on_commit_callbacks(execute=True):
        response = client_of.post(URL, FORM)
    assert response.status_code == 302 and response["Location"] == URL
    effective = preferences_effective(volunteer_id=volunteer_ensure(user=volunteer_user).pk)
    assert (effective.duty_cycle, effective.battery_min_percent, effective.max_work_unit_mb) == (50, 15, 200)
    assert (effective.pause_on_battery, effective.source) == (False, "volunteer")  # an unticked box
    assert told == [volunteer_user.pk]


@pytest.mark.parametrize(
    ("field", "value"),
    [("duty_cycle", "5"), ("duty_cycle", "101"), ("battery_min_percent", "200"), ("max_work_unit_mb", "0")],
)
def test_values_out_of_bounds_are_refused_with_the_form_shown_again(
    client_of: Client, told: list[int], field: str, value: str
) -> None:
    response = client_of.post(URL, {**FORM, field: value})
    assert response.status_code == 200 and field in response.context["form"].errors
    assert b"errorlist" in response.content
    assert not ComputingPreferences.objects.exists() and told == []


def test_a_device_gets_its_own_preferences_and_can_go_back_to_the_defaults(
    client_of: Client, volunteer_user: User, told: list[int], django_capture_on_commit_callbacks: Any
) -> None:
    device = laptop(volunteer_user)
    client_of.post(URL, FORM)
    shown = client_of.get(f"{URL}?device={device.pk}")
    assert shown.context["form"].initial["duty_cycle"] == 50  # starts from the defaults
    assert not shown.context["has_override"]
    with django_capture_on_commit_callbacks(execute=True):
        client_of.post(f"{URL}?device={device.pk}", {**FORM, "duty_cycle": "20"})
    volunteer = volunteer_ensure(user=volunteer_user)
    assert preferences_effective(volunteer_id=volunteer.pk, device_id=device.pk).duty_cycle == 20
    assert preferences_effective(volunteer_id=volunteer.pk).duty_cycle == 50  # the defaults stay
    with django_capture_on_commit_callbacks(execute=True):
        response = client_of.post(f"{URL}?device={device.pk}", {"use_defaults": "1"})
    assert response.status_code == 302
    assert preferences_effective(volunteer_id=volunteer.pk, device_id=device.pk).source == "volunteer"
    assert told == [volunteer_user.pk] * 2


@pytest.mark.parametrize("device", ["999999", "abc", "١٢", "9" * 40, "-1"])
def test_unknown_devices_are_not_found(client_of: Client, device: str) -> None:
    assert client_of.get(URL, {"device": device}).status_code == 404


def test_another_volunteers_device_is_not_found(client_of: Client, other_volunteer: User) -> None:
    theirs = laptop(other_volunteer)
    assert client_of.get(URL, {"device": theirs.pk}).status_code == 404
    assert client_of.post(f"{URL}?device={theirs.pk}", FORM).status_code == 404
    assert not ComputingPreferences.objects.exists()


def test_opting_in_to_one_project(client_of: Client, volunteer_user: User, mlp_project: Project) -> None:
    assert client_of.post(URL, {**FORM, "projects": "only"}).status_code == 200  # none ticked: refused
    response = client_of.post(URL, {**FORM, "projects": "only", "chosen_projects": [str(mlp_project.pk)]})
    assert response.status_code == 302
    effective = preferences_effective(volunteer_id=volunteer_ensure(user=volunteer_user).pk)
    assert effective.single_choice and effective.chosen_projects == {mlp_project.pk}
