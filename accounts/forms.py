"""allauth's login and sign-up forms with the site's throttles (frontend/throttle.py), and the researcher
request form."""

from __future__ import annotations

from typing import Any

from allauth.account.forms import LoginForm, SignupForm
from allauth.core import context
from django import forms
from django.contrib.auth.models import User
from django.core.exceptions import ValidationError
from django.db import transaction
from django.http import HttpRequest

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
        labels = {"purpose": "What do you want to train?"}
