"""Researcher requests: a logged-in user asks for a researcher account, staff approve or reject it."""

from __future__ import annotations

from django.conf import settings
from django.db import models

MAX_PURPOSE_CHARS = 2000


class ResearcherRequest(models.Model):
    class Status(models.TextChoices):
        PENDING = "pending"
        APPROVED = "approved"
        REJECTED = "rejected"

    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="researcher_requests"
    )
    affiliation = models.CharField(max_length=200, help_text="University, lab or company.")
    purpose = models.TextField(max_length=MAX_PURPOSE_CHARS, help_text="What you want to train, and on what.")
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.PENDING, db_index=True)
    created_at = models.DateTimeField(auto_now_add=True)
    decided_at = models.DateTimeField(null=True, blank=True)
    decided_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["user"], condition=models.Q(status="pending"), name="one_pending_request_per_user"
            )
        ]
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.user} ({self.affiliation}, {self.status})"
