"""The volunteer WebSocket protocol (docs/protocol.md): parsing client frames, building server frames.

Every client message is validated by a schema: strict types (no bools for numbers, no floats for integers,
no NaN or Infinity anywhere), bounds that fit the database columns, bounded strings without NUL characters;
unknown fields are ignored. Anything else is a ProtocolError, answered with an `error` message."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any, Literal, NoReturn

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from engine import spec
from engine.partition import Stage
from projects import ring, stages
from projects.blobs import shard_url, stage_blob_url
from projects.datasets import work_unit_slices
from projects.lifecycle import ResultOutcome
from projects.models import ModelVersion, Result, WorkUnit
from workers import preferences as computing

# Shared with the browsers (engine/spec.json): the version, bounds and close codes they must respect.
PROTOCOL_VERSION = spec.PROTOCOL_VERSION
MAX_TEXT_FRAME: int = spec.PROTOCOL["max_text_frame"]
CLOSE_UNAUTHENTICATED: int = spec.PROTOCOL["close_codes"]["unauthenticated"]
CLOSE_THROTTLED: int = spec.PROTOCOL["close_codes"]["throttled"]
CLOSE_RETRY_LATER: int = spec.PROTOCOL["close_codes"]["retry_later"]  # busy admitting others
MAX_COUNT = 2**31 - 1  # work unit ids, versions and samples fit PostgreSQL's integer columns
MAX_MILLIS = 7 * 24 * 3600 * 1000  # no work unit takes a week
MAX_GFLOPS = 1e9
MAX_ERRORS_SHOWN = 3
SIGNAL: dict[str, Any] = spec.PROTOCOL["signal"]  # WebRTC signalling for the peer ring (signalling.py)


class ProtocolError(ValueError):
    def __init__(self, code: str, message: str, *, work_unit: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.work_unit = work_unit


def _storable(text: str) -> str:
    # PostgreSQL refuses NUL characters and lone surrogates (from JSON "\ud800") cannot be encoded.
    if "\x00" in text:
        raise ValueError("NUL characters are not allowed")
    text.encode("utf-8")  # UnicodeEncodeError is a ValueError
    return text


Count = Annotated[int, Field(ge=0, le=MAX_COUNT)]
Millis = Annotated[int, Field(ge=0, le=MAX_MILLIS)]
Fraction = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]
Loss = Annotated[float, Field(allow_inf_nan=False)]
Backend = Annotated[str, Field(min_length=1, max_length=20), AfterValidator(_storable)]
UserAgent = Annotated[str, Field(max_length=1000), AfterValidator(_storable)]
DeviceId = Annotated[str, Field(pattern=spec.PROTOCOL["device_id_pattern"])]


class _Schema(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, frozen=True)


class DeviceInfo(_Schema):
    id: DeviceId | None = None  # random, kept by the browser: one Device row per browser
    backend: Backend = "unknown"
    # null: a browser's benchmark that came out non-finite (JSON.stringify(Infinity) is null).
    gflops: Annotated[float, Field(ge=0.0, le=MAX_GFLOPS, allow_inf_nan=False)] | None = None
    memory_mb: Annotated[float, Field(ge=0.0, le=MAX_COUNT, allow_inf_nan=False)] | None = None
    user_agent: UserAgent = ""


class Preferences(_Schema):
    max_work_units: Count | None = None


class Hello(_Schema):
    type: Literal["hello"]
    protocol: Count
    device: DeviceInfo = DeviceInfo()
    preferences: Preferences = Preferences()


class Ready(_Schema):
    type: Literal["ready"]


class Progress(_Schema):
    type: Literal["progress"]
    work_unit: Count
    fraction: Fraction = 0.0


class Timings(_Schema):
    download_ms: Millis = 0
    compute_ms: Millis = 0


Digest = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]  # SHA-256, lowercase hex


class Sent(_Schema):
    """A stage result's payload that went to the next volunteer by the peer ring (projects/ring.py)."""

    digest: Digest


class ResultMessage(_Schema):
    type: Literal["result"]
    work_unit: Count
    model_version: Count
    samples: Count
    # null: the unit computes no loss (a pipeline stage unit but the last stage's); a 0 would read as one.
    loss: Loss | None
    timings: Timings = Timings()
    sent: Sent | None = None


class Release(_Schema):
    """Work units the browser gives back unstarted (it paused): at most what a connection may hold."""

    type: Literal["release"]
    work_units: Annotated[list[Count], Field(min_length=1, max_length=spec.MAX_IN_FLIGHT)]


class Pause(_Schema):
    """The browser's pause began (it lasted long enough to give back unstarted work) or ended."""

    type: Literal["pause"]
    paused: bool


class Bye(_Schema):
    type: Literal["bye"]


class Signal(_Schema):
    """An SDP offer or answer, or one ICE candidate, for the connected device `to` (workers/signalling.py).
    `link` tells apart several links between the same two devices; `data` is opaque to the server."""

    type: Literal["signal"]
    to: Count
    kind: Literal["offer", "answer", "candidate"]
    data: Annotated[str, Field(max_length=SIGNAL["max_data"]), AfterValidator(_storable)]
    link: Annotated[str, Field(pattern=SIGNAL["link_pattern"])] = "0"


class Fetch(_Schema):
    """The peer ring: a payload the unit reads did not come from its peer; the server is to relay it."""

    type: Literal["fetch"]
    work_unit: Count
    what: Literal["input", "output_grad"]


class Relay(_Schema):
    """The peer ring: the payload `digest` the server asked for (`upload`), in the next binary frame; or
    `missing`: this browser no longer has it (no frame follows)."""

    type: Literal["relay"]
    digest: Digest
    missing: bool = False


ClientMessage = Hello | Ready | Progress | ResultMessage | Release | Pause | Bye | Signal | Fetch | Relay
SCHEMAS: dict[str, type[ClientMessage]] = {
    "hello": Hello,
    "ready": Ready,
    "progress": Progress,
    "result": ResultMessage,
    "release": Release,
    "pause": Pause,
    "bye": Bye,
    "signal": Signal,
    "fetch": Fetch,
    "relay": Relay,
}
CLIENT_TYPES = set(SCHEMAS)


@dataclass(frozen=True)
class ResultMeta:
    work_unit: int
    model_version: int
    samples: int
    loss: float | None
    compute_ms: int
    download_ms: int
    sent_digest: str = ""


def parse_message(text: str) -> ClientMessage:
    if len(text) > MAX_TEXT_FRAME:
        raise ProtocolError("too_large", f"Text frames are limited to {MAX_TEXT_FRAME // 1024} KiB.")
    raw = _load_json(text)
    kind = raw.get("type") if isinstance(raw, dict) else None
    schema = SCHEMAS.get(kind) if isinstance(kind, str) else None
    if schema is None:
        raise ProtocolError("bad_message", f"Expected an object with a type in {sorted(CLIENT_TYPES)}.")
    try:
        return schema.model_validate(raw)
    except ValidationError as exc:
        message = f"Malformed {kind}: {_describe(exc)}."
        raise ProtocolError("bad_message", message, work_unit=_named_work_unit(raw, kind)) from None


def _named_work_unit(raw: dict[str, Any], kind: object) -> int | None:
    """The work unit a malformed `result` answers, if it names one plainly: the server condemns that instance
    instead of leaving it held until its deadline."""
    work_unit = raw.get("work_unit")
    if kind != "result" or type(work_unit) is not int or not 0 <= work_unit <= MAX_COUNT:
        return None
    return work_unit


def _load_json(text: str) -> Any:
    try:
        return json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as exc:
        raise ProtocolError("bad_message", f"Not JSON: {exc.msg}.") from None
    except ValueError as exc:  # NaN / Infinity, or an integer of more than 4300 digits
        raise ProtocolError("bad_message", f"Not JSON: {exc}.") from None
    except RecursionError:
        raise ProtocolError("bad_message", "Not JSON: nested too deeply.") from None


def _no_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not a JSON number")


def _describe(exc: ValidationError) -> str:
    """Where and what, without echoing the input back."""
    errors = exc.errors(include_url=False, include_input=False)
    shown = [f"{'.'.join(str(part) for part in error['loc'])}: {error['msg']}" for error in errors]
    more = f" (and {len(shown) - MAX_ERRORS_SHOWN} more)" if len(shown) > MAX_ERRORS_SHOWN else ""
    return "; ".join(shown[:MAX_ERRORS_SHOWN])[:500] + more


def hello_device(message: Hello) -> DeviceInfo:
    if message.protocol != PROTOCOL_VERSION:
        raise ProtocolError("protocol", f"This server speaks protocol {PROTOCOL_VERSION}.")
    return message.device


def result_meta(message: ResultMessage) -> ResultMeta:
    return ResultMeta(
        work_unit=message.work_unit,
        model_version=message.model_version,
        samples=message.samples,
        loss=message.loss,
        compute_ms=message.timings.compute_ms,
        download_ms=message.timings.download_ms,
        sent_digest=message.sent.digest if message.sent else "",
    )


def welcome_message(
    *, username: str, credit_flops: int, recent_credit: float, preferences: computing.Preferences
) -> dict[str, Any]:
    """`recent_credit`: the recent average (credit per day) as of now, as the Contribute page shows it."""
    return {
        "type": "welcome",
        "protocol": PROTOCOL_VERSION,
        "volunteer": {"username": username, "credit_flops": credit_flops, "recent_credit": recent_credit},
        "preferences": preferences_payload(preferences),
    }


def preferences_message(preferences: computing.Preferences) -> dict[str, Any]:
    return {"type": "preferences", "preferences": preferences_payload(preferences)}


def preferences_payload(preferences: computing.Preferences) -> dict[str, Any]:
    """What the browser enforces itself (the server enforces the rest, and says what in `limits`)."""
    return {
        "duty_cycle": preferences.duty_cycle,
        "pause_when_hidden": preferences.pause_when_hidden,
        "pause_on_battery": preferences.pause_on_battery,
        "battery_min_percent": preferences.battery_min_percent,
        "pause_while_active": preferences.pause_while_active,
        "source": preferences.source,
        "limits": {
            "projects": preferences.projects,
            "max_work_unit_mb": preferences.max_work_unit_mb,
            "max_download_mb_per_day": preferences.max_download_mb_per_day,
        },
    }


def idle_message(reason: str) -> dict[str, Any]:
    return {"type": "idle", "reason": reason}


def _unit_header(work_unit: WorkUnit, *, why: str) -> dict[str, Any]:
    """What every assign names first, whatever the unit: the unit, its project and why, its model version."""
    project = work_unit.project
    return {
        "id": work_unit.pk,
        "project": {"id": project.pk, "name": project.name, "why": why},
        "model_version": work_unit.version.number,
    }


def assign_message(result: Result, *, why: str = "share") -> dict[str, Any]:
    """`why` the project was chosen: spec.json's assign_why."""
    work_unit = result.work_unit
    project = work_unit.project
    if work_unit.stage_kind:
        return stage_assign_message(result, why=why)
    return {
        "type": "assign",
        "work_unit": {
            **_unit_header(work_unit, why=why),
            "task": project.task,
            "graph_url": project.graph.url,
            "weights_url": work_unit.version.wire_blob.url,
            "shards": [
                {
                    # Signed for this volunteer and project, and expiring: shards are not public.
                    "url": shard_url(
                        sha256=part.shard.blob_id, user_id=result.volunteer_id, project_id=project.pk
                    ),
                    "offset": part.offset,
                    "count": part.count,
                }
                for part in work_unit_slices(work_unit=work_unit)
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
            **_weights_delta(work_unit.version),
        },
    }


def _weights_delta(version: ModelVersion) -> dict[str, Any]:
    """A browser holding the weights at `base_url` builds this version's from the delta at `url` (codecs.js
    applyDelta): exactly the weights at `weights_url`, for a fraction of the bytes."""
    if version.wire_delta is None:
        return {}
    return {"weights_delta": {"url": version.wire_delta.url, "base_url": f"/blobs/{version.wire_base}"}}


def ack_message(outcome: ResultOutcome) -> dict[str, Any]:
    return {
        "type": "ack",
        "work_unit": outcome.work_unit_id,
        "accepted": outcome.accepted,
        "status": outcome.status,
        "reason": outcome.reason,
        "credit_flops": outcome.credit_flops,
        "total_credit_flops": outcome.total_credit_flops,
        "recent_credit": outcome.recent_credit,
    }


def credit_message(event: dict[str, Any]) -> dict[str, Any]:
    keys = ("work_unit", "status", "reason", "credit_flops", "total_credit_flops", "recent_credit")
    return {"type": "credit", **{key: event[key] for key in keys}}


def signal_message(message: Signal, *, sender: int) -> dict[str, Any]:
    """What device `sender` said to this one: answer it with a `signal` whose `to` is `from`."""
    fields = {"link": message.link, "kind": message.kind, "data": message.data}
    return {"type": "signal", "from": sender, **fields}


def upload_message(digest: str) -> dict[str, Any]:
    """The peer ring: send the payload `digest` (one this browser sent by the ring) with a `relay`."""
    return {"type": "upload", "digest": digest}


def error_message(code: str, message: str, *, work_unit: int | None = None) -> dict[str, Any]:
    """`work_unit` names the result a refusal is about, so the client knows which one to send again."""
    extra = {} if work_unit is None else {"work_unit": work_unit}
    return {"type": "error", "code": code, "message": message, **extra}


def stage_assign_message(result: Result, *, why: str = "share") -> dict[str, Any]:
    """A pipeline stage unit (docs/protocol.md "Stage units"): the stage's graph and weights, its input
    activation (or, for stage 0, the shard), the gradient of its output (backward, not last), the seed and
    the codecs. The shard also gives the last stage its targets."""
    work_unit = result.work_unit
    project = work_unit.project
    stage = stages.unit_stage(work_unit=work_unit)
    return {
        "type": "assign",
        "work_unit": {
            **_unit_header(work_unit, why=why),
            "task": f"stage_{work_unit.stage_kind}",
            "stage": _stage_fields(work_unit=work_unit, stage=stage),
            "graph_url": _granted(result, work_unit.stage_graph_id),
            "weights_url": _granted(result, work_unit.stage_weights_id),
            "input_url": _granted(result, work_unit.input_blob_id or work_unit.input_digest or None),
            "output_grad_url": _granted(result, work_unit.grad_blob_id or work_unit.grad_digest or None),
            "shards": [_stage_shard(result)],
            "batch_size": work_unit.count,
            "deadline": result.deadline.isoformat(),
            "codec": "fp32",
            "activation_codec": project.activation_codec,
            "ring": _ring_fields(result) if ring.ring_on(work_unit=work_unit) else None,
        },
    }


def _ring_fields(result: Result) -> dict[str, Any]:
    """The peer ring (projects/ring.py): whether this unit may send its payload by the ring (then its result
    names only the digest), and, for each payload it reads that is not on the server, its digest and the
    device to get it from (null: nobody; ask the server with `fetch`)."""
    return {"send": ring.ring_send_allowed(result=result), **ring.ring_sources(work_unit=result.work_unit)}


def _stage_fields(*, work_unit: WorkUnit, stage: Stage) -> dict[str, Any]:
    return {
        "index": stage.index,
        "count": len(stages.project_partition(project=work_unit.project).stages),
        "kind": work_unit.stage_kind,
        "micro_batch": work_unit.micro_batch,
        "step": work_unit.version.number,
        "last": stage.last,
        "needs_input_grad": stage.needs_input_grad,
        "seed": stages.unit_seed(work_unit=work_unit),
        "loss_scale": work_unit.loss_scale,
        "input_shape": stages.input_shape(stage, work_unit.count) if stage.index else None,
        "output_shape": None if stage.last else stages.output_shape(work_unit=work_unit),
    }


def _granted(result: Result, sha256: str | None) -> str | None:
    if sha256 is None:
        return None
    return stage_blob_url(sha256=sha256, user_id=result.volunteer_id, work_unit_id=result.work_unit_id)


def _stage_shard(result: Result) -> dict[str, Any]:
    work_unit = result.work_unit
    url = shard_url(
        sha256=work_unit.shard.blob_id, user_id=result.volunteer_id, project_id=work_unit.project_id
    )
    return {"url": url, "offset": work_unit.offset, "count": work_unit.count}
