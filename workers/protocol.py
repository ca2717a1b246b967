"""The volunteer WebSocket protocol (docs/protocol.md): parsing client frames, building server frames."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from projects.lifecycle import ResultOutcome
from projects.models import Result

PROTOCOL_VERSION = 1
MAX_TEXT_FRAME = 64 * 1024
CLIENT_TYPES = {"hello", "ready", "progress", "result", "bye"}


class ProtocolError(ValueError):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class ResultMeta:
    work_unit: int
    model_version: int
    samples: int
    loss: float
    compute_ms: int
    download_ms: int


def parse_message(text: str) -> dict[str, Any]:
    if len(text) > MAX_TEXT_FRAME:
        raise ProtocolError("too_large", "Text frames are limited to 64 KiB.")
    try:
        message = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ProtocolError("bad_message", f"Not JSON: {exc.msg}.") from exc
    if not isinstance(message, dict) or message.get("type") not in CLIENT_TYPES:
        raise ProtocolError("bad_message", f"Expected an object with a type in {sorted(CLIENT_TYPES)}.")
    return message


def parse_hello(message: dict[str, Any]) -> dict[str, Any]:
    if message.get("protocol") != PROTOCOL_VERSION:
        raise ProtocolError("protocol", f"This server speaks protocol {PROTOCOL_VERSION}.")
    device = message.get("device")
    return device if isinstance(device, dict) else {}


def parse_result(message: dict[str, Any]) -> ResultMeta:
    timings = message.get("timings") if isinstance(message.get("timings"), dict) else {}
    try:
        meta = ResultMeta(
            work_unit=_int(message["work_unit"]),
            model_version=_int(message["model_version"]),
            samples=_int(message["samples"]),
            loss=float(message["loss"]),
            compute_ms=_int(timings.get("compute_ms", 0)),  # type: ignore[union-attr]
            download_ms=_int(timings.get("download_ms", 0)),  # type: ignore[union-attr]
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ProtocolError("bad_message", f"Malformed result: {exc}.") from exc
    if not math.isfinite(meta.loss):
        raise ProtocolError("bad_message", "The loss must be a finite number.")
    return meta


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value or value < 0:
        raise ValueError(f"{value!r} is not a non-negative integer")
    return int(value)


def assign_message(result: Result) -> dict[str, Any]:
    work_unit = result.work_unit
    project = work_unit.project
    return {
        "type": "assign",
        "work_unit": {
            "id": work_unit.pk,
            "project": {"id": project.pk, "name": project.name},
            "model_version": work_unit.version.number,
            "task": project.task,
            "graph_url": project.graph.url,
            "weights_url": work_unit.version.download.url,
            "shards": [
                {"url": work_unit.shard.blob.url, "offset": work_unit.offset, "count": work_unit.count}
            ],
            "batch_size": project.batch_size,
            "local": {
                "optimizer": "sgd",
                "lr": project.local_learning_rate,
                "momentum": project.local_momentum,
                "batch_size": project.local_batch_size,
            },
            "deadline": result.deadline.isoformat(),
            "codec": project.codec,
        },
    }


def ack_message(outcome: ResultOutcome) -> dict[str, Any]:
    return {
        "type": "ack",
        "work_unit": outcome.work_unit_id,
        "accepted": outcome.accepted,
        "status": outcome.status,
        "reason": outcome.reason,
        "credit_flops": outcome.credit_flops,
        "total_credit_flops": outcome.total_credit_flops,
    }


def credit_message(event: dict[str, Any]) -> dict[str, Any]:
    keys = ("work_unit", "status", "reason", "credit_flops", "total_credit_flops")
    return {"type": "credit", **{key: event[key] for key in keys}}


def error_message(code: str, message: str) -> dict[str, Any]:
    return {"type": "error", "code": code, "message": message}
