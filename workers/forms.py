"""Forms of the volunteers' public side: a team's page and the leaderboards' filters (bounded input)."""

from __future__ import annotations

import unicodedata
from typing import Any

from django import forms
from django.core.validators import URLValidator
from django.utils.translation import gettext_lazy as _
from django_countries import countries

from workers.leaderboards import Order
from workers.models import Team

# Never in a name shown to others: controls, and format characters such as the right-to-left override that
# make one name read as another.
_HIDDEN_CATEGORIES = {"Cc", "Cf", "Cs", "Co", "Cn"}


def clean_public_text(value: str) -> str:
    """Whitespace runs become one space; invisible and control characters are refused."""
    if any(unicodedata.category(char) in _HIDDEN_CATEGORIES for char in value):
        raise forms.ValidationError(_("Use visible characters only."), code="invisible")
    return " ".join(value.split())


def country_field() -> forms.TypedChoiceField:
    return forms.TypedChoiceField(
        label=_("Country"), choices=[("", _("(none)")), *countries], required=False, empty_value=""
    )


def web_site_field() -> forms.URLField:
    """http(s) only: a javascript: or data: link on a public page would run in visitors' browsers."""
    return forms.URLField(
        label=_("Web site"),
        required=False,
        max_length=200,
        assume_scheme="https",
        validators=[URLValidator(schemes=["http", "https"])],
    )


class TeamForm(forms.ModelForm):
    country = country_field()
    url = web_site_field()

    class Meta:
        model = Team
        fields = ["name", "description", "url", "country"]
        labels = {"name": _("Name"), "description": _("Description")}
        help_texts = {"description": _("Plain text, shown on the team's page.")}
        widgets = {"description": forms.Textarea(attrs={"rows": 5, "maxlength": 4000})}

    def clean_name(self) -> str:
        name = clean_public_text(self.cleaned_data["name"])
        if not name:
            raise forms.ValidationError(_("A team needs a name."))
        taken = Team.objects.filter(name__iexact=name).exclude(pk=self.instance.pk)
        if taken.exists():
            raise forms.ValidationError(_("A team with this name already exists."))
        return name

    def clean_description(self) -> str:
        text: str = self.cleaned_data["description"]
        # Line breaks and tabs are text; other controls only hide things.
        return "".join(char for char in text if char in "\n\t" or unicodedata.category(char) != "Cc")


class FounderForm(forms.Form):
    """The member the founder hands the team to (choices: the team's other members)."""

    founder = forms.TypedChoiceField(label=_("New founder"), coerce=int)

    def __init__(self, *args: Any, members: list[tuple[int, str]], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        field: forms.TypedChoiceField = self.fields["founder"]  # type: ignore[assignment]
        field.choices = members


class BoardForm(forms.Form):
    """A board's query string: ?project=<id>&order=total|recent&page=<n>. Anything else: the defaults."""

    project = forms.IntegerField(required=False, min_value=1, max_value=2**63 - 1)
    order = forms.ChoiceField(
        choices=[(Order.TOTAL.value, _("Total credit")), (Order.RECENT.value, _("Recent average"))],
        required=False,
    )

    def filters(self) -> tuple[int | None, Order]:
        if not self.is_valid():
            return None, Order.TOTAL
        return self.cleaned_data["project"], Order(self.cleaned_data["order"] or Order.TOTAL)
