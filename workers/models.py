"""Volunteers, their devices and teams, and the credit ledger."""

from __future__ import annotations

import secrets
from datetime import datetime, timedelta

from django.conf import settings
from django.db import models
from django.utils import timezone

MAX_BIGINT = 2**63 - 1
MAX_OBSERVED_MS = 2**31 - 1  # what one result's compute time can be stored as (projects.Result.compute_ms)
# One invalid result can be a glitch (a GPU that overheated); this many in a row start a back-off.
INVALID_STREAK = 2


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
    # BOINC's error back-off: a run of invalid results earns a pause in new work that doubles each time, so
    # a poisoning account stops holding the work units of each round for honest volunteers.
    consecutive_invalid = models.PositiveIntegerField(default=0)
    no_work_until = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return self.user.get_username()

    def is_trusted(self, *, threshold: int) -> bool:
        return self.consecutive_valid >= threshold

    def may_work(self, *, now: datetime) -> bool:
        return self.no_work_until is None or self.no_work_until <= now

    def record_invalid(self, *, now: datetime) -> None:
        """One more invalid result: trust is gone, and a streak of them pauses new work (1, 2, 4... x the
        back-off, up to the cap)."""
        self.consecutive_valid = 0
        self.results_invalid += 1
        self.consecutive_invalid += 1
        streak = self.consecutive_invalid - INVALID_STREAK
        if streak >= 0:
            limits = settings.CROWDTRAIN
            pause = limits["INVALID_BACKOFF_SECONDS"] * 2 ** min(streak, 32)
            self.no_work_until = now + timedelta(seconds=min(pause, limits["INVALID_BACKOFF_MAX_SECONDS"]))


def server_client_id() -> str:
    """For devices the server creates itself; the colon keeps them apart from browsers' ids."""
    return f"server:{secrets.token_hex(8)}"


class Device(models.Model):
    """One browser (or simulator) of a volunteer, kept across its connections."""

    volunteer = models.ForeignKey(Volunteer, on_delete=models.CASCADE, related_name="devices")
    # The browser's own random id; "unknown:<backend>" for clients that send none (one per backend).
    client_id = models.CharField(max_length=64, default=server_client_id)
    backend = models.CharField(max_length=20)
    gflops = models.FloatField(default=0.0, help_text="Measured by the browser's benchmark.")
    observed_gflops = models.FloatField(default=0.0, help_text="Server-side FLOPs / reported compute time.")
    compute_ms = models.PositiveBigIntegerField(default=0, help_text="Time spent computing accepted work.")
    connected_at = models.DateTimeField(default=timezone.now, help_text="Start of the latest connection.")
    disconnected_at = models.DateTimeField(null=True, blank=True)
    online_ms = models.PositiveBigIntegerField(default=0, help_text="Connected time of earlier connections.")
    user_agent = models.CharField(max_length=300, blank=True)
    last_seen = models.DateTimeField(auto_now=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["volunteer", "client_id"], name="device_one_row_per_browser")
        ]

    def connected_ms(self, *, now: datetime) -> int:
        """All connections' time together; the time between them (the browser was away) does not count."""
        if self.disconnected_at is not None:
            return self.online_ms
        return self.online_ms + max(0, int((now - self.connected_at).total_seconds() * 1000))

    def reconnect(self, *, backend: str, gflops: float, user_agent: str, now: datetime) -> None:
        """A new connection: bank the time so far (a second tab's connection may still be open) and take
        the browser's fresh description."""
        self.online_ms = self.connected_ms(now=now)
        self.connected_at, self.disconnected_at = now, None
        self.backend, self.gflops, self.user_agent = backend, gflops, user_agent[:300]

    def disconnect(self, *, now: datetime) -> None:
        if self.disconnected_at is None:
            self.online_ms = self.connected_ms(now=now)
            self.disconnected_at = now

    def speed_gflops(self) -> float:
        """Observed throughput once known; the browser's own benchmark until then."""
        return self.observed_gflops or self.gflops or 1.0

    def observe(self, *, flops: int, compute_ms: int) -> None:
        """One accepted result's server-side FLOPs over its compute time. Callers bound the time by the
        time the work was out (lifecycle.result_receive); the bounds here keep a bad value finite and
        within the 64-bit column anyway."""
        if compute_ms <= 0 or flops <= 0:
            return
        compute_ms = min(compute_ms, MAX_OBSERVED_MS)
        measured = min(flops, MAX_BIGINT) / (compute_ms * 1e6)
        # An exponential average: recent work units count most, one odd sample does not swing sizing.
        self.observed_gflops = (
            measured if not self.observed_gflops else 0.7 * self.observed_gflops + 0.3 * measured
        )
        self.compute_ms = min(self.compute_ms + compute_ms, MAX_BIGINT)


class CreditEntry(models.Model):
    """One line of the ledger: FLOPs granted for one accepted result, computed on the server."""

    volunteer = models.ForeignKey(Volunteer, on_delete=models.CASCADE, related_name="credit")
    project = models.ForeignKey("projects.Project", on_delete=models.CASCADE, related_name="credit")
    result = models.OneToOneField("projects.Result", on_delete=models.CASCADE, related_name="credit")
    flops = models.BigIntegerField()
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)

    class Meta:
        verbose_name_plural = "credit entries"
