"""Content-addressed blob storage on the local filesystem (MEDIA_ROOT/blobs/ab/abcdef...)."""

from __future__ import annotations

import hashlib
import os
import tempfile

from django.conf import settings

from projects.models import Blob


def blob_put(*, data: bytes, content_type: str = "application/octet-stream") -> Blob:
    """Store bytes once; storing the same bytes again returns the existing blob."""
    sha = hashlib.sha256(data).hexdigest()
    path = settings.BLOB_ROOT / sha[:2] / sha
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        # Write then rename, so a reader never sees a half-written blob.
        fd, tmp = tempfile.mkstemp(dir=path.parent)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.replace(tmp, path)
    blob, _ = Blob.objects.get_or_create(
        sha256=sha, defaults={"size": len(data), "content_type": content_type}
    )
    return blob
