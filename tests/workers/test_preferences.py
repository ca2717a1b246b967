"""Computing preferences on PostgreSQL: defaults, a device's override replacing them whole, the bounds of the
form, the service and the table, and the choice of projects as a condition on work units."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth.models import User
from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction

from projects.lifecycle import work_units_feed
from projects.models import Project, WorkUnit
from projects.services import project_create
from workers.models import ComputingPreferences, Device, Volunteer
from workers.preferences import (
    DEFAULTS,
    devices_allowing,
    preferences_devices,
    preferences_effective,
    preferences_forget_device,
    preferences_save,
)
from workers.preferences_form import PreferencesForm
from workers.services import volunteer_ensure

pytestmark = pytest.mark.django_db

VALID: dict[str, Any] = {
    "duty_cycle": "50",
    "pause_when_hidden": "on",
    "pause_on_battery": "on",
    "battery_min_percent": "20",
    "projects": "any",
    "max_work_unit_mb": "",
    "max_download_mb_per_day": "500",
}


def values(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "duty_cycle": 100,
        "pause_when_hidden": True,
        "pause_on_battery": True,
        "battery_min_percent": 0,
        "pause_while_active": False,
        "projects": "any",
        "max_work_unit_mb": None,
        "max_download_mb_per_day": None,
    }
    return base | overrides


def device_of(volunteer: Volunteer, client_id: str) -> Device:
    return Device.objects.create(volunteer=volunteer, client_id=client_id, backend="webgl")


@pytest.fixture
def volunteer(volunteer_user: User) -> Volunteer:
    return volunteer_ensure(user=volunteer_user)


def test_nothing_stored_means_the_models_defaults(volunteer: Volunteer) -> None:
    effective = preferences_effective(volunteer_id=volunteer.pk, device_id=None)
    assert effective == DEFAULTS and effective.source == "default"
    # What the issue asks for by default: the whole time, pause when hidden, any project.
    assert (effective.duty_cycle, effective.pause_when_hidden, effective.projects) == (100, True, "any")
    assert effective.pause_while_active is False and effective.max_download_bytes() is None


def test_a_devices_override_replaces_the_defaults_whole(volunteer: Volunteer) -> None:
    laptop, phone = device_of(volunteer, "laptop-0001"), device_of(volunteer, "phone-00001")
    preferences_save(
        volunteer=volunteer,
        device=None,
        values=values(duty_cycle=50, battery_min_percent=30),
        chosen_projects=[],
    )
    preferences_save(
        volunteer=volunteer, device=phone, values=values(pause_when_hidden=False), chosen_projects=[]
    )
    on_laptop = preferences_effective(volunteer_id=volunteer.pk, device_id=laptop.pk)
    on_phone = preferences_effective(volunteer_id=volunteer.pk, device_id=phone.pk)
    assert (on_laptop.source, on_laptop.duty_cycle, on_laptop.battery_min_percent) == ("volunteer", 50, 30)
    # Not a mix: the phone's set has the model's duty cycle, not the volunteer's 50.
    assert (on_phone.source, on_phone.duty_cycle, on_phone.pause_when_hidden) == ("device", 100, False)
    assert [d.has_override for d in preferences_devices(volunteer=volunteer)] == [True, False]  # type: ignore[attr-defined]

    assert preferences_forget_device(volunteer=volunteer, device=phone)
    assert not preferences_forget_device(volunteer=volunteer, device=phone)
    assert preferences_effective(volunteer_id=volunteer.pk, device_id=phone.pk).duty_cycle == 50


def test_saving_again_updates_the_same_row(volunteer: Volunteer) -> None:
    preferences_save(volunteer=volunteer, device=None, values=values(duty_cycle=30), chosen_projects=[])
    preferences_save(volunteer=volunteer, device=None, values=values(duty_cycle=70), chosen_projects=[])
    assert ComputingPreferences.objects.filter(volunteer=volunteer).count() == 1
    assert preferences_effective(volunteer_id=volunteer.pk).duty_cycle == 70


@pytest.mark.parametrize(
    "bad",
    [
        {"duty_cycle": 9},
        {"duty_cycle": 101},
        {"battery_min_percent": 101},
        {"max_work_unit_mb": 0},
        {"max_download_mb_per_day": 10**7},
        {"projects": "all of them"},
    ],
)
def test_the_service_refuses_values_out_of_bounds(volunteer: Volunteer, bad: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        preferences_save(volunteer=volunteer, device=None, values=values(**bad), chosen_projects=[])
    assert not ComputingPreferences.objects.exists()


def test_the_service_refuses_unknown_fields_and_other_volunteers_devices(
    volunteer: Volunteer, other_volunteer: User
) -> None:
    with pytest.raises(ValueError, match="unknown"):
        preferences_save(volunteer=volunteer, device=None, values={"volunteer_id": 1}, chosen_projects=[])
    theirs = device_of(volunteer_ensure(user=other_volunteer), "their-device")
    with pytest.raises(ValueError, match="own volunteer"):
        preferences_save(volunteer=volunteer, device=theirs, values=values(), chosen_projects=[])


def test_the_table_checks_the_bounds_too(volunteer: Volunteer) -> None:
    row = preferences_save(volunteer=volunteer, device=None, values=values(), chosen_projects=[])
    for field, value in (("duty_cycle", 5), ("battery_min_percent", 250)):
        with pytest.raises(IntegrityError), transaction.atomic():
            ComputingPreferences.objects.filter(pk=row.pk).update(**{field: value})
    with pytest.raises(IntegrityError), transaction.atomic():
        ComputingPreferences.objects.create(volunteer=volunteer)  # a second set of defaults


def test_the_choice_of_projects_is_a_condition_on_work_units(
    volunteer: Volunteer, mlp_project: Project, researcher: User
) -> None:
    other = project_create(owner=researcher, name="Other", dataset=mlp_project.dataset, preset="mlp")
    work_units_feed(project_id=mlp_project.pk)  # start() feeds on commit, which this test never reaches
    for mode in ("any", "only", "except"):
        preferences_save(
            volunteer=volunteer, device=None, values=values(projects=mode), chosen_projects=[mlp_project.pk]
        )
        effective = preferences_effective(volunteer_id=volunteer.pk)
        allowed = [effective.allows(mlp_project.pk), effective.allows(other.pk)]
        assert allowed == [mode != "except", mode != "only"], mode
        units = WorkUnit.objects.filter(effective.project_filter())
        assert units.filter(project=mlp_project).exists() == (mode != "except"), mode
    assert not preferences_effective(volunteer_id=volunteer.pk).single_choice  # "except" one project
    preferences_save(
        volunteer=volunteer, device=None, values=values(projects="only"), chosen_projects=[other.pk]
    )
    assert preferences_effective(volunteer_id=volunteer.pk).single_choice


def test_the_devices_allowing_a_project_are_those_whose_effective_preferences_allow_it(
    mlp_project: Project, second_project: Project
) -> None:
    """The round planner's query (devices_allowing) against Preferences.allows, device by device: no
    preferences, the volunteer's defaults, a device's override replacing them either way."""
    this, other = mlp_project.pk, second_project.pk
    cases = {  # device: (the volunteer's defaults, the device's override), each (mode, chosen) or None
        "nothing stored": (None, None),
        "only this": (("only", [this]), None),
        "only the other": (("only", [other]), None),
        "except this": (("except", [this]), None),
        "except the other": (("except", [other]), None),
        "only the other, overridden by any": (("only", [other]), ("any", [])),
        "any, overridden by only the other": (("any", []), ("only", [other])),
        "except this, overridden by only this": (("except", [this]), ("only", [this])),
    }
    devices = {name: _device_with(name, *stored) for name, stored in cases.items()}
    got = {d.client_id for d in devices_allowing(devices=Device.objects.all(), project_id=this)}
    expected = {
        name
        for name, device in devices.items()
        if preferences_effective(volunteer_id=device.volunteer_id, device_id=device.pk).allows(this)
    }
    allowed = {"nothing stored", "only this", "except the other"}
    assert (
        got
        == expected
        == allowed | {"only the other, overridden by any", "except this, overridden by only this"}
    )


Stored = tuple[str, list[int]] | None


def _device_with(name: str, defaults: Stored, own: Stored) -> Device:
    volunteer = volunteer_ensure(user=User.objects.create_user(name))
    device = device_of(volunteer, name)
    for target, stored in ((None, defaults), (device, own)):
        if stored is not None:
            preferences_save(
                volunteer=volunteer,
                device=target,
                values=values(projects=stored[0]),
                chosen_projects=stored[1],
            )
    return device


# --- the form -------------------------------------------------------------------------------------------


def test_the_form_takes_valid_preferences(mlp_project: Project) -> None:
    form = PreferencesForm({**VALID, "projects": "only", "chosen_projects": [str(mlp_project.pk)]})
    assert form.is_valid(), form.errors
    assert form.values()["duty_cycle"] == 50 and form.values()["max_work_unit_mb"] is None
    assert form.values()["pause_while_active"] is False  # an unticked box
    assert form.chosen_project_ids() == [mlp_project.pk]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("duty_cycle", "9"),
        ("duty_cycle", "101"),
        ("duty_cycle", ""),
        ("duty_cycle", "50.5"),
        ("duty_cycle", "1e400"),
        ("battery_min_percent", "-1"),
        ("battery_min_percent", "101"),
        ("max_work_unit_mb", "0"),
        ("max_work_unit_mb", "1000001"),
        ("max_download_mb_per_day", "-5"),
        ("max_download_mb_per_day", "9" * 50),
        ("projects", "everything"),
    ],
)
def test_the_form_refuses_out_of_bounds(field: str, value: str) -> None:
    form = PreferencesForm({**VALID, field: value})
    assert not form.is_valid() and field in form.errors, form.errors


@pytest.mark.parametrize(
    ("field", "value"), [("duty_cycle", "10"), ("duty_cycle", "100"), ("battery_min_percent", "0")]
)
def test_the_form_takes_the_bounds_themselves(field: str, value: str) -> None:
    assert PreferencesForm({**VALID, field: value}).is_valid()


def test_only_needs_a_project_and_only_running_or_paused_ones_are_offered(
    mlp_project: Project, researcher: User
) -> None:
    draft = project_create(owner=researcher, name="Draft", dataset=mlp_project.dataset, preset="mlp")
    assert "chosen_projects" in PreferencesForm({**VALID, "projects": "only"}).errors
    drafted = PreferencesForm({**VALID, "projects": "only", "chosen_projects": [str(draft.pk)]})
    assert "chosen_projects" in drafted.errors
    anything = PreferencesForm({**VALID, "projects": "any", "chosen_projects": [str(mlp_project.pk)]})
    assert anything.is_valid() and anything.chosen_project_ids() == []  # "any" keeps no list
