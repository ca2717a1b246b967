"""Throttles on what anyone may hammer over HTTP: logins (the site's and the admin's) and sign-ups.

django-ratelimit counts in the Redis cache that every process shares. Logins count failures only, per
address and per account: a lab behind one NAT, or a fleet of simulated volunteers, logging in is never held
up, while past CROWDTRAIN_LOGIN_RATE even the right password is refused until the window passes, so guessing
goes no faster than that rate however fast the guesser. A refused attempt never reaches the password hasher.
Sign-ups count the accounts created from one address. WebSocket connects are throttled in workers/.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable
from functools import wraps
from typing import Any

from django.conf import settings
from django.contrib.admin.forms import AdminAuthenticationForm
from django.contrib.auth.forms import AuthenticationForm
from django.core.exceptions import NON_FIELD_ERRORS, ValidationError
from django.http import HttpRequest, HttpResponseBase
from django.utils.translation import gettext_lazy as _
from django_ratelimit.core import get_usage

LOGIN_REFUSED = _(
    "Too many failed log-ins for this account or from your address. Wait a minute and try again."
)
SIGNUP_REFUSED = _("Too many sign-ups from your address. Try again later.")
THROTTLED = "throttled"  # the code of the form error that makes its page a 429
UNKNOWN_ADDRESS = "0.0.0.0"  # every unparsable address shares one counter

View = Callable[..., HttpResponseBase]


def client_ip(request: HttpRequest) -> str:
    """REMOTE_ADDR, or the X-Forwarded-For entry CROWDTRAIN_TRUSTED_PROXIES from the right when proxies are
    trusted (entries further left are whatever the client claimed). Always a valid address: django-ratelimit
    would fail on anything else."""
    hops = settings.CROWDTRAIN_TRUSTED_PROXIES
    forwarded = request.META.get("HTTP_X_FORWARDED_FOR", "").split(",")
    if hops > 0 and len(forwarded) >= hops and (address := _address(forwarded[-hops])):
        return address
    return _address(request.META.get("REMOTE_ADDR", "")) or UNKNOWN_ADDRESS


def _address(text: str) -> str | None:
    try:
        address = ipaddress.ip_address(text.strip())
    except ValueError:
        return None
    return None if getattr(address, "scope_id", None) else str(address)


# --- counters ---------------------------------------------------------------------------------------


def _spent(request: HttpRequest, *, group: str, rate: str, value: str) -> bool:
    usage = get_usage(request, group=group, key=lambda _group, _request: value, rate=rate, increment=False)
    return usage is not None and usage["count"] >= usage["limit"]


def _count(request: HttpRequest, *, group: str, rate: str, value: str) -> None:
    get_usage(request, group=group, key=lambda _group, _request: value, rate=rate, increment=True)


def _login_keys(request: HttpRequest, username: str) -> list[tuple[str, str]]:
    return [("login-address", client_ip(request)), ("login-account", username.casefold())]


def login_refused(request: HttpRequest, *, username: str) -> bool:
    rate = settings.CROWDTRAIN_LOGIN_RATE
    return any(_spent(request, group=g, rate=rate, value=v) for g, v in _login_keys(request, username))


def login_failed(request: HttpRequest, *, username: str) -> None:
    for group, value in _login_keys(request, username):
        _count(request, group=group, rate=settings.CROWDTRAIN_LOGIN_RATE, value=value)


def signup_refused(request: HttpRequest) -> bool:
    return _spent(request, group="signup", rate=settings.CROWDTRAIN_SIGNUP_RATE, value=client_ip(request))


def signup_counted(request: HttpRequest) -> None:
    _count(request, group="signup", rate=settings.CROWDTRAIN_SIGNUP_RATE, value=client_ip(request))


# --- forms and views ----------------------------------------------------------------------------------


class ThrottledAuthenticationForm(AuthenticationForm):
    """Refused before authenticating once the limit is spent; a failure to log in counts."""

    def clean(self) -> dict[str, Any]:
        username = str(self.data.get("username") or "")
        if self.request is None:  # Django's login views always pass it
            return super().clean()
        if login_refused(self.request, username=username):
            raise ValidationError(LOGIN_REFUSED, code=THROTTLED)
        try:
            return super().clean()
        except ValidationError:
            login_failed(self.request, username=username)
            raise


class ThrottledAdminAuthenticationForm(ThrottledAuthenticationForm, AdminAuthenticationForm):
    """The admin's form (staff only), sharing the site's counters: one budget of guesses, not two."""


def throttled_status(view: View) -> View:
    """Answer 429 Too Many Requests when the page's form was refused by a throttle (the form says why)."""

    @wraps(view)
    def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponseBase:
        response = view(request, *args, **kwargs)
        form = (getattr(response, "context_data", None) or {}).get("form")
        if form is not None and form.is_bound and form.has_error(NON_FIELD_ERRORS, THROTTLED):
            response.status_code = 429
        return response

    return wrapper
