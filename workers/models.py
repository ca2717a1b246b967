"""Volunteers, their devices and teams, and the credit ledger."""

from __future__ import annotations

import secrets
from datetime import datetime, timedelta
from typing import Protocol

from django.conf import settings
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models
from django.db.models.functions import Lower
from django.utils import timezone
from django.utils.translation import gettext_lazy as _

from engine import spec
from workers.credit import credit_from_flops, decayed, update_average

MAX_BIGINT = 2**63 - 1
MAX_OBSERVED_MS = 2**31 - 1  # what one result's compute time can be stored as (projects.Result.compute_ms)
# One invalid result can be a glitch (a GPU that overheated); this many in a row start a back-off.
INVALID_STREAK = 2


class _Credited(Protocol):
    total_flops: int
    expavg_credit: float
    expavg_time: datetime | None


class RecentCredit:
    """A row that earns credit: its total (FLOPs) and BOINC's recent average credit (workers/credit.py)."""

    CREDIT_FIELDS = ("total_flops", "expavg_credit", "expavg_time")

    def total_credit(self: _Credited) -> float:
        return credit_from_flops(self.total_flops)

    def recent_credit(self: _Credited, *, now: datetime) -> float:
        """The stored average decayed to `now`: it changes only when credit is granted."""
        since = self.expavg_time.timestamp() if self.expavg_time else None
        return decayed(avg=self.expavg_credit, avg_time=since, now=now.timestamp())

    def add_credit(self: _Credited, *, flops: int, now: datetime) -> None:
        """Callers hold the row's lock (workers.services.credit_grant): read, add and write as one."""
        _add_credit(self, flops=flops, now=now)


def _add_credit(row: _Credited, *, flops: int, now: datetime) -> None:
    since = row.expavg_time.timestamp() if row.expavg_time else None
    row.expavg_credit = update_average(
        avg=row.expavg_credit, avg_time=since, credit=credit_from_flops(flops), now=now.timestamp()
    )
    # Never backwards: a grant stamped a moment earlier may commit after a later one.
    row.expavg_time = max(now, row.expavg_time) if row.expavg_time else now
    row.total_flops = min(row.total_flops + flops, MAX_BIGINT)


class Team(RecentCredit, models.Model):
    name = models.CharField(max_length=100, unique=True)
    # The founder edits the team's page and may hand it over; null once the founder's account is deleted.
    founder = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="founded_teams",
    )
    description = models.TextField(max_length=4000, blank=True)
    url = models.URLField(blank=True)
    country = models.CharField(max_length=2, blank=True, help_text="ISO 3166-1 alpha-2 code.")
    # As BOINC: credit its members earned while members (joining brings none, leaving takes none away).
    total_flops = models.BigIntegerField(default=0)
    # BOINC's recent average credit (credit per day, 7-day half-life) and when it was last decayed.
    expavg_credit = models.FloatField(default=0.0)
    expavg_time = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(Lower("name"), name="team_name_unique_ignoring_case")]

    def __str__(self) -> str:
        return self.name


class Volunteer(RecentCredit, models.Model):
    user = models.OneToOneField(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="volunteer")
    team = models.ForeignKey(Team, on_delete=models.SET_NULL, null=True, blank=True, related_name="members")
    # When the volunteer joined their team: a founder who leaves hands the team to its longest member.
    team_joined_at = models.DateTimeField(null=True, blank=True)
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
    display_name = models.CharField(
        max_length=100, blank=True, help_text="Shown on leaderboards instead of the username."
    )
    country = models.CharField(max_length=2, blank=True, help_text="ISO 3166-1 alpha-2 code.")
    url = models.URLField(blank=True)
    # BOINC's recent average credit (credit per day, 7-day half-life) and when it was last decayed.
    expavg_credit = models.FloatField(default=0.0)
    expavg_time = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return self.user.get_username()

    def public_name(self) -> str:
        return self.display_name or self.user.get_username()

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


class Device(RecentCredit, models.Model):
    """One browser (or simulator) of a volunteer, kept across its connections."""

    volunteer = models.ForeignKey(Volunteer, on_delete=models.CASCADE, related_name="devices")
    # The browser's own random id; "unknown:<backend>" for clients that send none (one per backend).
    client_id = models.CharField(max_length=64, default=server_client_id)
    name = models.CharField(max_length=60, blank=True, help_text="The volunteer's own name for it.")
    # Credit of the results this device computed (BOINC's host total_credit), and its recent average
    # (credit per day, 7-day half-life).
    total_flops = models.BigIntegerField(default=0)
    expavg_credit = models.FloatField(default=0.0)
    expavg_time = models.DateTimeField(null=True, blank=True)
    backend = models.CharField(max_length=20)
    gflops = models.FloatField(default=0.0, help_text="Measured by the browser's benchmark.")
    observed_gflops = models.FloatField(default=0.0, help_text="Server-side FLOPs / reported compute time.")
    compute_ms = models.PositiveBigIntegerField(default=0, help_text="Time spent computing accepted work.")
    # How long its work units wait for their downloads before computing starts (an average of what its
    # accepted results reported; a unit prefetched while another computed downloaded meanwhile, so this is
    # an upper bound): a unit that must end with its round is planned that much shorter.
    start_ms = models.PositiveIntegerField(
        default=0, help_text="Observed time from a work unit's arrival to the start of its computing."
    )
    connected_at = models.DateTimeField(default=timezone.now, help_text="Start of the latest connection.")
    disconnected_at = models.DateTimeField(null=True, blank=True)
    # Connected but paused by its volunteer's preferences (a hidden tab, a battery, typing) for longer than
    # the browser waits before giving back unstarted work (protocol `pause`): crowd rounds are not planned
    # for it. Cleared when it resumes and at every hello (a new page starts unpaused).
    paused_at = models.DateTimeField(null=True, blank=True)
    # When such a pause last ended: a device that resumed after its crowd round was planned was left out of
    # it, and joins it as one that connected since would (projects.lifecycle._joiners_feed).
    resumed_at = models.DateTimeField(null=True, blank=True)
    # The channel name of its current connection (the latest hello's): the departure of an older one noticed
    # after that hello must not disconnect it (7,158 of 9,980 live devices were shown disconnected, issue 15).
    connection = models.CharField(max_length=100, blank=True, default="")
    online_ms = models.PositiveBigIntegerField(default=0, help_text="Connected time of earlier connections.")
    user_agent = models.CharField(max_length=300, blank=True)
    # Stamped at every save and, while connected, every heartbeat by its web process (workers/presence.py).
    last_seen = models.DateTimeField(auto_now=True)
    created_at = models.DateTimeField(auto_now_add=True)
    # Forgotten by its volunteer (accounts.services.device_forget): hidden from their pages and detached from
    # its browser, but kept, with its credit, so that host totals still add up to the ledger.
    forgotten_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["volunteer", "client_id"], name="device_one_row_per_browser")
        ]
        # The beat sweep's question (workers/liveness.py): connected devices not heard from for a while.
        indexes = [
            models.Index(
                fields=["last_seen"],
                condition=models.Q(disconnected_at__isnull=True),
                name="device_connected_last_seen",
            )
        ]

    def connected_ms(self, *, now: datetime) -> int:
        """All connections' time together; the time between them (the browser was away) does not count."""
        if self.disconnected_at is not None:
            return self.online_ms
        return self.online_ms + max(0, int((now - self.connected_at).total_seconds() * 1000))

    def reconnect(
        self, *, backend: str, gflops: float, user_agent: str, now: datetime, connection: str = ""
    ) -> None:
        """A new connection: bank the time so far (a second tab's connection may still be open) and take
        the browser's fresh description."""
        self.online_ms = self.connected_ms(now=now)
        self.connected_at, self.disconnected_at, self.connection = now, None, connection
        self.paused_at = None
        self.backend, self.gflops, self.user_agent = backend, gflops, user_agent[:300]

    def disconnect(self, *, now: datetime) -> None:
        if self.disconnected_at is None:
            self.online_ms = self.connected_ms(now=now)
            self.disconnected_at = now

    def available_since(self) -> datetime:
        """Since when this device could take work: its connection, or the end of its latest lasting pause."""
        return max(self.connected_at, self.resumed_at or self.connected_at)

    def speed_gflops(self) -> float:
        """Observed throughput once known; the browser's own benchmark until then."""
        return self.observed_gflops or self.gflops or 1.0

    def start_seconds(self) -> float:
        """How long after a work unit is sent this device is expected to start computing it."""
        return self.start_ms / 1000

    def forget(self, *, now: datetime) -> None:
        """Hidden and detached from its browser: a new id with a colon (browsers' ids have none, and such ids
        do not count against MAX_DEVICES_PER_VOLUNTEER), so that browser is a new device if it comes back.
        What identifies the machine goes; its credit and speed stay."""
        self.client_id = f"forgotten:{secrets.token_hex(8)}"
        self.name, self.user_agent = "", ""
        self.forgotten_at = self.forgotten_at or now

    def observe(self, *, flops: int, compute_ms: int, download_ms: int = 0) -> None:
        """One accepted result's server-side FLOPs over its compute time, and its time before computing.
        Callers bound the times by the time the work was out (lifecycle.result_receive); the bounds here
        keep a bad value finite and within the 64-bit column anyway."""
        if compute_ms <= 0 or flops <= 0:
            return
        # Averaged from 0: a device's first units are planned as long as they were before it was measured.
        self.start_ms = round(0.7 * self.start_ms + 0.3 * min(max(0, download_ms), MAX_OBSERVED_MS))
        compute_ms = min(compute_ms, MAX_OBSERVED_MS)
        measured = min(flops, MAX_BIGINT) / (compute_ms * 1e6)
        # An exponential average: recent work units count most, one odd sample does not swing sizing.
        self.observed_gflops = (
            measured if not self.observed_gflops else 0.7 * self.observed_gflops + 0.3 * measured
        )
        self.compute_ms = min(self.compute_ms + compute_ms, MAX_BIGINT)


# Bounds of the computing preferences (the form, the model's checks and the protocol's schema share them).
DUTY_CYCLE_MIN, DUTY_CYCLE_MAX = spec.PROTOCOL["preferences"]["duty_cycle_percent"]
MAX_PREFERENCE_MB = 1_000_000  # a terabyte: beyond any real work unit or daily allowance
# Blobs remembered per device and day as already sent (see DeviceDownload.blobs).
MAX_REMEMBERED_BLOBS = 128


class ComputingPreferences(models.Model):
    """BOINC's computing preferences: a volunteer's defaults (`device` null), or one device's override, a
    whole set that replaces the defaults on that device (as BOINC's venues do)."""

    class Projects(models.TextChoices):
        ANY = "any", _("Any project, new ones too")
        ONLY = "only", _("Only the projects ticked below")
        EXCEPT = "except", _("Any project except those ticked below")

    volunteer = models.ForeignKey(Volunteer, on_delete=models.CASCADE, related_name="computing_preferences")
    device = models.OneToOneField(
        Device, on_delete=models.CASCADE, null=True, blank=True, related_name="computing_preferences"
    )
    duty_cycle = models.PositiveSmallIntegerField(
        default=DUTY_CYCLE_MAX,
        validators=[MinValueValidator(DUTY_CYCLE_MIN), MaxValueValidator(DUTY_CYCLE_MAX)],
        help_text="Percent of the time spent computing (the rest between work units).",
    )
    pause_when_hidden = models.BooleanField(default=True)
    pause_on_battery = models.BooleanField(default=True, help_text="While the battery is discharging.")
    battery_min_percent = models.PositiveSmallIntegerField(
        default=0, validators=[MaxValueValidator(100)], help_text="Pause below this charge; 0: never."
    )
    pause_while_active = models.BooleanField(
        default=False, help_text="Pause for a few seconds after each key press or mouse move on the page."
    )
    projects = models.CharField(max_length=6, choices=Projects.choices, default=Projects.ANY)
    chosen_projects = models.ManyToManyField("projects.Project", blank=True, related_name="+")
    max_work_unit_mb = models.PositiveIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(1), MaxValueValidator(MAX_PREFERENCE_MB)],
        help_text="Largest download and memory of one work unit; empty: no limit.",
    )
    max_download_mb_per_day = models.PositiveIntegerField(
        null=True, blank=True, validators=[MinValueValidator(1), MaxValueValidator(MAX_PREFERENCE_MB)]
    )
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        verbose_name_plural = "computing preferences"
        constraints = [
            models.UniqueConstraint(
                fields=["volunteer"], condition=models.Q(device__isnull=True), name="one_default_preferences"
            ),
            models.CheckConstraint(
                condition=models.Q(duty_cycle__gte=DUTY_CYCLE_MIN, duty_cycle__lte=DUTY_CYCLE_MAX),
                name="preferences_duty_cycle_bounds",
            ),
            models.CheckConstraint(
                condition=models.Q(battery_min_percent__lte=100), name="preferences_battery_bounds"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.volunteer} ({self.device or 'defaults'})"


class DeviceDownload(models.Model):
    """What one device was sent to download on one (UTC) day: the daily download limit reads it. Counted
    when a work unit is assigned: its graph, weights and whole shards (browsers fetch shards whole), except
    blobs this device was already sent since it connected, which its browser has cached."""

    device = models.ForeignKey(Device, on_delete=models.CASCADE, related_name="downloads")
    day = models.DateField()
    bytes = models.PositiveBigIntegerField(default=0)
    work_units = models.PositiveIntegerField(default=0)
    # SHA-256s sent since the device's latest connection (most recent last, at most MAX_REMEMBERED_BLOBS).
    blobs = models.JSONField(default=list, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["device", "day"], name="one_download_row_per_device_day")
        ]

    def __str__(self) -> str:
        return f"{self.device_id} {self.day}: {self.bytes} B"

    def unsent(self, blobs: dict[str, int]) -> int:
        """Bytes of `blobs` ({sha256: size}) this device has not been sent since it connected."""
        return sum(size for sha, size in blobs.items() if sha not in self.blobs)

    def record(self, blobs: dict[str, int]) -> None:
        """One more work unit sent with `blobs`: count what is new, remember all of them."""
        self.bytes += self.unsent(blobs)
        self.work_units += 1
        kept = [sha for sha in self.blobs if sha not in blobs] + list(blobs)
        self.blobs = kept[-MAX_REMEMBERED_BLOBS:]


class CreditEntry(models.Model):
    """One line of the ledger: FLOPs granted for one accepted result, computed on the server."""

    volunteer = models.ForeignKey(Volunteer, on_delete=models.CASCADE, related_name="credit")
    project = models.ForeignKey("projects.Project", on_delete=models.CASCADE, related_name="credit")
    result = models.OneToOneField("projects.Result", on_delete=models.CASCADE, related_name="credit")
    # The volunteer's team when the credit was granted: a team's total is the sum of its lines.
    team = models.ForeignKey(Team, on_delete=models.SET_NULL, null=True, blank=True, related_name="credit")
    flops = models.BigIntegerField()
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)

    class Meta:
        verbose_name_plural = "credit entries"


class VolunteerProjectCredit(RecentCredit, models.Model):
    """A volunteer's credit in one project (BOINC's credit_user): the per-project leaderboards read it,
    updated with the ledger in workers.services.credit_grant."""

    volunteer = models.ForeignKey(Volunteer, on_delete=models.CASCADE, related_name="project_credit")
    project = models.ForeignKey("projects.Project", on_delete=models.CASCADE, related_name="volunteer_credit")
    total_flops = models.BigIntegerField(default=0)
    results = models.PositiveIntegerField(default=0)
    expavg_credit = models.FloatField(default=0.0)
    expavg_time = models.DateTimeField(null=True, blank=True)
    # The first credit in this project (the certificate's "since").
    since = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["project", "volunteer"], name="one_credit_row_per_volunteer_project"
            )
        ]


class TeamProjectCredit(RecentCredit, models.Model):
    """A team's credit in one project (BOINC's credit_team), earned by members while members."""

    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="project_credit")
    project = models.ForeignKey("projects.Project", on_delete=models.CASCADE, related_name="team_credit")
    total_flops = models.BigIntegerField(default=0)
    expavg_credit = models.FloatField(default=0.0)
    expavg_time = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["project", "team"], name="one_credit_row_per_team_project")
        ]
