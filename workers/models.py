"""Volunteers, their devices and teams, and the credit ledger."""

from __future__ import annotations

from datetime import datetime

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
    # Adaptive replication as in BOINC: trust grows with consecutive valid results, an invalid one resets it.
    consecutive_valid = models.PositiveIntegerField(default=0)
    results_invalid = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return self.user.get_username()

    def is_trusted(self, *, threshold: int) -> bool:
        return self.consecutive_valid >= threshold


class Device(models.Model):
    volunteer = models.ForeignKey(Volunteer, on_delete=models.CASCADE, related_name="devices")
    backend = models.CharField(max_length=20)
    gflops = models.FloatField(default=0.0, help_text="Measured by the browser's benchmark.")
    observed_gflops = models.FloatField(default=0.0, help_text="Server-side FLOPs / reported compute time.")
    compute_ms = models.PositiveBigIntegerField(default=0, help_text="Time spent computing accepted work.")
    disconnected_at = models.DateTimeField(null=True, blank=True)
    user_agent = models.CharField(max_length=300, blank=True)
    last_seen = models.DateTimeField(auto_now=True)
    created_at = models.DateTimeField(auto_now_add=True)

    def connected_ms(self, *, now: datetime) -> int:
        end = self.disconnected_at or now
        return max(0, int((end - self.created_at).total_seconds() * 1000))

    def speed_gflops(self) -> float:
        """Observed throughput once known; the browser's own benchmark until then."""
        return self.observed_gflops or self.gflops or 1.0

    def observe(self, *, flops: int, compute_ms: int) -> None:
        if compute_ms <= 0:
            return
        measured = flops / (compute_ms * 1e6)
        # An exponential average: recent work units count most, one odd sample does not swing sizing.
        self.observed_gflops = (
            measured if not self.observed_gflops else 0.7 * self.observed_gflops + 0.3 * measured
        )
        self.compute_ms += compute_ms


class CreditEntry(models.Model):
    """One line of the ledger: FLOPs granted for one accepted result, computed on the server."""

    volunteer = models.ForeignKey(Volunteer, on_delete=models.CASCADE, related_name="credit")
    project = models.ForeignKey("projects.Project", on_delete=models.CASCADE, related_name="credit")
    result = models.OneToOneField("projects.Result", on_delete=models.CASCADE, related_name="credit")
    flops = models.BigIntegerField()
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)

    class Meta:
        verbose_name_plural = "credit entries"
