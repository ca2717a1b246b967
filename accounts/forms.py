"""allauth's login and sign-up forms with the site's throttles (frontend/throttle.py), the researcher request
form, and the forms of a volunteer's own account page: profile, a device's name, deleting the account."""

from __future__ import annotations

from typing import Any

from allauth.account.forms import LoginForm, SignupForm
from allauth.core import context
from django import forms
from django.contrib.auth.models import User
from django.core.exceptions import ValidationError
from django.db import transaction
from django.http import HttpRequest
from django.utils.translation import gettext_lazy as _

from accounts.models import MAX_PURPOSE_CHARS, ResearcherRequest
from frontend.throttle import (
    LOGIN_REFUSED,
    SIGNUP_REFUSED,
    THROTTLED,
    login_failed,
    login_refused,
    signup_counted,
    signup_refused,
)
from workers.forms import clean_public_text, country_field, web_site_field
from workers.models import Volunteer
from workers.services import volunteer_ensure


class ThrottledLoginForm(LoginForm):
    """Refused before authenticating once the limit is spent (a 429: frontend.throttle.throttled_status);
    a failure to log in counts, against the address and the account, as on the admin's login."""

    def clean(self) -> dict[str, Any]:
        username = str(self.data.get("login") or "")
        if self.request is not None and login_refused(self.request, username=username):
            raise ValidationError(LOGIN_REFUSED, code=THROTTLED)
        try:
            return super().clean()
        except ValidationError:
            if self.request is not None:
                login_failed(self.request, username=username)
            raise


class ThrottledSignupForm(SignupForm):
    """Sign-ups per address are limited; every account is a volunteer from the start."""

    def clean(self) -> dict[str, Any]:
        request = context.request
        if request is not None and signup_refused(request):
            raise ValidationError(SIGNUP_REFUSED, code=THROTTLED)
        return super().clean()

    @transaction.atomic
    def save(self, request: HttpRequest) -> User:
        user: User = super().save(request)
        volunteer_ensure(user=user)
        signup_counted(request)
        return user


class ResearcherRequestForm(forms.ModelForm):
    class Meta:
        model = ResearcherRequest
        fields = ["affiliation", "purpose"]
        widgets = {"purpose": forms.Textarea(attrs={"rows": 5, "maxlength": MAX_PURPOSE_CHARS})}
        labels = {"affiliation": _("Affiliation"), "purpose": _("What do you want to train?")}
        help_texts = {
            "affiliation": _("University, lab or company."),
            "purpose": _("What you want to train, and on what."),
        }


# --- the volunteer's own account (/account/) ----------------------------------------------------------


class ProfileForm(forms.ModelForm):
    """What others see of a volunteer: the name on leaderboards, a country, a web site."""

    country = country_field()
    url = web_site_field()

    class Meta:
        model = Volunteer
        fields = ["display_name", "country", "url"]
        labels = {"display_name": _("Name shown to others")}
        help_texts = {"display_name": _("On leaderboards and team pages; empty: your username.")}

    def clean_display_name(self) -> str:
        return clean_public_text(self.cleaned_data["display_name"])


class DeviceNameForm(forms.Form):
    name = forms.CharField(label=_("Name"), max_length=60, required=False)

    def clean_name(self) -> str:
        return clean_public_text(self.cleaned_data["name"])


class AccountDeleteForm(forms.Form):
    """The password again: a session left open on a shared computer is not enough to delete an account.
    Wrong passwords count against the same budget as failed log-ins (frontend/throttle.py)."""

    password = forms.CharField(label=_("Your password"), strip=False, widget=forms.PasswordInput)

    def __init__(self, *args: Any, request: HttpRequest, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.request = request

    def clean_password(self) -> str:
        user: User = self.request.user  # type: ignore[assignment]
        password: str = self.cleaned_data["password"]
        if login_refused(self.request, username=user.get_username()):
            raise ValidationError(LOGIN_REFUSED, code=THROTTLED)
        if not user.check_password(password):
            login_failed(self.request, username=user.get_username())
            raise ValidationError(_("That is not your password."), code="wrong_password")
        return password
