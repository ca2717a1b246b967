"""A simulated volunteer: a Python client of docs/protocol.md that computes real updates with engine/.

It is an outside client, exactly like a browser: it signs up / logs in over HTTP, opens the volunteer
WebSocket with the session cookie, and downloads graphs, weights and shards from the blob URLs. It never
imports Django models nor touches the database, so it can load-test any running server.

Each assigned work unit is computed as its `task` says (a gradient, or local SGD steps whose result is the
weight delta), encoded with the assigned `codec` (int8 with an error-feedback residual per project, like
the browser). `ack` only means "received"; the verdict and the credit arrive later in a `credit` message,
so verdicts are collected per work unit whenever they come, also across reconnects.

Emulated hardware: results are not sent sooner than samples * FLOPs / speed, and transfers take no less
than size * 8 / bandwidth + latency. Byzantine behaviours tamper with the update before it is sent.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import http.client
import http.cookiejar
import json
import logging
import math
import random
import re
import secrets
import struct
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from safetensors.numpy import load as load_shard
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake
from websockets.typing import Origin

from engine import activations, codecs, spec
from engine.flops import train_flops_per_sample
from engine.graph import Graph, load_graph
from engine.partition import Stage, StageMemory
from engine.pipeline import stage_backward, stage_forward
from engine.runtime import compute_gradients, local_steps

logger = logging.getLogger(__name__)

PROTOCOL_VERSION = spec.PROTOCOL_VERSION
BYZANTINE = ("none", "scaled", "sign_flip", "random", "nan", "stale_replay", "poison")
# "poison" sends these in turn for its own work units (issue 9): a result must never stall validation.
POISONS = ("deep_header", "nan", "wrong_shape", "version_lie", "huge_compute_ms")
VERDICTS = ("valid", "invalid", "late")  # final statuses; "pending" in an ack means a `credit` follows
CSRF_RE = re.compile(r'name="csrfmiddlewaretoken" value="([^"]+)"')
Tensors = dict[str, torch.Tensor]


THROTTLED_WAIT_S = 20.0  # after a connect refused with 4429 (the server counts connects per minute)
MAX_RETRIES = 8  # consecutive reconnects without a single ack before the volunteer gives up
# After a close 4503 (the server is busy admitting others, config/admission.py): as backoff.js's
# RETRY_LATER_MS, plus jitter. Not a failure, as for the browser, which keeps coming back.
RETRY_LATER_S = 5.0
RETRY_LATER_CODE: int = spec.PROTOCOL["close_codes"]["retry_later"]


class SimulatorError(RuntimeError):
    """The simulated volunteer cannot go on (login refused, server gone, protocol violated)."""


def _told_to_retry_later(exc: BaseException) -> bool:
    """Whether the server closed the socket with 4503 (retry later)."""
    closed = exc.rcvd if isinstance(exc, ConnectionClosed) else None
    return closed is not None and closed.code == RETRY_LATER_CODE


class _ServerClosed(Exception):
    """The server ended the connection; like the browser client, reconnect after a backoff."""


@dataclass
class SimulatorConfig:
    url: str = "http://127.0.0.1:8000"
    username: str = "sim-0001"
    password: str = "simulated-volunteer-pass"
    signup: bool = False  # create the account first (falls back to logging in if it exists)
    gflops: float = 20.0  # emulated device speed; 0 = as fast as this machine computes
    bandwidth_mbit: float = 0.0  # 0 = unlimited
    latency_ms: float = 0.0
    failure_probability: float = 0.0  # per work unit: drop the connection instead of sending a result
    max_work_units: int | None = None  # stop after this many (results sent + dropped)
    duration_s: float | None = None  # stop asking for work after this long
    byzantine: str = "none"  # one of BYZANTINE
    prefetch: bool = False  # ask for the next work unit while computing (two in flight)
    verdict_timeout_s: float = 30.0  # when done, how long to wait for the verdicts still outstanding
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.byzantine not in BYZANTINE:
            raise ValueError(f"byzantine must be one of {BYZANTINE}, not {self.byzantine!r}")


@dataclass(frozen=True)
class Verdict:
    """How the server judged one result (from a final `ack` or the later `credit` message)."""

    status: str  # one of VERDICTS
    reason: str
    credit_flops: int


@dataclass
class SimulatorStats:
    username: str
    work_units: int = 0  # results sent
    dropped: int = 0  # connections dropped on purpose (failure_probability)
    cancelled: int = 0
    reconnects: int = 0  # connections the server closed and the simulator reopened
    errors: int = 0  # `error` frames from the server
    unanswered: int = 0  # results sent whose verdict never came (set when the run ends)
    credit_flops: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    weights_by_delta: int = 0  # versions built from the previous one and a delta, not downloaded whole
    compute_seconds: float = 0.0
    wall_seconds: float = 0.0
    verdicts: dict[int, Verdict] = field(default_factory=dict)  # work unit id -> verdict

    def count(self, status: str) -> int:
        return sum(1 for v in self.verdicts.values() if v.status == status)

    @property
    def valid(self) -> int:
        return self.count("valid")

    @property
    def invalid(self) -> int:
        return self.count("invalid")

    @property
    def late(self) -> int:
        return self.count("late")

    @property
    def reasons(self) -> list[str]:
        """Why results earned nothing, as "status: reason"."""
        return [f"{v.status}: {v.reason}" for v in self.verdicts.values() if v.status != "valid"]

    @property
    def compute_share(self) -> float:
        """Share of wall time spent computing (low: the volunteer mostly waits on the server)."""
        return self.compute_seconds / self.wall_seconds if self.wall_seconds > 0 else 0.0


@dataclass(frozen=True)
class Unit:
    """One `assign`ed work unit (the fields the simulator uses)."""

    id: int
    project_id: int
    model_version: int
    task: str  # "gradient" | "local_steps"
    graph_url: str
    weights_url: str
    shards: list[dict[str, Any]]
    batch_size: int
    lr: float
    momentum: float
    codec: str
    # Pipeline stage units (docs/protocol.md "Stage units"); None for data-parallel units.
    stage: dict[str, Any] | None = None
    input_url: str | None = None
    output_grad_url: str | None = None
    activation_codec: str = "fp16"
    # The peer ring (projects/ring.py): payloads not on the server yet. The simulator has no WebRTC: it
    # always asks the server to relay them (`fetch`), and uploads its own payloads whole.
    ring: dict[str, Any] | None = None
    weights_delta: dict[str, str] | None = None  # {url, base_url}: docs/protocol.md, assign

    @classmethod
    def parse(cls, raw: dict[str, Any]) -> Unit:
        local = raw.get("local") or {}
        return cls(
            id=int(raw["id"]),
            project_id=int(raw["project"]["id"]),
            model_version=int(raw["model_version"]),
            task=str(raw.get("task", "gradient")),
            graph_url=raw["graph_url"],
            weights_url=raw["weights_url"],
            shards=list(raw["shards"]),
            batch_size=int(local.get("batch_size", raw["batch_size"])),
            lr=float(local.get("lr", 0.0)),
            momentum=float(local.get("momentum", 0.0)),
            codec=str(raw.get("codec", "int8")),
            stage=raw.get("stage"),
            input_url=raw.get("input_url"),
            output_grad_url=raw.get("output_grad_url"),
            activation_codec=str(raw.get("activation_codec", "fp16")),
            ring=raw.get("ring"),
            weights_delta=raw.get("weights_delta"),
        )

    @property
    def samples(self) -> int:
        return sum(int(s["count"]) for s in self.shards)


# Called with each work unit, its real compute seconds and its emulated device seconds (a benchmark's
# account of whether this machine kept up with the speed it emulates).
ComputeHook = Callable[[Unit, float, float], None]
Computed = TypeVar("Computed")


# --- emulated network and HTTP -----------------------------------------------------------------------


class Link:
    """Emulated bandwidth and latency: a transfer takes no less than size * 8 / bandwidth + latency."""

    def __init__(self, bandwidth_mbit: float, latency_ms: float) -> None:
        self.bandwidth_mbit, self.latency_s = bandwidth_mbit, latency_ms / 1000

    def minimum_seconds(self, size: int) -> float:
        wire = size * 8 / (self.bandwidth_mbit * 1e6) if self.bandwidth_mbit > 0 else 0.0
        return wire + self.latency_s

    async def pace(self, size: int, started: float) -> None:
        """Sleep until a transfer of `size` bytes begun at `started` took its emulated time."""
        remaining = self.minimum_seconds(size) - (time.monotonic() - started)
        if remaining > 0:
            await asyncio.sleep(remaining)


# The threads transfers run in: their own, not the event loop's default executor, which a load test may give
# the volunteers' computing at the lowest CPU priority (benchmarks/scaling emulation.device_pool). There, a
# volunteer's download could wait for a thread behind other volunteers' training; a browser's download does
# not wait for another device's computing.
_TRANSFERS = concurrent.futures.ThreadPoolExecutor(max_workers=32, thread_name_prefix="simulator-http")


class Http:
    """Blocking urllib with a cookie jar, run in threads (_TRANSFERS) so the event loop never waits on it."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url.rstrip("/")
        self.cookies = http.cookiejar.CookieJar()
        self.opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(self.cookies))

    async def request(self, path: str, form: dict[str, str] | None = None) -> bytes:
        return await asyncio.get_running_loop().run_in_executor(_TRANSFERS, self._request, path, form)

    def _request(self, path: str, form: dict[str, str] | None) -> bytes:
        url = path if path.startswith("http") else self.base_url + path
        data = urllib.parse.urlencode(form).encode() if form is not None else None
        # Django's CSRF check wants a same-origin Referer on POSTs (strictly only over HTTPS).
        request = urllib.request.Request(url, data=data, headers={"Referer": url})
        try:
            with self.opener.open(request, timeout=60) as response:
                return bytes(response.read())
        except http.client.HTTPException as exc:
            # A body cut off by a restarting server (IncompleteRead) is a dropped connection, as a browser's
            # failed fetch is: the session reconnects and asks again instead of the volunteer giving up.
            raise ConnectionResetError(f"{url}: {exc!r}") from exc

    def cookie(self, name: str) -> str | None:
        return next((c.value for c in self.cookies if c.name == name), None)

    def cookie_header(self) -> str:
        return "; ".join(f"{c.name}={c.value}" for c in self.cookies)


class BlobCache:
    """Immutable blobs by URL path, least recently used evicted first (weights change every version). The
    path names the content; a shard's query is a grant signed afresh for every work unit."""

    def __init__(self, max_entries: int = 64) -> None:
        self.max_entries = max_entries
        self.entries: OrderedDict[str, bytes] = OrderedDict()

    def get(self, url: str) -> bytes | None:
        key = urllib.parse.urlsplit(url).path
        if key in self.entries:
            self.entries.move_to_end(key)
        return self.entries.get(key)

    def put(self, url: str, data: bytes) -> None:
        self.entries[urllib.parse.urlsplit(url).path] = data
        while len(self.entries) > self.max_entries:
            self.entries.popitem(last=False)


# --- Byzantine behaviours -----------------------------------------------------------------------------


def _global_norm(tensors: Tensors) -> float:
    return sum(float((t.double() ** 2).sum()) for t in tensors.values()) ** 0.5


def _random_like(grads: Tensors, generator: torch.Generator) -> Tensors:
    """Gaussian noise with the same global L2 norm as `grads`: plausible size, no information."""
    noise = {n: torch.randn(g.shape, generator=generator) for n, g in grads.items()}
    noise_norm = _global_norm(noise)
    factor = _global_norm(grads) / noise_norm if noise_norm > 0 else 0.0
    return {n: t * factor for n, t in noise.items()}


def tamper(grads: Tensors, behaviour: str, generator: torch.Generator) -> Tensors:
    """The gradient a Byzantine volunteer sends instead of the honest one (stale_replay is elsewhere)."""
    if behaviour == "scaled":
        return {n: g * 100 for n, g in grads.items()}
    if behaviour == "sign_flip":
        return {n: -g for n, g in grads.items()}
    if behaviour == "random":
        return _random_like(grads, generator)
    if behaviour == "nan":
        return {n: torch.full_like(g, float("nan")) for n, g in grads.items()}
    return grads


def poison(update: Tensors, kind: str, codec: str) -> bytes:
    """The tensors of a poisoned result; version_lie and huge_compute_ms lie in the message instead."""
    if kind == "deep_header":  # a safetensors header nested 100,000 deep (RecursionError in a parser)
        return struct.pack("<Q", 200_000) + b"[" * 100_000 + b"]" * 100_000
    if kind == "nan":  # fp32 whatever the codec: int8 cannot carry NaN
        return codecs.encode({n: torch.full_like(g, float("nan")) for n, g in update.items()}, "fp32")
    if kind == "wrong_shape":
        return codecs.encode({n: torch.zeros(*g.shape, 2) for n, g in update.items()}, codec)
    return codecs.encode(update, codec)


def poison_claims(kind: str, unit_version: int) -> dict[str, Any]:
    """What a poisoned result message claims instead of the truth."""
    if kind == "version_lie":
        return {"model_version": unit_version + 999}
    if kind == "huge_compute_ms":
        return {"timings": {"download_ms": 0, "compute_ms": 2**63 - 1}}
    return {}


def honest_update(
    graph: Graph, weights: Tensors, x: torch.Tensor, y: torch.Tensor, unit: Unit
) -> tuple[Tensors, float]:
    """What an honest browser computes for `unit` (docs/protocol.md "Tasks"): the update and its loss."""
    inputs, targets = {graph.inputs[0].name: x}, {graph.targets[0].name: y}
    if unit.task == "local_steps":
        local = local_steps(
            graph, weights, inputs, targets, batch_size=unit.batch_size, lr=unit.lr, momentum=unit.momentum
        )
        return local.delta, local.loss
    if unit.task != "gradient":
        raise SimulatorError(f"unknown task {unit.task!r}")
    result = compute_gradients(graph, weights, inputs, targets)
    return result.grads, result.loss


# --- pipeline stage units -----------------------------------------------------------------------------

RELAY_WAIT_S = 120.0  # a ring payload's producer has this long to upload it on the server's request
STAGE_LENGTH = struct.Struct("<Q")  # a backward payload's framing, as projects/stages.py reads it


def unit_stage(graph: Graph, fields: dict[str, Any]) -> Stage:
    """The engine's Stage for an assigned stage graph (what engine/pipeline.py needs of it)."""
    memory = StageMemory(0, 0, 0, 0)
    return Stage(
        index=int(fields["index"]),
        graph=graph,
        nodes=range(0),
        forward_flops=0,
        backward_flops=0,
        needs_input_grad=bool(fields["needs_input_grad"]),
        last=bool(fields["last"]),
        memory=memory,
    )


@dataclass(frozen=True)
class StageInputs:
    """What a stage unit reads: the samples of its micro-batch, and its activation blobs."""

    x: torch.Tensor
    y: torch.Tensor
    input_blob: bytes | None
    grad_blob: bytes | None


def honest_stage_result(
    graph: Graph, weights: Tensors, unit: Unit, inputs: StageInputs
) -> tuple[bytes, float | None]:
    """What an honest browser sends for a stage unit: its payload and loss (None but in the last stage)."""
    assert unit.stage is not None
    stage, fields, codec = unit_stage(graph, unit.stage), unit.stage, unit.activation_codec
    feed = _stage_feed(stage, graph, unit, inputs)
    seed = int(fields["seed"])
    if fields["kind"] == "forward":
        output = stage_forward(stage, weights, feed, seed=seed).output
        return activations.encode(output, codec, kind="activation"), None
    output_grad = None
    if not stage.last:  # decoded against the output's shape
        shape = list(stage_forward(stage, weights, feed, seed=seed).output.shape)
        output_grad = activations.decode(inputs.grad_blob or b"", shape, kind="gradient", codec=codec)
    targets = {graph.loss.inputs[1]: inputs.y} if stage.last else None
    scale = float(fields.get("loss_scale") or 1.0)
    done = stage_backward(stage, weights, feed, output_grad, targets=targets, loss_scale=scale, seed=seed)
    grad = b"" if done.input_grad is None else activations.encode(done.input_grad, codec, kind="gradient")
    tensors = codecs.encode({**done.grads, **done.buffers}, "fp32")  # batch-norm statistics beside them
    return STAGE_LENGTH.pack(len(grad)) + grad + tensors, done.loss


def _stage_feed(stage: Stage, graph: Graph, unit: Unit, inputs: StageInputs) -> Any:
    if stage.index == 0:
        return {graph.inputs[0].name: inputs.x}
    shape = [unit.samples, *graph.inputs[0].shape[1:]]
    return activations.decode(inputs.input_blob or b"", shape, kind="activation", codec=unit.activation_codec)


# --- the volunteer ------------------------------------------------------------------------------------


class _Dropped(Exception):
    """Raised to drop the connection mid-work-unit (emulated failure)."""


class Simulator:
    """One simulated volunteer; `run()` works until max_work_units / duration / stop(), then returns
    its stats."""

    def __init__(
        self,
        config: SimulatorConfig,
        on_verdict: Callable[[int, Verdict], None] | None = None,
        on_compute: ComputeHook | None = None,
        compute: concurrent.futures.Executor | None = None,
    ) -> None:
        self.config, self.on_verdict, self.on_compute = config, on_verdict, on_compute
        # Where the volunteer's training runs (None: the event loop's default executor, threads). A process
        # pool keeps it off this process's GIL, which the connections and downloads need: see
        # benchmarks/scaling/emulation.py device_processes.
        self.compute = compute
        self.stats = SimulatorStats(config.username)
        self.http = Http(config.url)
        self.link = Link(config.bandwidth_mbit, config.latency_ms)
        self.cache = BlobCache()
        self.graphs: dict[str, tuple[Graph, int]] = {}  # graph URL -> (graph, train FLOPs per sample)
        self.feedback: dict[int, codecs.ErrorFeedback] = {}  # project id -> its residual
        self.random = random.Random(config.seed)
        self.generator = torch.Generator().manual_seed(config.seed or 0)
        self.replay: bytes | None = None  # the first payload, resubmitted by stale_replay
        self.awaiting: set[int] = set()  # results sent, verdict not yet known
        self.verdict_arrived = asyncio.Event()
        # Like a browser's id in localStorage: one Device on the server across this simulator's reconnects.
        self.device_id = f"sim-{secrets.token_hex(12)}"
        self.throttled = False  # the server refused the last connect for now
        self.session: _Session | None = None
        self.stopped = False
        self.started = time.monotonic()
        self.retries = 0  # consecutive reconnects; an ack resets it

    async def run(self) -> SimulatorStats:
        self.started = time.monotonic()
        try:
            await self._sign_in()
            while not self.finished():
                await self._session()
        finally:
            self.stats.wall_seconds = time.monotonic() - self.started
            self.stats.unanswered = len(self.awaiting)
        return self.stats

    def stop(self) -> None:
        """Finish gracefully: no more work is asked for; outstanding verdicts are still awaited.
        Call it from the event loop running `run()`."""
        self.stopped = True
        if self.session is not None:
            self.session.inbox.put_nowait({"type": "closed"})  # wakes a session waiting for an assign

    def remaining(self) -> float:
        limit = self.config.max_work_units
        return math.inf if limit is None else limit - self.stats.work_units - self.stats.dropped

    def finished(self) -> bool:
        if self.stopped or self.remaining() <= 0:
            return True
        duration = self.config.duration_s
        return duration is not None and time.monotonic() - self.started >= duration

    def record(self, message: dict[str, Any]) -> None:
        """Book a verdict from a final `ack` or a `credit`; each work unit counts once (with eager
        validation both arrive)."""
        unit_id, status = int(message["work_unit"]), str(message.get("status", ""))
        if status not in VERDICTS or unit_id in self.stats.verdicts:
            return
        verdict = Verdict(status, str(message.get("reason", "")), int(message.get("credit_flops", 0)))
        self.stats.verdicts[unit_id] = verdict
        self.stats.credit_flops += verdict.credit_flops
        self.awaiting.discard(unit_id)
        self.verdict_arrived.set()
        if self.on_verdict is not None:
            self.on_verdict(unit_id, verdict)

    def encode(self, unit: Unit, update: Tensors) -> bytes:
        """The honest wire format: int8, int4 and topk carry this project's residual forward (error
        feedback), one residual per project and codec (a new codec starts afresh)."""
        if unit.codec not in codecs.FEEDBACK:
            return codecs.encode(update, unit.codec)
        feedback = self.feedback.get(unit.project_id)
        if feedback is None or feedback.codec != unit.codec:
            feedback = self.feedback[unit.project_id] = codecs.ErrorFeedback(unit.codec)
        return feedback.compress(update)

    # --- HTTP: account and blobs

    async def _sign_in(self) -> None:
        """A server restarting while we sign in drops or refuses the request: wait and try again, with the
        reconnects' backoff and limit (a sign-up that did land is then a plain login)."""
        while True:
            try:
                await self.authenticate()
                return
            except OSError as exc:
                if self.finished():
                    raise
                await self._reconnect_later(exc)

    async def authenticate(self) -> None:
        if self.config.signup:
            password = self.config.password
            await self._post_form(
                "/accounts/signup/",
                {"username": self.config.username, "password1": password, "password2": password},
            )
        if self.http.cookie("sessionid") is None:  # not signed up (exists already) or plain login
            await self._post_form(
                "/accounts/login/", {"login": self.config.username, "password": self.config.password}
            )
        if self.http.cookie("sessionid") is None:
            raise SimulatorError(f"{self.config.username}: login refused (wrong password?)")

    async def _post_form(self, path: str, form: dict[str, str]) -> None:
        page = (await self.http.request(path)).decode(errors="replace")
        match = CSRF_RE.search(page)
        if match is None:
            raise SimulatorError(f"no CSRF token on {path}")
        await self.http.request(path, {**form, "csrfmiddlewaretoken": match.group(1)})

    async def computed(self, work: Callable[..., Computed], *args: Any) -> Computed:
        """`work(*args)` run where this volunteer computes (self.compute)."""
        return await asyncio.get_running_loop().run_in_executor(self.compute, work, *args)

    async def download(self, url: str) -> bytes:
        cached = self.cache.get(url)
        if cached is not None:
            return cached
        started = time.monotonic()
        data = await self.http.request(url)
        await self.link.pace(len(data), started)
        self.stats.bytes_received += len(data)
        self.cache.put(url, data)
        return data

    async def weights(self, unit: Unit) -> bytes:
        """The unit's weights, built as browsers build them from the previous version's (when held) and the
        server's delta; checked against the content address, and downloaded whole if they differ."""
        delta, held = unit.weights_delta, self.cache.get(unit.weights_url)
        base = self.cache.get(delta["base_url"]) if delta and held is None else None
        if delta is None or base is None:
            return held if held is not None else await self.download(unit.weights_url)
        built = codecs.apply_delta(codecs.decode(base)[0], await self.download(delta["url"]))
        data = codecs.encode(built)
        if hashlib.sha256(data).hexdigest() != urllib.parse.urlsplit(unit.weights_url).path.split("/")[-1]:
            logger.warning("weights built from a delta differ from %s; downloading them", unit.weights_url)
            return await self.download(unit.weights_url)
        self.stats.weights_by_delta += 1
        self.cache.put(unit.weights_url, data)
        return data

    async def graph(self, url: str) -> tuple[Graph, int]:
        key = urllib.parse.urlsplit(url).path  # a stage graph's URL carries a grant, fresh every unit
        if key not in self.graphs:
            graph = load_graph(await self.download(url))
            self.graphs[key] = (graph, train_flops_per_sample(graph))
        return self.graphs[key]

    # --- the WebSocket session

    def _ws_url(self) -> str:
        parts = urllib.parse.urlsplit(self.config.url)
        scheme = "wss" if parts.scheme == "https" else "ws"
        return f"{scheme}://{parts.netloc}/ws/volunteer/"

    async def _session(self) -> None:
        """One connection: hello, then ready / assign / result until done or dropped."""
        headers = {"Cookie": self.http.cookie_header()}
        origin = self.config.url.rstrip("/")
        try:
            async with connect(
                self._ws_url(), additional_headers=headers, origin=Origin(origin), max_size=2**26
            ) as ws:
                self.session = _Session(self, ws)
                await self.session.run()
        except _Dropped:
            self.stats.dropped += 1
        # InvalidHandshake: daphne refuses the handshake (HTTP 500) while Redis is down, or dies during it
        # (the balancer's connection closes with no HTTP response); the browser retries either like a drop.
        except (_ServerClosed, ConnectionClosed, InvalidHandshake, OSError) as exc:
            await self._reconnect_later(exc)
        finally:
            self.session = None

    async def _reconnect_later(self, exc: BaseException) -> None:
        if self.finished():
            return
        if self.throttled:  # too many connects this minute (close 4429): not a failure, just wait
            self.throttled = False
            logger.info("%s: connects throttled; waiting %.0f s", self.config.username, THROTTLED_WAIT_S)
            await asyncio.sleep(THROTTLED_WAIT_S * (0.75 + self.random.random() / 2))
            return
        if _told_to_retry_later(exc):
            logger.info("%s: the server is busy admitting others; retrying later", self.config.username)
            await asyncio.sleep(RETRY_LATER_S + self.random.random() * min(10.0, 0.25 * 2**self.retries))
            return
        self.retries += 1
        if self.retries > MAX_RETRIES:
            raise SimulatorError(f"{self.config.username}: gave up after {MAX_RETRIES} reconnects") from exc
        self.stats.reconnects += 1
        logger.info("%s: connection lost (%r); reconnecting", self.config.username, exc)
        await asyncio.sleep(min(10.0, 0.25 * 2**self.retries))  # the browser's backoff, roughly


class _Session:
    """The frames of one connection. A reader task sorts incoming frames: cancels, acks and credits are
    applied at once; assigns (and the end of the connection) are queued for the work loop.

    At most one `ready` is open at a time (an `idle` reply parks it: the server pushes an assign later),
    so with prefetch the connection holds at most the unit being computed plus one, as the server allows.
    """

    def __init__(self, sim: Simulator, ws: ClientConnection) -> None:
        self.sim, self.ws, self.stats = sim, ws, sim.stats
        self.inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.cancelled: dict[int, asyncio.Event] = {}
        self.requested = False  # a `ready` is open (sent, no assign yet)
        self.closed = False

    async def run(self) -> None:
        reader = asyncio.create_task(self._read())
        try:
            await self._hello()
            await self._work()
            await self._await_verdicts()
            with contextlib.suppress(ConnectionClosed):
                await self.send({"type": "bye"})
        finally:
            reader.cancel()

    async def send(self, message: dict[str, Any]) -> None:
        text = json.dumps(message)
        self.stats.bytes_sent += len(text.encode())
        await self.ws.send(text)

    async def _read(self) -> None:
        try:
            async for raw in self.ws:
                self.stats.bytes_received += len(raw)
                self._dispatch(json.loads(raw))
        except ConnectionClosed:
            pass
        self.closed = True
        self.sim.verdict_arrived.set()  # no verdict can come on this connection any more
        await self.inbox.put({"type": "closed"})

    def _dispatch(self, message: dict[str, Any]) -> None:
        kind = message.get("type")
        if kind == "cancel":
            for unit_id in message.get("work_units", []):
                self.cancelled.setdefault(int(unit_id), asyncio.Event()).set()
        elif kind == "ack":
            self.sim.retries = 0
            self.sim.record(message)  # a final status (e.g. late) comes without a later `credit`
        elif kind == "credit":
            self.sim.record(message)
        elif kind == "error":
            self.stats.errors += 1
            logger.warning("%s: server error %s", self.stats.username, message)
            if message.get("code") == "busy":
                self.requested = False
            self.sim.throttled = self.sim.throttled or message.get("code") == "throttled"
        elif kind == "assign":
            self.requested = False
            self.inbox.put_nowait(message)
        elif kind == "welcome":
            self.inbox.put_nowait(message)
        # `idle`: the open `ready` stays parked on the server, which pushes an assign when work appears.

    async def _next(self) -> dict[str, Any]:
        timeout = None
        if self.sim.config.duration_s is not None:
            timeout = max(0.0, self.sim.config.duration_s - (time.monotonic() - self.sim.started))
        try:
            message = await asyncio.wait_for(self.inbox.get(), timeout)
        except TimeoutError:
            return {"type": "closed"}  # out of time while idle: end the session like a closed one
        if message["type"] == "closed":
            self.inbox.put_nowait(message)  # stays closed for every later receive
        return message

    async def _hello(self) -> None:
        config = self.sim.config
        await self.send(
            {
                "type": "hello",
                "protocol": PROTOCOL_VERSION,
                "device": {
                    "id": self.sim.device_id,
                    "backend": "simulator",
                    "gflops": config.gflops,
                    "user_agent": "crowdtrain-simulator",
                },
                "preferences": {"max_work_units": config.max_work_units},
            }
        )
        welcome = await self._next()
        if welcome["type"] != "welcome":
            raise _ServerClosed("closed instead of welcome")

    async def _work(self) -> None:
        while not self.sim.finished():
            unit = await self._next_unit()
            if unit is None:
                self._check_open()
                return
            if self.sim.config.prefetch and self.sim.remaining() > 1:
                await self._request()  # the next unit downloads while this one computes
            cancel = self.cancelled.setdefault(unit.id, asyncio.Event())
            await _Work(self, unit, cancel).run()

    async def _request(self) -> None:
        if not self.requested:
            self.requested = True
            await self.send({"type": "ready"})

    async def _next_unit(self) -> Unit | None:
        """A prefetched assign if one is queued, else ask (unless asked already) and wait for one."""
        if self.inbox.empty():
            await self._request()
        message = await self._next()
        return Unit.parse(message["work_unit"]) if message["type"] == "assign" else None

    def _check_open(self) -> None:
        if not self.sim.finished():
            raise _ServerClosed("closed while waiting for work")

    async def _await_verdicts(self) -> None:
        """Verdicts come after validation, so linger (up to verdict_timeout_s) to count them."""
        deadline = time.monotonic() + self.sim.config.verdict_timeout_s
        while self.sim.awaiting and not self.closed:
            self.sim.verdict_arrived.clear()
            left = deadline - time.monotonic()
            if left <= 0:
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.sim.verdict_arrived.wait(), left)


class _Work:
    """Download, compute, wait out the emulated device time, tamper if Byzantine, send."""

    def __init__(self, session: _Session, unit: Unit, cancel: asyncio.Event) -> None:
        self.session, self.sim, self.unit, self.cancel = session, session.sim, unit, cancel

    async def run(self) -> bool:
        """True if a result was sent (a verdict will follow); False if the unit was cancelled."""
        if self.cancel.is_set():  # a prefetched unit whose round closed before we got to it
            self.sim.stats.cancelled += 1
            return False
        started = time.monotonic()
        graph, flops = await self.sim.graph(self.unit.graph_url)
        weights = codecs.decode(await self.sim.weights(self.unit))[0]
        x, y = await self._samples()
        if self.unit.stage is not None:
            return await self._run_stage(
                graph, flops, weights, StageInputs(x, y, *await self._blobs()), started
            )
        download_ms = int((time.monotonic() - started) * 1000)
        update, loss, compute_s = await self._compute(graph, weights, x, y)
        device_s = self._device_time(compute_s, flops)
        if not await self._wait(device_s - compute_s):
            self.sim.stats.cancelled += 1
            return False
        self._maybe_fail()
        await self._send(self._payload(update), loss, int(device_s * 1000), download_ms)
        return True

    async def _blobs(self) -> tuple[bytes | None, bytes | None]:
        """A stage unit's input activation and output gradient (None where it has none)."""
        found = []
        for what, url in (("input", self.unit.input_url), ("output_grad", self.unit.output_grad_url)):
            relayed = bool(self.unit.ring and self.unit.ring.get(what))
            found.append(await self._relayed(what, url) if relayed and url else await self._blob(url))
        return found[0], found[1]

    async def _blob(self, url: str | None) -> bytes | None:
        return await self.sim.download(url) if url else None

    async def _relayed(self, what: str, url: str) -> bytes:
        """A payload that went by the peer ring: the server has its producer upload it, then serves it."""
        await self.session.send({"type": "fetch", "work_unit": self.unit.id, "what": what})
        deadline = time.monotonic() + RELAY_WAIT_S
        while True:
            try:
                return await self.sim.download(url)
            except urllib.error.HTTPError:
                if time.monotonic() > deadline or self.cancel.is_set():
                    raise
                await asyncio.sleep(0.5)

    async def _run_stage(
        self, graph: Graph, flops: int, weights: Tensors, inputs: StageInputs, started: float
    ) -> bool:
        """A pipeline stage unit, always honest: attacks are data-parallel updates (see _payload)."""
        download_ms = int((time.monotonic() - started) * 1000)
        began = time.monotonic()
        payload, loss = await self.sim.computed(honest_stage_result, graph, weights, self.unit, inputs)
        compute_s = time.monotonic() - began
        self.sim.stats.compute_seconds += compute_s
        device_s = self._device_time(compute_s, flops)
        if not await self._wait(device_s - compute_s):
            self.sim.stats.cancelled += 1
            return False
        self._maybe_fail()
        await self._send(payload, loss, int(device_s * 1000), download_ms)
        return True

    def _device_time(self, compute_s: float, flops_per_sample: int) -> float:
        """The emulated device's time, never shorter than the real computation; the hook sees both."""
        emulated_s = self._device_seconds(flops_per_sample)
        if self.sim.on_compute is not None:
            self.sim.on_compute(self.unit, compute_s, emulated_s)
        return max(compute_s, emulated_s)

    def _device_seconds(self, flops_per_sample: int) -> float:
        """How long the emulated device needs: samples x FLOPs (the server's own count) / speed."""
        gflops = self.sim.config.gflops
        return self.unit.samples * flops_per_sample / (gflops * 1e9) if gflops > 0 else 0.0

    async def _samples(self) -> tuple[torch.Tensor, torch.Tensor]:
        xs, ys = [], []
        for shard in self.unit.shards:
            arrays = load_shard(await self.sim.download(shard["url"]))
            window = slice(int(shard["offset"]), int(shard["offset"]) + int(shard["count"]))
            xs.append(torch.from_numpy(arrays["x"][window]))
            ys.append(torch.from_numpy(arrays["y"][window]))
        return torch.cat(xs), torch.cat(ys)

    async def _compute(
        self, graph: Graph, weights: Tensors, x: torch.Tensor, y: torch.Tensor
    ) -> tuple[Tensors, float, float]:
        started = time.monotonic()
        # In threads (torch releases the GIL, so simulated volunteers compute side by side) or processes.
        update, loss = await self.sim.computed(honest_update, graph, weights, x, y, self.unit)
        seconds = time.monotonic() - started
        self.sim.stats.compute_seconds += seconds
        await self.session.send({"type": "progress", "work_unit": self.unit.id, "fraction": 1.0})
        return update, loss, seconds

    async def _wait(self, seconds: float) -> bool:
        """Sleep out the emulated compute time; False as soon as the server cancels the unit."""
        if self.cancel.is_set():
            return False
        try:
            await asyncio.wait_for(self.cancel.wait(), timeout=max(0.0, seconds))
        except TimeoutError:
            return True
        return False

    def _maybe_fail(self) -> None:
        if self.sim.random.random() < self.sim.config.failure_probability:
            # Abort the TCP connection without a close handshake, like a closed laptop lid.
            self.session.ws.transport.abort()
            raise _Dropped

    async def _send(self, payload: bytes, loss: float | None, compute_ms: int, download_ms: int) -> None:
        await self.session.send(
            {
                "type": "result",
                "work_unit": self.unit.id,
                "model_version": self.unit.model_version,
                "samples": self.unit.samples,
                "loss": loss,
                "timings": {"download_ms": download_ms, "compute_ms": compute_ms},
                **(poison_claims(self._poison_kind(), self.unit.model_version) if self._poisons() else {}),
            }
        )
        started = time.monotonic()
        await self.sim.link.pace(len(payload), started)  # the upload's emulated duration, then it lands
        self.sim.awaiting.add(self.unit.id)
        await self.session.ws.send(payload)
        self.sim.stats.bytes_sent += len(payload)
        self.sim.stats.work_units += 1

    def _poisons(self) -> bool:
        return self.sim.config.byzantine == "poison"

    def _poison_kind(self) -> str:
        return POISONS[self.sim.stats.work_units % len(POISONS)]  # each in turn

    def _payload(self, update: Tensors) -> bytes:
        behaviour = self.sim.config.byzantine
        if behaviour == "none":
            return self.sim.encode(self.unit, update)
        if behaviour == "poison":
            return poison(update, self._poison_kind(), self.unit.codec)
        if behaviour == "stale_replay":
            # The first result is honest; every later one resends its bytes for a different work unit.
            self.sim.replay = self.sim.replay or self.sim.encode(self.unit, update)
            return self.sim.replay
        # No error feedback for attacks: a NaN residual could not even be quantised, and the attacker's
        # residual is irrelevant anyway.
        return codecs.encode(tamper(update, behaviour, self.sim.generator), self.unit.codec)


async def simulate_all(configs: list[SimulatorConfig]) -> list[SimulatorStats]:
    """Every configured volunteer at once, each in its own Simulator; their stats in the same order."""
    return list(await asyncio.gather(*(Simulator(c).run() for c in configs)))
