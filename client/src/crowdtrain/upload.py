"""Chunked, resumable uploads (POST/GET/PUT /api/uploads/): a large dataset survives a broken connection,
a server restart or Ctrl-C. The server's offset is the truth: after any failure the client asks for it and
goes on from there, and an interrupted `crowdtrain push` of the same file continues where it stopped.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from tqdm import tqdm

from .config import config_dir, read_private_json, write_private_json
from .errors import ApiError, CrowdtrainError, ServerUnreachable

CHUNK_BYTES = 4 * 2**20  # the contract allows 8 MiB a request; smaller chunks lose less to a broken link
RETRIES = 6  # consecutive failures of one chunk before giving up (the next run resumes)
BACKOFF = (1.0, 2.0, 4.0, 8.0, 15.0, 30.0)


class UploadApi(Protocol):
    """What an upload needs from the server (``Client`` has it)."""

    url: str

    def upload_create(self, *, filename: str, size: int) -> dict[str, Any]: ...

    def upload_status(self, upload: str) -> dict[str, Any]: ...

    def upload_put(self, upload: str, offset: int, chunk: bytes) -> dict[str, Any]: ...


@dataclass
class UploadState:
    """Uploads begun and not finished, by server and file, so that running the same command resumes them."""

    path: Path

    @classmethod
    def default(cls) -> UploadState:
        return cls(config_dir() / "uploads.json")

    @staticmethod
    def key(server: str, file: Path) -> str:
        stat = file.stat()  # a file changed since (size or mtime) starts a new upload
        return f"{server}|{file.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"

    def get(self, key: str) -> str | None:
        value = read_private_json(self.path).get(key)
        return value if isinstance(value, str) else None

    def put(self, key: str, upload: str | None) -> None:
        data = read_private_json(self.path)
        if upload is None:
            data.pop(key, None)
        else:
            data[key] = upload
        write_private_json(self.path, data)


@dataclass
class Uploader:
    api: UploadApi
    state: UploadState | None = None
    chunk_bytes: int = CHUNK_BYTES
    retries: int = RETRIES
    sleep: Callable[[float], None] = time.sleep
    progress: bool = True

    def upload(self, file: Path) -> str:
        """Send ``file`` whole; returns the completed upload's id."""
        size = file_size(file)
        key = UploadState.key(self.api.url, file) if self.state else ""
        upload, offset = self._begin(file, size, key)
        with file.open("rb") as handle, self._bar(file, size, offset) as bar:
            while offset < size:
                new_offset = self._send(handle, upload, offset, size)
                bar.update(new_offset - offset)
                offset = new_offset
        if self.state:
            self.state.put(key, None)
        return upload

    def _begin(self, file: Path, size: int, key: str) -> tuple[str, int]:
        """(upload id, offset): the unfinished upload of this very file if the server still has it."""
        previous = self.state.get(key) if self.state else None
        if previous is not None:
            try:
                status = self.api.upload_status(previous)
                if int(status.get("size", -1)) == size:
                    return previous, checked_offset(status, size)
            except ApiError as exc:
                if exc.status != 404:  # 404: expired or consumed on the server; start again
                    raise
        created = self.api.upload_create(filename=file.name, size=size)
        upload = str(created["id"])
        if self.state:
            self.state.put(key, upload)
        return upload, checked_offset(created, size)

    def _send(self, handle: BinaryIO, upload: str, offset: int, size: int) -> int:
        """Send the chunk at ``offset``; the server's new offset (which may differ after a conflict)."""
        problem = ""
        for attempt in range(1, self.retries + 2):
            handle.seek(offset)
            chunk = handle.read(min(self.chunk_bytes, size - offset))
            try:
                return checked_offset(self.api.upload_put(upload, offset, chunk), size)
            except ApiError as exc:
                if exc.status != 409:  # 409: the server holds another offset; go on from its own
                    raise
                problem = str(exc)
            except ServerUnreachable as exc:
                problem = str(exc)
                self.sleep(BACKOFF[min(attempt, len(BACKOFF)) - 1])
            offset = self._server_offset(upload, size, offset)
        raise CrowdtrainError(
            f"{problem}; the upload stopped at byte {offset} of {size}: run the same command again to resume"
        )

    def _server_offset(self, upload: str, size: int, fallback: int) -> int:
        try:
            return checked_offset(self.api.upload_status(upload), size)
        except ServerUnreachable:
            return fallback  # still down: retry the same chunk, counted as one more failure

    def _bar(self, file: Path, size: int, offset: int) -> tqdm[Any]:
        return tqdm(
            total=size,
            initial=offset,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            desc=f"uploading {file.name}",
            file=sys.stderr,
            disable=not self.progress,
        )


def checked_offset(status: dict[str, Any], size: int) -> int:
    """The server's offset, which must lie within the file: anything else is a server we cannot trust."""
    offset = status.get("offset")
    if not isinstance(offset, int) or isinstance(offset, bool) or not 0 <= offset <= size:
        raise CrowdtrainError(f"the server reported upload offset {offset!r} for a file of {size} bytes")
    return offset


def file_size(path: Path) -> int:
    try:
        return os.stat(path).st_size
    except OSError as exc:
        raise CrowdtrainError(f"cannot read {path}: {exc.strerror}") from None
