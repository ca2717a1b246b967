"""Admin for volunteers, teams, devices and the (read-only) credit ledger."""

from __future__ import annotations

from django.contrib import admin
from django.db.models import Count, Model, QuerySet
from django.http import HttpRequest

from frontend.templatetags.crowdtrain import format_flops
from projects.admin import ReadOnlyAdmin
from workers.models import CreditEntry, Device, Team, Volunteer


class DeviceInline(admin.TabularInline):
    model = Device
    fields = readonly_fields = ("backend", "gflops", "user_agent", "last_seen", "created_at")
    extra = 0
    can_delete = False

    def has_add_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        return False


@admin.register(Team)
class TeamAdmin(admin.ModelAdmin):
    list_display = ["name", "founder", "members", "flops", "created_at"]
    list_select_related = ["founder"]
    search_fields = ["name"]
    raw_id_fields = ["founder"]
    # Credit is what members earned while members (credit_grant keeps it): never typed in.
    readonly_fields = ["total_flops", "expavg_credit", "expavg_time", "created_at"]

    def get_queryset(self, request: HttpRequest) -> QuerySet[Team]:
        return super().get_queryset(request).annotate(member_count=Count("members"))

    @admin.display(description="members", ordering="member_count")
    def members(self, team: Team) -> int:
        return team.member_count  # type: ignore[attr-defined]

    @admin.display(description="total FLOPs", ordering="total_flops")
    def flops(self, team: Team) -> str:
        return format_flops(team.total_flops)


@admin.register(Volunteer)
class VolunteerAdmin(admin.ModelAdmin):
    list_display = ["user", "team", "flops", "results_accepted", "devices", "created_at"]
    list_filter = ["team", "created_at"]
    list_select_related = ["user", "team"]
    search_fields = ["user__username", "team__name"]
    readonly_fields = ["user", "flops", "total_flops", "results_accepted", "created_at"]
    fields = ["user", "team", "flops", "total_flops", "results_accepted", "created_at"]
    inlines = [DeviceInline]

    def get_queryset(self, request: HttpRequest) -> QuerySet[Volunteer]:
        return super().get_queryset(request).annotate(device_count=Count("devices"))

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # profiles are created at sign-up or on first connection

    @admin.display(description="total FLOPs", ordering="total_flops")
    def flops(self, volunteer: Volunteer) -> str:
        return format_flops(volunteer.total_flops)

    @admin.display(description="devices", ordering="device_count")
    def devices(self, volunteer: Volunteer) -> int:
        return volunteer.device_count  # type: ignore[attr-defined]


@admin.register(Device)
class DeviceAdmin(admin.ModelAdmin):
    list_display = ["volunteer", "backend", "gflops", "last_seen", "created_at"]
    list_filter = ["backend", "last_seen"]
    list_select_related = ["volunteer__user"]
    search_fields = ["volunteer__user__username", "user_agent"]
    readonly_fields = ["volunteer", "backend", "gflops", "user_agent", "last_seen", "created_at"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False


@admin.register(CreditEntry)
class CreditEntryAdmin(ReadOnlyAdmin):
    """The ledger; researchers see the credit granted on their own projects."""

    owner_path = "project__owner"
    list_display = ["created_at", "volunteer", "project", "result", "flops_human", "flops"]
    list_filter = [("project", admin.RelatedOnlyFieldListFilter)]
    list_select_related = ["volunteer__user", "project"]
    search_fields = ["volunteer__user__username", "project__name"]
    date_hierarchy = "created_at"
    raw_id_fields = ["volunteer", "project", "result"]

    @admin.display(description="FLOPs", ordering="flops")
    def flops_human(self, entry: CreditEntry) -> str:
        return format_flops(entry.flops)
