"""A simulated volunteer: a Python client of docs/protocol.md that computes real gradients with engine/.

It is an outside client, exactly like a browser: it signs up / logs in over HTTP, opens the volunteer
WebSocket with the session cookie, and downloads graphs, weights and shards from the blob URLs. It never
imports Django models nor touches the database, so it can load-test any running server.

Emulated hardware: results are not sent sooner than samples * FLOPs / speed, and transfers take no less
than size * 8 / bandwidth + latency. Byzantine behaviours tamper with the gradient before it is sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.cookiejar
import json
import logging
import random
import re
import time
import urllib.parse
import urllib.request
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors.numpy import load as load_shard
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed
from websockets.typing import Origin

from engine import codecs
from engine.flops import train_flops_per_sample
from engine.graph import Graph, load_graph
from engine.runtime import compute_gradients

logger = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
BYZANTINE = ("none", "scaled", "sign_flip", "random", "nan", "stale_replay")
CSRF_RE = re.compile(r'name="csrfmiddlewaretoken" value="([^"]+)"')
Tensors = dict[str, torch.Tensor]


MAX_RETRIES = 8  # consecutive reconnects without a single ack before the volunteer gives up


class SimulatorError(RuntimeError):
    """The simulated volunteer cannot go on (login refused, server gone, protocol violated)."""


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
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.byzantine not in BYZANTINE:
            raise ValueError(f"byzantine must be one of {BYZANTINE}, not {self.byzantine!r}")


@dataclass
class SimulatorStats:
    username: str
    work_units: int = 0  # results sent
    accepted: int = 0
    rejected: int = 0
    dropped: int = 0  # connections dropped on purpose (failure_probability)
    cancelled: int = 0
    reconnects: int = 0  # connections the server closed and the simulator reopened
    errors: int = 0  # `error` frames from the server
    credit_flops: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    compute_seconds: float = 0.0
    wall_seconds: float = 0.0
    reasons: list[str] = field(default_factory=list)  # why results were rejected


@dataclass(frozen=True)
class Unit:
    """One `assign`ed work unit (the fields the simulator uses)."""

    id: int
    model_version: int
    graph_url: str
    weights_url: str
    shards: list[dict[str, Any]]

    @classmethod
    def parse(cls, raw: dict[str, Any]) -> Unit:
        return cls(int(raw["id"]), int(raw["model_version"]), raw["graph_url"], raw["weights_url"],
                   list(raw["shards"]))

    @property
    def samples(self) -> int:
        return sum(int(s["count"]) for s in self.shards)


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


class Http:
    """Blocking urllib with a cookie jar, run in threads so the event loop never waits on it."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url.rstrip("/")
        self.cookies = http.cookiejar.CookieJar()
        self.opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(self.cookies))

    async def request(self, path: str, form: dict[str, str] | None = None) -> bytes:
        return await asyncio.to_thread(self._request, path, form)

    def _request(self, path: str, form: dict[str, str] | None) -> bytes:
        url = path if path.startswith("http") else self.base_url + path
        data = urllib.parse.urlencode(form).encode() if form is not None else None
        # Django's CSRF check wants a same-origin Referer on POSTs (strictly only over HTTPS).
        request = urllib.request.Request(url, data=data, headers={"Referer": url})
        with self.opener.open(request, timeout=60) as response:
            return bytes(response.read())

    def cookie(self, name: str) -> str | None:
        return next((c.value for c in self.cookies if c.name == name), None)

    def cookie_header(self) -> str:
        return "; ".join(f"{c.name}={c.value}" for c in self.cookies)


class BlobCache:
    """Immutable blobs by URL, least recently used evicted first (weights change every version)."""

    def __init__(self, max_entries: int = 64) -> None:
        self.max_entries = max_entries
        self.entries: OrderedDict[str, bytes] = OrderedDict()

    def get(self, url: str) -> bytes | None:
        if url in self.entries:
            self.entries.move_to_end(url)
        return self.entries.get(url)

    def put(self, url: str, data: bytes) -> None:
        self.entries[url] = data
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


# --- the volunteer ------------------------------------------------------------------------------------


class _Dropped(Exception):
    """Raised to drop the connection mid-work-unit (emulated failure)."""


class Simulator:
    """One simulated volunteer; `run()` works until max_work_units / duration, then returns its stats."""

    def __init__(self, config: SimulatorConfig, on_ack: Callable[[dict[str, Any]], None] | None = None
                 ) -> None:
        self.config, self.on_ack = config, on_ack
        self.stats = SimulatorStats(config.username)
        self.http = Http(config.url)
        self.link = Link(config.bandwidth_mbit, config.latency_ms)
        self.cache = BlobCache()
        self.graphs: dict[str, tuple[Graph, int]] = {}  # graph URL -> (graph, train FLOPs per sample)
        self.random = random.Random(config.seed)
        self.generator = torch.Generator().manual_seed(config.seed or 0)
        self.replay: bytes | None = None  # the first payload, resubmitted by stale_replay
        self.started = time.monotonic()
        self.retries = 0  # consecutive reconnects; an ack resets it

    async def run(self) -> SimulatorStats:
        self.started = time.monotonic()
        try:
            await self.authenticate()
            while not self.finished():
                await self._session()
        finally:
            self.stats.wall_seconds = time.monotonic() - self.started
        return self.stats

    def finished(self) -> bool:
        limit, duration = self.config.max_work_units, self.config.duration_s
        if limit is not None and self.stats.work_units + self.stats.dropped >= limit:
            return True
        return duration is not None and time.monotonic() - self.started >= duration

    # --- HTTP: account and blobs

    async def authenticate(self) -> None:
        if self.config.signup:
            password = self.config.password
            await self._post_form("/signup/", {"username": self.config.username,
                                               "password1": password, "password2": password})
        if self.http.cookie("sessionid") is None:  # not signed up (exists already) or plain login
            await self._post_form("/login/", {"username": self.config.username,
                                              "password": self.config.password})
        if self.http.cookie("sessionid") is None:
            raise SimulatorError(f"{self.config.username}: login refused (wrong password?)")

    async def _post_form(self, path: str, form: dict[str, str]) -> None:
        page = (await self.http.request(path)).decode(errors="replace")
        match = CSRF_RE.search(page)
        if match is None:
            raise SimulatorError(f"no CSRF token on {path}")
        await self.http.request(path, {**form, "csrfmiddlewaretoken": match.group(1)})

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

    async def graph(self, url: str) -> tuple[Graph, int]:
        if url not in self.graphs:
            graph = load_graph(await self.download(url))
            self.graphs[url] = (graph, train_flops_per_sample(graph))
        return self.graphs[url]

    # --- the WebSocket session

    def _ws_url(self) -> str:
        parts = urllib.parse.urlsplit(self.config.url)
        scheme = "wss" if parts.scheme == "https" else "ws"
        return f"{scheme}://{parts.netloc}/ws/volunteer/"

    async def _session(self) -> None:
        """One connection: hello, then ready / assign / result / ack until done or dropped."""
        headers = {"Cookie": self.http.cookie_header()}
        origin = self.config.url.rstrip("/")
        try:
            async with connect(self._ws_url(), additional_headers=headers, origin=Origin(origin),
                               max_size=2**26) as ws:
                await _Session(self, ws).run()
        except _Dropped:
            self.stats.dropped += 1
        except (_ServerClosed, ConnectionClosed, OSError) as exc:
            await self._reconnect_later(exc)

    async def _reconnect_later(self, exc: BaseException) -> None:
        if self.finished():
            return
        self.retries += 1
        if self.retries > MAX_RETRIES:
            raise SimulatorError(f"{self.config.username}: gave up after {MAX_RETRIES} reconnects") from exc
        self.stats.reconnects += 1
        logger.info("%s: connection lost (%r); reconnecting", self.config.username, exc)
        await asyncio.sleep(min(10.0, 0.25 * 2**self.retries))  # the browser's backoff, roughly


class _Session:
    """The frames of one connection. A reader task sorts incoming frames: cancels are applied at once,
    everything else is queued for the work loop."""

    def __init__(self, sim: Simulator, ws: ClientConnection) -> None:
        self.sim, self.ws, self.stats = sim, ws, sim.stats
        self.inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.cancelled: dict[int, asyncio.Event] = {}

    async def run(self) -> None:
        reader = asyncio.create_task(self._read())
        try:
            await self._hello()
            while not self.sim.finished():
                await self._one_work_unit()
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
        await self.inbox.put({"type": "closed"})

    def _dispatch(self, message: dict[str, Any]) -> None:
        if message.get("type") == "cancel":
            for unit_id in message.get("work_units", []):
                self.cancelled.setdefault(int(unit_id), asyncio.Event()).set()
            return
        self.inbox.put_nowait(message)

    async def receive(self, *types: str) -> dict[str, Any]:
        """The next queued frame of one of `types`; idle frames just mean "wait for a pushed assign"."""
        while True:
            message = await self._next()
            if message["type"] in types:
                return message
            if message["type"] == "error":
                self.stats.errors += 1
                logger.warning("%s: server error %s", self.stats.username, message)
                if "error" in types:
                    return message

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
        await self.send({"type": "hello", "protocol": PROTOCOL_VERSION,
                         "device": {"backend": "simulator", "gflops": config.gflops,
                                    "user_agent": "crowdtrain-simulator"},
                         "preferences": {"max_work_units": config.max_work_units}})
        welcome = await self.receive("welcome", "closed")
        if welcome["type"] != "welcome":
            raise _ServerClosed("closed instead of welcome")

    async def _one_work_unit(self) -> None:
        await self.send({"type": "ready"})
        message = await self.receive("assign", "closed")
        if message["type"] == "closed":
            self._check_open()
            return
        unit = Unit.parse(message["work_unit"])
        cancel = self.cancelled.setdefault(unit.id, asyncio.Event())
        if await _Work(self, unit, cancel).run():
            await self._await_ack(unit)

    def _check_open(self) -> None:
        if not self.sim.finished():
            raise _ServerClosed("closed while waiting for work")

    async def _await_ack(self, unit: Unit) -> None:
        message = await self.receive("ack", "error", "closed")
        if message["type"] == "ack":
            self.sim.retries = 0
            self.stats.credit_flops += int(message["credit_flops"])
            self._count(message)
        if self.sim.on_ack is not None:
            self.sim.on_ack(message)

    def _count(self, ack: dict[str, Any]) -> None:
        if ack["accepted"]:
            self.stats.accepted += 1
        else:
            self.stats.rejected += 1
            self.stats.reasons.append(str(ack.get("reason", "")))


class _Work:
    """Download, compute, wait out the emulated device time, tamper if Byzantine, send."""

    def __init__(self, session: _Session, unit: Unit, cancel: asyncio.Event) -> None:
        self.session, self.sim, self.unit, self.cancel = session, session.sim, unit, cancel

    async def run(self) -> bool:
        """True if a result was sent (an ack will follow); False if the unit was cancelled."""
        started = time.monotonic()
        graph, flops = await self.sim.graph(self.unit.graph_url)
        weights = codecs.decode(await self.sim.download(self.unit.weights_url))[0]
        x, y = await self._samples()
        download_ms = int((time.monotonic() - started) * 1000)
        grads, loss, compute_s = await self._compute(graph, weights, x, y)
        device_s = max(compute_s, self._device_seconds(flops))
        if not await self._wait(device_s - compute_s):
            self.sim.stats.cancelled += 1
            return False
        self._maybe_fail()
        await self._send(grads, loss, int(device_s * 1000), download_ms)
        return True

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

    async def _compute(self, graph: Graph, weights: Tensors, x: torch.Tensor, y: torch.Tensor
                       ) -> tuple[Tensors, float, float]:
        started = time.monotonic()
        # In a thread: torch releases the GIL, so many simulated volunteers compute side by side.
        result = await asyncio.to_thread(
            compute_gradients, graph, weights, {graph.inputs[0].name: x}, {graph.targets[0].name: y})
        seconds = time.monotonic() - started
        self.sim.stats.compute_seconds += seconds
        await self.session.send({"type": "progress", "work_unit": self.unit.id, "fraction": 1.0})
        return result.grads, result.loss, seconds

    async def _wait(self, seconds: float) -> bool:
        """Sleep out the emulated compute time; False as soon as the server cancels the unit."""
        try:
            await asyncio.wait_for(self.cancel.wait(), timeout=seconds)
        except TimeoutError:
            return True
        return False

    def _maybe_fail(self) -> None:
        if self.sim.random.random() < self.sim.config.failure_probability:
            # Abort the TCP connection without a close handshake, like a closed laptop lid.
            self.session.ws.transport.abort()
            raise _Dropped

    async def _send(self, grads: Tensors, loss: float, compute_ms: int, download_ms: int) -> None:
        payload = self._payload(grads)
        await self.session.send({
            "type": "result", "work_unit": self.unit.id, "model_version": self.unit.model_version,
            "samples": self.unit.samples, "loss": loss,
            "timings": {"download_ms": download_ms, "compute_ms": compute_ms},
        })
        started = time.monotonic()
        await self.sim.link.pace(len(payload), started)  # the upload's emulated duration, then it lands
        await self.session.ws.send(payload)
        self.sim.stats.bytes_sent += len(payload)
        self.sim.stats.work_units += 1

    def _payload(self, grads: Tensors) -> bytes:
        behaviour = self.sim.config.byzantine
        if behaviour == "stale_replay" and self.sim.replay is not None:
            return self.sim.replay  # an old result's bytes, for a different work unit
        payload = codecs.encode(tamper(grads, behaviour, self.sim.generator))
        self.sim.replay = self.sim.replay or payload
        return payload
