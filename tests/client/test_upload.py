"""crowdtrain.upload's resume logic against a stand-in server that keeps only an offset (pure logic; the
real resumable upload is exercised against the real API in test_api.py and the end-to-end test)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from crowdtrain.errors import ApiError, CrowdtrainError, ServerUnreachable
from crowdtrain.upload import Uploader, UploadState


@dataclass
class OffsetServer:
    """Appends chunks at the right offset, answers 409 with its own offset otherwise; ``faults`` lists what
    goes wrong on the next calls to upload_put ("down": no answer; "lost": stored but the answer was lost)."""

    url: str = "http://server.test"
    data: dict[str, bytearray] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)
    faults: list[str] = field(default_factory=list)
    puts: list[tuple[str, int, int]] = field(default_factory=list)
    down: bool = False

    def upload_create(self, *, filename: str, size: int) -> dict[str, Any]:
        upload = f"u{len(self.data)}"
        self.data[upload], self.sizes[upload] = bytearray(), size
        return self.upload_status(upload)

    def upload_status(self, upload: str) -> dict[str, Any]:
        if self.down:
            raise ServerUnreachable("down")
        if upload not in self.data:
            raise ApiError(404, "No upload of yours has this id.")
        return {"id": upload, "offset": len(self.data[upload]), "size": self.sizes[upload]}

    def upload_put(self, upload: str, offset: int, chunk: bytes) -> dict[str, Any]:
        self.puts.append((upload, offset, len(chunk)))
        fault = self.faults.pop(0) if self.faults else ""
        if fault == "down":
            raise ServerUnreachable("connection reset")
        if offset != len(self.data[upload]):
            raise ApiError(409, "Upload-Offset does not match.")
        self.data[upload] += chunk
        if fault == "lost":
            raise ServerUnreachable("connection reset after the server stored the chunk")
        return self.upload_status(upload)


def sample_file(tmp_path: Path, size: int = 10_000) -> Path:
    path = tmp_path / "data.npz"
    path.write_bytes(bytes(i % 251 for i in range(size)))
    return path


def uploader(server: OffsetServer, state: UploadState | None = None, **kwargs: Any) -> Uploader:
    sleeps: list[float] = []
    return Uploader(server, state, chunk_bytes=3000, sleep=sleeps.append, progress=False, **kwargs)


def test_a_file_goes_up_in_chunks(tmp_path: Path) -> None:
    server, file = OffsetServer(), sample_file(tmp_path)
    upload = uploader(server).upload(file)
    assert bytes(server.data[upload]) == file.read_bytes()
    assert [offset for _, offset, _ in server.puts] == [0, 3000, 6000, 9000]


def test_a_broken_connection_resumes_from_the_servers_offset(tmp_path: Path) -> None:
    server, file = OffsetServer(faults=["", "lost", "down"]), sample_file(tmp_path)
    upload = uploader(server).upload(file)
    assert bytes(server.data[upload]) == file.read_bytes()  # the lost answer's chunk is not sent twice
    assert [offset for _, offset, _ in server.puts] == [0, 3000, 6000, 6000, 9000]


def test_a_conflict_goes_on_from_the_servers_offset(tmp_path: Path) -> None:
    server, file = OffsetServer(), sample_file(tmp_path)
    upload = server.upload_create(filename="x", size=10_000)["id"]
    server.data[upload] += file.read_bytes()[:4500]  # another client (or an earlier run) got this far
    state = UploadState(tmp_path / "uploads.json")
    state.put(UploadState.key(server.url, file), upload)
    assert uploader(server, state).upload(file) == upload
    assert bytes(server.data[upload]) == file.read_bytes()
    assert server.puts[0][1] == 4500  # the first PUT already resumed from the server's offset


def test_an_interrupted_run_is_resumed_by_the_next_one(tmp_path: Path) -> None:
    server, file = OffsetServer(faults=["", "down", "down", "down"]), sample_file(tmp_path)
    state = UploadState(tmp_path / "uploads.json")
    with pytest.raises(CrowdtrainError, match="stopped at byte 3000 of 10000: run the same command"):
        uploader(server, state, retries=2).upload(file)
    upload = uploader(server, state).upload(file)
    assert bytes(server.data[upload]) == file.read_bytes()
    assert len(server.data) == 1  # the same upload, continued
    assert state.get(UploadState.key(server.url, file)) is None  # finished: forgotten


def test_an_upload_the_server_forgot_starts_again(tmp_path: Path) -> None:
    server, file = OffsetServer(), sample_file(tmp_path)
    state = UploadState(tmp_path / "uploads.json")
    state.put(UploadState.key(server.url, file), "expired-upload")
    upload = uploader(server, state).upload(file)
    assert upload != "expired-upload" and bytes(server.data[upload]) == file.read_bytes()


def test_a_changed_file_is_a_new_upload(tmp_path: Path) -> None:
    server, file = OffsetServer(), sample_file(tmp_path)
    key = UploadState.key(server.url, file)
    file.write_bytes(b"x" * 12_000)
    assert UploadState.key(server.url, file) != key


def test_an_offset_outside_the_file_is_refused(tmp_path: Path) -> None:
    class Liar(OffsetServer):
        def upload_put(self, upload: str, offset: int, chunk: bytes) -> dict[str, Any]:
            return {"id": upload, "offset": 10**9, "size": 10_000}

    with pytest.raises(CrowdtrainError, match="offset 1000000000 for a file of 10000 bytes"):
        uploader(Liar()).upload(sample_file(tmp_path))


def test_other_http_errors_are_not_retried(tmp_path: Path) -> None:
    class Refusing(OffsetServer):
        def upload_put(self, upload: str, offset: int, chunk: bytes) -> dict[str, Any]:
            self.puts.append((upload, offset, len(chunk)))
            raise ApiError(400, "The upload is complete.")

    server = Refusing()
    with pytest.raises(ApiError, match="The upload is complete"):
        uploader(server).upload(sample_file(tmp_path))
    assert len(server.puts) == 1


def test_a_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(CrowdtrainError, match="cannot read"):
        uploader(OffsetServer()).upload(tmp_path / "missing.npz")
