"""Volunteers, their devices and teams, and the credit ledger."""

from __future__ import annotations

from django.conf import settings
from django.db import models


class Team(models.Model):
    name = models.CharField(max_length=100, unique=True)
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return self.name


class Volunteer(models.Model):
    user = models.OneToOneField(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="volunteer")
    team = models.ForeignKey(Team, on_delete=models.SET_NULL, null=True, blank=True, related_name="members")
    # Denormalised sum of this volunteer's CreditEntry rows, updated in the same transaction.
    total_flops = models.BigIntegerField(default=0)
    results_accepted = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return self.user.get_username()


class Device(models.Model):
    volunteer = models.ForeignKey(Volunteer, on_delete=models.CASCADE, related_name="devices")
    backend = models.CharField(max_length=20)
    gflops = models.FloatField(default=0.0, help_text="Measured by the browser's benchmark.")
    user_agent = models.CharField(max_length=300, blank=True)
    last_seen = models.DateTimeField(auto_now=True)
    created_at = models.DateTimeField(auto_now_add=True)


class CreditEntry(models.Model):
    """One line of the ledger: FLOPs granted for one accepted result, computed on the server."""

    volunteer = models.ForeignKey(Volunteer, on_delete=models.CASCADE, related_name="credit")
    project = models.ForeignKey("projects.Project", on_delete=models.CASCADE, related_name="credit")
    result = models.OneToOneField("projects.Result", on_delete=models.CASCADE, related_name="credit")
    flops = models.BigIntegerField()
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)

    class Meta:
        verbose_name_plural = "credit entries"
