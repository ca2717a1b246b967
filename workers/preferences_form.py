"""The computing preferences form (/account/preferences/): every field bounded, as the model's checks are."""

from __future__ import annotations

from typing import Any

from django import forms
from django.db.models import QuerySet
from django.utils.translation import gettext_lazy as _

from projects.models import Project
from workers.models import DUTY_CYCLE_MAX, DUTY_CYCLE_MIN, MAX_PREFERENCE_MB, ComputingPreferences
from workers.preferences import FIELDS


def choosable_projects() -> QuerySet[Project]:
    """Projects a volunteer may opt in or out of: those that are or were sending work."""
    return Project.objects.filter(status__in=[Project.Status.RUNNING, Project.Status.PAUSED]).order_by("name")


class PreferencesForm(forms.ModelForm):
    duty_cycle = forms.IntegerField(
        label=_("Use at most this share of the time (%)"),
        min_value=DUTY_CYCLE_MIN,
        max_value=DUTY_CYCLE_MAX,
        help_text=_("Your browser rests between work units so that it computes this share of the time."),
    )
    battery_min_percent = forms.IntegerField(
        label=_("Pause when the battery is below (%)"),
        min_value=0,
        max_value=100,
        help_text=_("0: never. Where the browser tells the battery's charge (Chrome, Edge, Opera)."),
    )
    max_work_unit_mb = forms.IntegerField(
        label=_("Largest work unit (MB)"),
        min_value=1,
        max_value=MAX_PREFERENCE_MB,
        required=False,
        help_text=_("What one work unit may download and hold in memory. Empty: no limit but your device's."),
    )
    max_download_mb_per_day = forms.IntegerField(
        label=_("Download at most (MB per day)"),
        min_value=1,
        max_value=MAX_PREFERENCE_MB,
        required=False,
        help_text=_("Per device and UTC day. Empty: no limit."),
    )
    chosen_projects = forms.ModelMultipleChoiceField(
        label=_("Projects sending work"),
        queryset=Project.objects.none(),
        required=False,
        widget=forms.CheckboxSelectMultiple,
    )

    class Meta:
        model = ComputingPreferences
        fields = [*FIELDS, "chosen_projects"]
        labels = {
            "pause_when_hidden": _("Pause while this tab is hidden"),
            "pause_on_battery": _("Pause while the battery is discharging"),
            "pause_while_active": _("Pause while I type or move the mouse on the page"),
            "projects": _("Work for"),
        }
        help_texts = {
            "pause_when_hidden": _("The work unit being computed finishes first."),
            "pause_on_battery": _("A laptop or phone running on its battery rests until plugged in."),
            "pause_while_active": _("Training resumes a few seconds after your last input."),
            "projects": "",
        }
        widgets = {"projects": forms.RadioSelect}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("instance") is None:  # nothing stored yet: the form starts from the model's defaults
            kwargs["instance"] = ComputingPreferences()
        super().__init__(*args, **kwargs)
        self.fields["chosen_projects"].queryset = choosable_projects()  # type: ignore[attr-defined]
        self.fields["projects"].choices = ComputingPreferences.Projects.choices  # type: ignore[attr-defined]

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        if data.get("projects") == ComputingPreferences.Projects.ONLY and not data.get("chosen_projects"):
            self.add_error("chosen_projects", _("Tick at least one project, or choose any project."))
        if data.get("projects") == ComputingPreferences.Projects.ANY:
            data["chosen_projects"] = Project.objects.none()  # nothing to keep: every project is chosen
        return data

    def values(self) -> dict[str, Any]:
        """The cleaned fields, as workers.preferences.preferences_save takes them."""
        return {name: self.cleaned_data[name] for name in FIELDS}

    def chosen_project_ids(self) -> list[int]:
        return sorted(project.pk for project in self.cleaned_data["chosen_projects"])
