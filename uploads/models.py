"""Resumable uploads (the REST API's datasets): bytes arrive in chunks, at the offset the server holds, into a
file under UPLOAD_ROOT; the whole file is never in memory."""

from __future__ import annotations

import uuid
from pathlib import Path

from django.conf import settings
from django.db import models


class Upload(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="uploads")
    filename = models.CharField(max_length=255)
    size = models.BigIntegerField(help_text="Bytes the upload will hold once complete (declared up front).")
    offset = models.BigIntegerField(default=0, help_text="Bytes received so far, in order.")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return f"{self.filename} ({self.offset}/{self.size} B)"

    @property
    def path(self) -> Path:
        return Path(settings.UPLOAD_ROOT) / f"{self.pk}.part"

    @property
    def complete(self) -> bool:
        return self.offset == self.size
