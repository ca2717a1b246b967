"""`manage.py blob_bucket`: create the blobs' bucket (CROWDTRAIN_BLOB_BUCKET) unless it exists. The
container's release step runs it before any process starts, so that a new SeaweedFS or MinIO
(docker-compose.yml's `s3` profile) needs no step by hand.
Nothing to do when blobs are files under BLOB_ROOT."""

from __future__ import annotations

from typing import Any

from botocore.exceptions import BotoCoreError, ClientError
from django.core.management.base import BaseCommand, CommandError

from projects import blob_store


class Command(BaseCommand):
    help = "Create the blobs' bucket (CROWDTRAIN_BLOB_BUCKET) unless it exists."

    def handle(self, *args: Any, **options: Any) -> None:
        if not blob_store.remote():
            self.stdout.write("Blobs are files under BLOB_ROOT: no bucket to create.")
            return
        bucket = blob_store.bucket_name()
        try:
            created = blob_store.bucket_ensure()
        except (BotoCoreError, ClientError) as exc:  # a wrong name, key or endpoint: one line, no traceback
            raise CommandError(f"The bucket {bucket} cannot be checked or created: {exc}") from exc
        self.stdout.write(f"Created the bucket {bucket}." if created else f"The bucket {bucket} exists.")
