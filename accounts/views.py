"""The "your account" page: profile, devices (rename, forget), credit per project, recent results, a download
of all one's data and the deletion of the account; researcher status and request, a researcher's API tokens.
Every action acts on the logged-in user's own rows only: anyone else's id is a 404."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

from asgiref.sync import sync_to_async
from django.contrib import messages
from django.contrib.auth import logout
from django.contrib.auth.decorators import login_required
from django.contrib.auth.models import User
from django.core.handlers.asgi import ASGIRequest
from django.http import Http404, HttpRequest, HttpResponse, StreamingHttpResponse
from django.shortcuts import redirect, render
from django.utils import timezone
from django.utils.translation import gettext as _
from django.views.decorators.http import require_POST
from django_ratelimit.core import is_ratelimited

from accounts.export import account_export
from accounts.forms import AccountDeleteForm, DeviceNameForm, ProfileForm, ResearcherRequestForm
from accounts.selectors import (
    account_credit_by_project,
    account_devices,
    account_email,
    account_results_recent,
    api_token_list,
    researcher_request_latest,
    user_is_researcher,
)
from accounts.services import (
    AccountError,
    account_delete,
    api_token_create,
    api_token_revoke,
    device_forget,
    device_rename,
    researcher_request_create,
    volunteer_profile_update,
)
from frontend.throttle import THROTTLED
from workers.models import Device, Volunteer
from workers.services import volunteer_ensure

# Downloads of one's data per user: each reads every row of the account.
EXPORT_RATE = "20/h"


def _page(
    request: HttpRequest,
    *,
    form: ResearcherRequestForm | None = None,
    profile_form: ProfileForm | None = None,
    status: int = 200,
) -> HttpResponse:
    user: User = request.user  # type: ignore[assignment]
    volunteer = volunteer_ensure(user=user)
    researcher = user_is_researcher(user=user)
    context = {
        "volunteer": volunteer,
        "recent_credit": volunteer.recent_credit(now=timezone.now()),
        "email": account_email(user=user),
        "profile_form": profile_form or ProfileForm(instance=volunteer),
        "devices": list(account_devices(volunteer=volunteer)),
        "project_credit": account_credit_by_project(volunteer=volunteer),
        "results": account_results_recent(user=user),
        "is_researcher": researcher,
        "researcher_request": researcher_request_latest(user=user),
        "form": form or ResearcherRequestForm(),
        "tokens": list(api_token_list(user=user)) if researcher else [],
        "new_token": request.session.pop("new_api_token", None),
    }
    return render(request, "accounts/account.html", context, status=status)


@login_required
def account(request: HttpRequest) -> HttpResponse:
    return _page(request)


@login_required
@require_POST
def profile(request: HttpRequest) -> HttpResponse:
    volunteer: Volunteer = volunteer_ensure(user=request.user)  # type: ignore[arg-type]
    form = ProfileForm(request.POST, instance=volunteer)
    if not form.is_valid():
        return _page(request, profile_form=form, status=400)
    volunteer_profile_update(user=request.user, **form.cleaned_data)  # type: ignore[arg-type]
    messages.success(request, _("Profile saved."))
    return redirect("account")


@login_required
@require_POST
def device_name(request: HttpRequest, device_id: int) -> HttpResponse:
    form = DeviceNameForm(request.POST)
    if not form.is_valid():
        messages.error(request, "; ".join(str(error) for error in form.errors["name"]))
        return redirect("account")
    try:
        device_rename(user=request.user, device_id=device_id, name=form.cleaned_data["name"])  # type: ignore[arg-type]
    except Device.DoesNotExist as exc:
        raise Http404(_("No such device.")) from exc
    messages.success(request, _("Device renamed."))
    return redirect("account")


@login_required
@require_POST
def device_forget_view(request: HttpRequest, device_id: int) -> HttpResponse:
    try:
        device_forget(user=request.user, device_id=device_id)  # type: ignore[arg-type]
    except Device.DoesNotExist as exc:
        raise Http404(_("No such device.")) from exc
    messages.success(
        request, _("Device forgotten. If that browser contributes again, it appears as a new device.")
    )
    return redirect("account")


@login_required
def export(request: HttpRequest) -> HttpResponse | StreamingHttpResponse:
    if is_ratelimited(request, group="account-export", key="user", rate=EXPORT_RATE, increment=True):
        return HttpResponse(_("Too many downloads of your data; try again in an hour."), status=429)
    chunks = account_export(user=request.user)  # type: ignore[arg-type]
    stamp = timezone.now().strftime("%Y%m%d")
    response = StreamingHttpResponse(
        _async_chunks(chunks) if isinstance(request, ASGIRequest) else chunks,
        content_type="application/json; charset=utf-8",
    )
    response["Content-Disposition"] = f'attachment; filename="crowdtrain-account-{stamp}.json"'
    response["Cache-Control"] = "no-store"
    return response


async def _async_chunks(chunks: Iterator[str]) -> AsyncIterator[str]:
    """Under ASGI a synchronous iterator would be read whole into memory before sending: one piece at a time,
    in the request's thread (the one its database connection belongs to)."""
    step = sync_to_async(_next, thread_sensitive=True)
    while (chunk := await step(chunks)) is not None:
        yield chunk


def _next(chunks: Iterator[str]) -> str | None:
    return next(chunks, None)


@login_required
def delete(request: HttpRequest) -> HttpResponse:
    form = AccountDeleteForm(request.POST or None, request=request)
    if request.method != "POST" or not form.is_valid():
        status = 200 if request.method != "POST" else 429 if form.has_error("password", THROTTLED) else 400
        return render(request, "accounts/account_delete.html", {"form": form}, status=status)
    try:
        account_delete(user=request.user)  # type: ignore[arg-type]
    except AccountError as exc:
        form.add_error(None, str(exc))
        return render(request, "accounts/account_delete.html", {"form": form}, status=409)
    logout(request)
    messages.success(request, _("Your account is deleted. Thank you for the work your devices did."))
    return redirect("home")


# --- researchers ----------------------------------------------------------------------------------------


@login_required
@require_POST
def researcher_request(request: HttpRequest) -> HttpResponse:
    form = ResearcherRequestForm(request.POST)
    if not form.is_valid():
        return _page(request, form=form, status=400)
    try:
        researcher_request_create(user=request.user, **form.cleaned_data)  # type: ignore[arg-type]
    except AccountError as exc:
        form.add_error(None, str(exc))
        return _page(request, form=form, status=409)
    messages.success(request, _("Thank you: staff will look at your request soon."))
    return redirect("account")


@login_required
@require_POST
def token_create(request: HttpRequest) -> HttpResponse:
    try:
        _, token = api_token_create(user=request.user)  # type: ignore[arg-type]
    except AccountError as exc:
        messages.error(request, str(exc))
        return redirect("account")
    # Shown once, on the page the redirect leads to; only its hash is stored.
    request.session["new_api_token"] = token
    return redirect("account")


@login_required
@require_POST
def token_revoke(request: HttpRequest) -> HttpResponse:
    digest = str(request.POST.get("digest", ""))[:200]
    if api_token_revoke(user=request.user, digest=digest):  # type: ignore[arg-type]
        messages.success(request, _("Token revoked."))
        return redirect("account")
    messages.error(request, _("No such token."))
    return redirect("account")
