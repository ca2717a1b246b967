"""The "your account" page: researcher status and request, and a researcher's API tokens."""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.contrib.auth.models import User
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_POST

from accounts.forms import ResearcherRequestForm
from accounts.selectors import api_token_list, researcher_request_latest, user_is_researcher
from accounts.services import AccountError, api_token_create, api_token_revoke, researcher_request_create


def _page(
    request: HttpRequest, *, form: ResearcherRequestForm | None = None, status: int = 200
) -> HttpResponse:
    user: User = request.user  # type: ignore[assignment]
    researcher = user_is_researcher(user=user)
    context = {
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
def researcher_request(request: HttpRequest) -> HttpResponse:
    form = ResearcherRequestForm(request.POST)
    if not form.is_valid():
        return _page(request, form=form, status=400)
    try:
        researcher_request_create(user=request.user, **form.cleaned_data)  # type: ignore[arg-type]
    except AccountError as exc:
        form.add_error(None, str(exc))
        return _page(request, form=form, status=409)
    messages.success(request, "Thank you: staff will look at your request soon.")
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
        messages.success(request, "Token revoked.")
        return redirect("account")
    messages.error(request, "No such token.")
    return redirect("account")
