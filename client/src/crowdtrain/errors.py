"""The client's errors: each carries a sentence meant for the researcher, printed as is by the CLI."""

from __future__ import annotations

from typing import Any


class CrowdtrainError(Exception):
    """Anything the client cannot do; str(error) says what and, where it can, what to do about it."""


class ApiError(CrowdtrainError):
    """The server answered with an HTTP error; ``detail`` is its explanation (DRF's shapes flattened)."""

    def __init__(self, status: int, detail: str, method: str = "", path: str = "") -> None:
        self.status, self.detail, self.method, self.path = status, detail, method, path
        where = f" ({method} {path})" if method else ""
        super().__init__(f"HTTP {status}{where}: {detail}")


class ServerUnreachable(CrowdtrainError):
    """No answer at all: the connection was refused, timed out or broke."""


class NotLoggedIn(CrowdtrainError):
    """No server URL or token: neither in the environment nor in the config file."""


class CheckpointMismatch(CrowdtrainError):
    """A checkpoint's tensors do not fit the module they are loaded into (names or shapes)."""


def error_detail(body: Any) -> str:
    """DRF's error bodies as one sentence: {"detail": s}, {"field": [msgs]}, [msgs] or anything else."""
    if isinstance(body, dict):
        if isinstance(body.get("detail"), str):
            return str(body["detail"])
        return "; ".join(f"{key}: {_messages(value)}" for key, value in body.items()) or "no detail"
    if isinstance(body, list):
        return _messages(body)
    return str(body)[:500] or "no detail"


def _messages(value: Any) -> str:
    if isinstance(value, list):
        return " ".join(_messages(item) for item in value)
    if isinstance(value, dict):
        return error_detail(value)
    return str(value)
