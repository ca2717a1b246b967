"""Computing preferences (BOINC's): the selector the scheduler and the socket read, and the services that save
them and tell the volunteer's connected browsers.

A device's preferences are its own override if it has one, else the volunteer's defaults, else the model's
defaults: always a whole set (BOINC's venues), never a mix. The browser enforces the duty cycle and the pauses
(frontend/static/frontend/contribute.js and worker.js); the server enforces the choice of projects, the
work-unit size and the daily download (projects.lifecycle, with workers.fitting)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from django.db import transaction
from django.db.models import Exists, OuterRef, Q, QuerySet

from projects import notify
from workers.models import ComputingPreferences, Device, Volunteer

MB = 2**20
# The stored fields a volunteer sets (the projects chosen are a many-to-many beside them).
FIELDS = (
    "duty_cycle",
    "pause_when_hidden",
    "pause_on_battery",
    "battery_min_percent",
    "pause_while_active",
    "projects",
    "max_work_unit_mb",
    "max_download_mb_per_day",
)


@dataclass(frozen=True)
class Preferences:
    """One device's effective preferences; `source` says where they came from."""

    duty_cycle: int
    pause_when_hidden: bool
    pause_on_battery: bool
    battery_min_percent: int
    pause_while_active: bool
    projects: str
    chosen_projects: frozenset[int] = field(default_factory=frozenset)
    max_work_unit_mb: int | None = None
    max_download_mb_per_day: int | None = None
    source: str = "default"  # "device" (its override), "volunteer" (their defaults) or "default"

    def project_filter(self, prefix: str = "") -> Q:
        """The projects these preferences allow, as a condition on `<prefix>project_id`."""
        ids = Q(**{f"{prefix}project_id__in": sorted(self.chosen_projects)})
        if self.projects == ComputingPreferences.Projects.ONLY:
            return ids
        if self.projects == ComputingPreferences.Projects.EXCEPT:
            return ~ids
        return Q()

    def allows(self, project_id: int) -> bool:
        chosen = project_id in self.chosen_projects
        if self.projects == ComputingPreferences.Projects.ONLY:
            return chosen
        return not chosen if self.projects == ComputingPreferences.Projects.EXCEPT else True

    @property
    def single_choice(self) -> bool:
        """The volunteer chose exactly one project: whatever it gets is their choice."""
        return self.projects == ComputingPreferences.Projects.ONLY and len(self.chosen_projects) == 1

    def max_work_unit_bytes(self) -> int | None:
        return None if self.max_work_unit_mb is None else self.max_work_unit_mb * MB

    def max_download_bytes(self) -> int | None:
        return None if self.max_download_mb_per_day is None else self.max_download_mb_per_day * MB


def _of(row: ComputingPreferences, *, chosen: frozenset[int], source: str) -> Preferences:
    return Preferences(
        duty_cycle=row.duty_cycle,
        pause_when_hidden=row.pause_when_hidden,
        pause_on_battery=row.pause_on_battery,
        battery_min_percent=row.battery_min_percent,
        pause_while_active=row.pause_while_active,
        projects=row.projects,
        chosen_projects=chosen,
        max_work_unit_mb=row.max_work_unit_mb,
        max_download_mb_per_day=row.max_download_mb_per_day,
        source=source,
    )


# The model's defaults, read from its fields so that the two cannot disagree.
DEFAULTS = _of(ComputingPreferences(), chosen=frozenset(), source="default")


# --- selectors ------------------------------------------------------------------------------------------


def preferences_effective(*, volunteer_id: int, device_id: int | None = None) -> Preferences:
    """The preferences `device_id` (None: any device of the volunteer's) works under. Two queries."""
    rows = ComputingPreferences.objects.filter(volunteer_id=volunteer_id).filter(
        Q(device__isnull=True) | Q(device_id=device_id) if device_id is not None else Q(device__isnull=True)
    )
    row = max(rows, key=lambda r: r.device_id is not None, default=None)  # the device's own first
    if row is None:
        return DEFAULTS
    chosen = frozenset(row.chosen_projects.values_list("pk", flat=True))
    return _of(row, chosen=chosen, source="device" if row.device_id else "volunteer")


def devices_allowing(*, devices: QuerySet[Device], project_id: int) -> QuerySet[Device]:
    """`devices` less those whose effective preferences refuse the project: in SQL what
    Preferences.allows says of each (its own override, else its volunteer's defaults, else any project), so
    that a round is planned for the devices that may take its units, without a query per device."""
    chosen = ComputingPreferences.chosen_projects.through.objects.filter(
        computingpreferences_id=OuterRef("pk"), project_id=project_id
    )
    only, unless = ComputingPreferences.Projects.ONLY, ComputingPreferences.Projects.EXCEPT
    refusing = ComputingPreferences.objects.alias(chosen=Exists(chosen)).filter(
        Q(projects=only, chosen=False) | Q(projects=unless, chosen=True)
    )
    own = ComputingPreferences.objects.filter(device=OuterRef("pk"))
    defaults = refusing.filter(volunteer=OuterRef("volunteer_id"), device__isnull=True)
    return devices.exclude(Exists(refusing.filter(device=OuterRef("pk")))).exclude(
        ~Exists(own) & Exists(defaults)
    )


def preferences_row(*, volunteer: Volunteer, device: Device | None) -> ComputingPreferences | None:
    """The stored set the preferences page edits: the device's override, or the volunteer's defaults."""
    return ComputingPreferences.objects.filter(volunteer=volunteer, device=device).first()


def preferences_devices(*, volunteer: Volunteer) -> list[Device]:
    """The volunteer's browsers, each marked `has_override`, for the page's chooser (most recent first)."""
    overridden = set(
        ComputingPreferences.objects.filter(volunteer=volunteer, device__isnull=False).values_list(
            "device_id", flat=True
        )
    )
    devices = list(
        Device.objects.filter(volunteer=volunteer).exclude(client_id__contains=":").order_by("-last_seen")
    )
    for device in devices:
        device.has_override = device.pk in overridden  # type: ignore[attr-defined]
    return devices


# --- services -------------------------------------------------------------------------------------------


def preferences_save(
    *, volunteer: Volunteer, device: Device | None, values: dict[str, Any], chosen_projects: list[int]
) -> ComputingPreferences:
    """Store the volunteer's defaults (device None) or a device's override, and tell their browsers.
    `values` are the model's fields by name, checked against its bounds (ValidationError) before saving."""
    if device is not None and device.volunteer_id != volunteer.pk:
        raise ValueError("a device's preferences belong to its own volunteer")
    if not set(values) <= set(FIELDS):
        raise ValueError(f"unknown preferences: {sorted(set(values) - set(FIELDS))}")
    with transaction.atomic():
        row = preferences_row(volunteer=volunteer, device=device) or ComputingPreferences(
            volunteer=volunteer, device=device
        )
        for name, value in values.items():
            setattr(row, name, value)
        row.full_clean(exclude=["volunteer", "device", "chosen_projects"], validate_constraints=False)
        row.save()
        row.chosen_projects.set(chosen_projects)
        transaction.on_commit(lambda: notify.preferences_changed(user_id=volunteer.user_id))
    return row


def preferences_forget_device(*, volunteer: Volunteer, device: Device) -> bool:
    """The device goes back to the volunteer's defaults; False if it had no override."""
    with transaction.atomic():
        deleted, _ = ComputingPreferences.objects.filter(volunteer=volunteer, device=device).delete()
        if deleted:
            transaction.on_commit(lambda: notify.preferences_changed(user_id=volunteer.user_id))
    return bool(deleted)
