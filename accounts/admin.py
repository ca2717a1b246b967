"""Staff decide researcher requests with admin actions (approve, reject)."""

from __future__ import annotations

from collections.abc import Callable

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest

from accounts.models import ResearcherRequest
from accounts.services import AccountError, researcher_request_approve, researcher_request_reject

Decide = Callable[..., ResearcherRequest]


@admin.register(ResearcherRequest)
class ResearcherRequestAdmin(admin.ModelAdmin):
    list_display = ["user", "affiliation", "status", "created_at", "decided_by", "decided_at"]
    list_filter = ["status", "created_at"]
    search_fields = ["user__username", "affiliation", "purpose"]
    readonly_fields = ["user", "affiliation", "purpose", "status", "created_at", "decided_at", "decided_by"]
    actions = ["approve", "reject"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # users ask on the site (/account/)

    @admin.action(description="Approve: researcher account (admin for own projects, API tokens)")
    def approve(self, request: HttpRequest, queryset: QuerySet[ResearcherRequest]) -> None:
        self._decide(request, queryset, researcher_request_approve, "approved")

    @admin.action(description="Reject")
    def reject(self, request: HttpRequest, queryset: QuerySet[ResearcherRequest]) -> None:
        self._decide(request, queryset, researcher_request_reject, "rejected")

    def _decide(
        self, request: HttpRequest, queryset: QuerySet[ResearcherRequest], decide: Decide, done: str
    ) -> None:
        count = 0
        for researcher_request in queryset.select_related("user"):
            try:
                decide(researcher_request=researcher_request, by=request.user)
                count += 1
            except AccountError as exc:
                self.message_user(request, f"{researcher_request.user}: {exc}", messages.WARNING)
        self.message_user(request, f"{count} request(s) {done}.", messages.SUCCESS)
