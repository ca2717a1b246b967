"""A hostile client of docs/protocol.md: seeded random WebSocket frames, and the runner that sends them.

The frames are what anybody with an ordinary volunteer account can send: random JSON of random depth,
every field of every message with the wrong type or an absurd number (2**63, 1e400, Infinity, NaN), NUL
and lone surrogates in strings, unknown types, non-objects, binary frames nobody announced, oversize text,
results for other volunteers' and unknown work units, and results for one's own work units carrying
poison (a safetensors header nested 100,000 deep, NaN tensors, wrong shapes, a claimed model version
+ 999, compute_ms 2**63 - 1), replays and rapid reconnects.

Each connection says hello, sends a batch of frames as fast as the socket takes them, then `bye`, and
waits for the close. The server must answer every frame and close with 1000 after `bye`: a 1011 close
is a crash, no close at all a stall. Whatever ends a connection abnormally is kept with the frames sent
just before it, and `Fuzzer.triage` replays those one by one (hello, frame, bye) to name the culprit.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import re
import struct
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import torch
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.typing import Origin

from engine import codecs
from workers.simulator import Simulator, SimulatorConfig

CRASH = 1011  # daphne's close code when the consumer raised
THROTTLED = 4429  # too many connects this minute
# The fuzz reconnects all the time: with the platform's connect throttle (tests/security/test_throttling.py)
# it would mostly meet the throttle instead of the consumer, so a fuzzed stack runs with these.
UNTHROTTLED = {
    "CROWDTRAIN_WS_CONNECTS_PER_MINUTE_USER": "100000",
    "CROWDTRAIN_WS_CONNECTS_PER_MINUTE_IP": "100000",
}
STALL_SECONDS = 20.0  # a server that has not closed this long after `bye` has stopped answering
HISTORY = 24  # frames kept per connection: the client runs ahead of the server until it sees the close
TRIAGE_SECONDS = 60.0  # replaying failures' frames one by one, at most this long
PASSWORD = "fuzz-account-pass-9731"
MAX_REPORTED = 12  # distinct failures described in full


# --- JSON with the tokens json.dumps will not write ----------------------------------------------


@dataclass(frozen=True)
class Raw:
    """A JSON token spelled out: 1e400, Infinity, NaN, a 5,000-digit integer."""

    token: str


def dumps(value: Any) -> str:
    if isinstance(value, Raw):
        return value.token
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(str(k))}:{dumps(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(dumps(v) for v in value) + "]"
    return json.dumps(value)


NUMBERS: list[Any] = [
    -1,
    0,
    0.5,
    -0.0,
    2**31 - 1,
    2**31,
    2**53 + 1,
    2**63 - 1,
    2**63,
    2**64,
    -(2**63) - 1,
    10**30,
    Raw("1e400"),
    Raw("-1e400"),
    Raw("Infinity"),
    Raw("-Infinity"),
    Raw("NaN"),
    Raw("1e-400"),
    Raw("1" * 5000),  # past Python's int-parsing digit limit: ValueError, not JSONDecodeError
]
STRINGS: list[Any] = [
    "",
    "\x00",
    "gpu\x00",
    "\ud800",
    "\udfff\ud800",
    "é漢字🙂",
    "\u202egnp.exe",
    "x" * 5000,
    "' OR 1=1 --",
    "../../etc/passwd",
    "<script>alert(1)</script>",
    "%s%n%x",
    "__proto__",
    "hello",
]
OTHERS: list[Any] = [None, True, False, {}, [], [[]], {"": None}, {"type": "hello"}, [1, 2, 3]]
HOSTILE = NUMBERS + STRINGS + OTHERS
UNKNOWN_TYPES = [
    "tensors",
    "json",
    "__init__",
    "__class__",
    "send_json",
    "disconnect",
    "close",
    "credit",
    "assign",
    "welcome",
    "HELLO",
    "hello ",
    "",
    "result\x00",
    "ready2",
]


# --- frames ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Frame:
    kind: str
    text: str | None = None
    binary: bytes | None = None  # sent right after `text`, or alone

    def describe(self, limit: int = 240) -> str:
        parts = [self.kind]
        if self.text is not None:
            text = self.text
            if len(text) > limit:
                text = f"{text[:limit]}... ({len(text)} chars)"
            parts.append(f"text={text!r}")
        if self.binary is not None:
            parts.append(f"binary={self.binary[:48]!r}... ({len(self.binary)} bytes)")
        return " ".join(parts)


@dataclass
class Assigned:
    id: int
    model_version: int
    samples: int
    codec: str
    shapes: dict[str, tuple[int, ...]]


@dataclass
class Knowledge:
    """What a connection learnt from the server, so that its frames can aim at real work units."""

    own: dict[int, Assigned] = field(default_factory=dict)  # held by this connection, no result yet
    foreign: set[int] = field(default_factory=set)  # other fuzz connections' work units (shared)
    payloads: deque[tuple[int, bytes]] = field(default_factory=lambda: deque(maxlen=8))  # for replays


def hello(device: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "type": "hello",
        "protocol": 1,
        "device": device or {"backend": "webgl", "gflops": 10, "memory_mb": 2048, "user_agent": "fuzz"},
        "preferences": {"max_work_units": 2},
    }


def result(work_unit: Any, model_version: Any = 0, samples: Any = 16, **overrides: Any) -> dict[str, Any]:
    message = {
        "type": "result",
        "work_unit": work_unit,
        "model_version": model_version,
        "samples": samples,
        "loss": 0.5,
        "timings": {"download_ms": 5, "compute_ms": 50},
    }
    message.update(overrides)
    return message


def templates(unit: int) -> list[dict[str, Any]]:
    return [
        hello(),
        {"type": "ready"},
        {"type": "progress", "work_unit": unit, "fraction": 0.5},
        result(unit),
        {"type": "pause", "paused": True},
        {"type": "bye"},
    ]


def leaf_paths(value: Any, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    paths = [prefix] if prefix else []
    if isinstance(value, dict):
        for key, inner in value.items():
            paths += leaf_paths(inner, (*prefix, key))
    return paths


def replaced(message: dict[str, Any], path: tuple[str, ...], value: Any) -> dict[str, Any]:
    copy = json.loads(json.dumps(message))
    target = copy
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return dict(copy)


class Frames:
    """Seeded hostile frames. `next()` picks a kind by weight; each kind is one method."""

    def __init__(self, rng: random.Random, knowledge: Knowledge) -> None:
        self.rng, self.known = rng, knowledge
        # Percentages, roughly; the big frames are rare so that 10,000 frames stay a few hundred MB.
        self.kinds: list[tuple[str, float]] = [
            ("random_json", 10),
            ("wrong_field", 30),
            ("unknown_type", 5),
            ("non_object", 5),
            ("deep_json", 2),
            ("oversize_text", 0.5),
            ("lone_binary", 4),
            ("ready", 6),
            ("progress", 4),
            ("hello_again", 3),
            ("foreign_result", 8),
            ("own_poison", 10),
            ("replay", 3),
            ("bye", 0.3),
            ("abort", 0.3),
            ("half_result", 3),
            ("big_binary", 0.2),
        ]

    def next(self) -> Frame:
        names, weights = zip(*self.kinds, strict=True)
        kind = self.rng.choices(names, weights)[0]
        frame: Frame = getattr(self, kind)()
        return frame

    def some_unit(self) -> int:
        pool = [*self.known.own, *self.known.foreign]
        choices: list[int] = [0, 1, 2**31 - 1, 10**9]
        if pool:
            base = self.rng.choice(pool)
            choices += [base, base + self.rng.randint(-50, 50)]
        return self.rng.choice(choices)

    def random_value(self, depth: int) -> Any:
        roll = self.rng.random()
        if depth <= 0 or roll < 0.4:
            return self.rng.choice(HOSTILE[: -len(OTHERS)] + [self.rng.random(), self.rng.randint(-9, 9)])
        if roll < 0.7:
            return [self.random_value(depth - 1) for _ in range(self.rng.randint(0, 4))]
        keys = ["type", "work_unit", "device", "timings", "protocol", *STRINGS[:6]]
        return {self.rng.choice(keys): self.random_value(depth - 1) for _ in range(self.rng.randint(0, 4))}

    # --- the kinds

    def random_json(self) -> Frame:
        value = self.random_value(self.rng.randint(0, 12))
        if isinstance(value, dict) and self.rng.random() < 0.5:
            value["type"] = self.rng.choice(["hello", "ready", "progress", "result", "pause", "bye"])
        return Frame("random_json", text=dumps(value))

    def wrong_field(self) -> Frame:
        message = self.rng.choice(templates(self.some_unit()))
        path = self.rng.choice(leaf_paths(message))
        if self.rng.random() < 0.1:
            return Frame("missing_field", text=dumps(_without(message, path)))
        return Frame(
            f"wrong_field:{message['type']}.{'.'.join(path)}",
            text=dumps(replaced(message, path, self.rng.choice(HOSTILE))),
        )

    def unknown_type(self) -> Frame:
        return Frame("unknown_type", text=dumps({"type": self.rng.choice(UNKNOWN_TYPES), "work_unit": 1}))

    def non_object(self) -> Frame:
        texts = [
            "[]",
            "1",
            "null",
            '"hello"',
            "true",
            "",
            " ",
            "{",
            "}{",
            '{"type": "ready"}{}',
            "\x00",
            '{"type": "ready", "type": {}}',
            "NaN",
            "[" * 50 + "]" * 50,
            '{"type": ["ready"]}',
        ]
        return Frame("non_object", text=self.rng.choice(texts))

    def deep_json(self) -> Frame:
        depth = self.rng.choice([1000, 30_000])
        opener, closer = self.rng.choice([("[", "]"), ('{"a":', "}")])
        nested = opener * depth + "1" + closer * depth
        return Frame("deep_json", text='{"type": "result", "work_unit": ' + nested + "}")

    def oversize_text(self) -> Frame:
        size = self.rng.choice([65 * 1024, 256 * 1024])
        return Frame("oversize_text", text=dumps({"type": "hello", "protocol": 1, "pad": "x" * size}))

    def lone_binary(self) -> Frame:
        choices = [b"", b"\x00" * 8, _deep_header(), _randbytes(self.rng)]
        return Frame("lone_binary", binary=self.rng.choice(choices))

    def big_binary(self) -> Frame:
        size = self.rng.choice([1, 4]) * 2**20
        return Frame("big_binary", text=dumps(result(self.some_unit())), binary=bytes(size))

    def ready(self) -> Frame:
        return Frame("ready", text=dumps({"type": "ready"}))

    def progress(self) -> Frame:
        fraction = self.rng.choice([0.5, -1, 2, Raw("NaN"), "half", None])
        message = {"type": "progress", "work_unit": self.some_unit(), "fraction": fraction}
        return Frame("progress", text=dumps(message))

    def hello_again(self) -> Frame:
        device = {
            "backend": self.rng.choice(STRINGS),
            "gflops": self.rng.choice(NUMBERS),
            "memory_mb": self.rng.choice(NUMBERS),
            "user_agent": self.rng.choice(STRINGS),
        }
        return Frame("hello_again", text=dumps(hello(device)))

    def foreign_result(self) -> Frame:
        unit = self.rng.choice([*self.known.foreign, 10**9, 2**31 - 1, 0]) if self.known.foreign else 10**9
        return Frame("foreign_result", text=dumps(result(unit)), binary=_zeros({"w": (4, 4)}))

    def half_result(self) -> Frame:
        """A result announced and never followed by its tensors (the next frame is something else)."""
        return Frame("half_result", text=dumps(result(self.some_unit())))

    def own_poison(self) -> Frame:
        if not self.known.own:
            return self.foreign_result()
        unit = self.known.own.pop(self.rng.choice(list(self.known.own)))
        name, make = self.rng.choice(POISONS)
        message, payload = make(unit, self.rng)
        self.known.payloads.append((unit.id, payload))
        return Frame(f"own_poison:{name}", text=dumps(message), binary=payload)

    def replay(self) -> Frame:
        if not self.known.payloads:
            return self.foreign_result()
        unit, payload = self.rng.choice(self.known.payloads)
        target = self.rng.choice([unit, *self.known.own]) if self.known.own else unit
        self.known.own.pop(target, None)
        return Frame("replay", text=dumps(result(target)), binary=payload)

    def bye(self) -> Frame:
        return Frame("bye", text=dumps({"type": "bye"}))

    def abort(self) -> Frame:
        return Frame("abort")  # the runner drops the TCP connection without a close handshake


def _without(message: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
    copy = json.loads(json.dumps(message))
    target = copy
    for key in path[:-1]:
        target = target[key]
    target.pop(path[-1], None)
    return dict(copy)


def _randbytes(rng: random.Random) -> bytes:
    return rng.randbytes(rng.randint(1, 4096))


# --- poison tensors for one's own work unit -------------------------------------------------------


def _deep_header() -> bytes:
    return struct.pack("<Q", 200_000) + b"[" * 100_000 + b"]" * 100_000


def _zeros(shapes: dict[str, tuple[int, ...]], codec: str = "fp32") -> bytes:
    return codecs.encode({n: torch.zeros(s) for n, s in shapes.items()}, codec)


def _header(header: dict[str, Any], data: bytes = b"") -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


def _honest_message(unit: Assigned, **overrides: Any) -> dict[str, Any]:
    return result(unit.id, **{"model_version": unit.model_version, "samples": unit.samples, **overrides})


Poison = Callable[[Assigned, random.Random], tuple[dict[str, Any], bytes]]


def _filled(unit: Assigned, value: float) -> bytes:
    return codecs.encode({n: torch.full(s, value) for n, s in unit.shapes.items()}, "fp32")


def _topk_repeated(unit: Assigned) -> bytes:
    """A topk update whose offsets name one position over and over (parse refuses repeats)."""
    tensors = {n: torch.ones(s) for n, s in unit.shapes.items()}
    data = codecs.encode(tensors, "topk", 8, keep=2)
    header_size = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + header_size])
    body = bytearray(data[8 + header_size :])
    for name in unit.shapes:
        begin, end = header[name + codecs.INDEX_SUFFIX]["data_offsets"]
        body[begin:end] = bytes(end - begin)
    return data[: 8 + header_size] + bytes(body)


def _lowbit_claiming(codec: str) -> bytes:
    """A few bytes claiming a dense tensor of 10**12 elements (parse refuses before allocating)."""
    meta = {"codec": codec, "block_size": "32768", "keep": "1", "shape:w": "1000000,1000000"}
    entry = {"dtype": "I8", "shape": [1], "data_offsets": [0, 1]}
    return _header({"__metadata__": meta, "w": entry}, b"\1")


POISONS: list[tuple[str, Poison]] = [
    ("topk_repeated_offsets", lambda u, r: (_honest_message(u), _topk_repeated(u))),
    ("lowbit_huge_shape", lambda u, r: (_honest_message(u), _lowbit_claiming(r.choice(["int4", "topk"])))),
    ("deep_header", lambda u, r: (_honest_message(u), _deep_header())),
    ("nan", lambda u, r: (_honest_message(u), _filled(u, float("nan")))),
    ("inf", lambda u, r: (_honest_message(u), _filled(u, float("inf")))),
    ("huge_values", lambda u, r: (_honest_message(u), _filled(u, 3e38))),
    ("wrong_shape", lambda u, r: (_honest_message(u), _zeros({n: (*s, 2) for n, s in u.shapes.items()}))),
    ("missing_param", lambda u, r: (_honest_message(u), _zeros(dict(list(u.shapes.items())[1:])))),
    ("extra_param", lambda u, r: (_honest_message(u), _zeros({**u.shapes, "evil": (3,)}))),
    (
        "version_plus_999",
        lambda u, r: (_honest_message(u, model_version=u.model_version + 999), _zeros(u.shapes)),
    ),
    (
        "compute_ms_2**63-1",
        lambda u, r: (
            _honest_message(u, timings={"download_ms": 0, "compute_ms": 2**63 - 1}),
            _zeros(u.shapes),
        ),
    ),
    ("samples_2**31", lambda u, r: (_honest_message(u, samples=2**31), _zeros(u.shapes))),
    ("samples_lie", lambda u, r: (_honest_message(u, samples=u.samples * 1000), _zeros(u.shapes))),
    ("header_len_2**64-1", lambda u, r: (_honest_message(u), struct.pack("<Q", 2**64 - 1) + b"{}")),
    (
        "huge_declared_shape",
        lambda u, r: (
            _honest_message(u),
            _header({"w": {"dtype": "F32", "shape": [10**12, 10**12], "data_offsets": [0, 4]}}, b"\0" * 4),
        ),
    ),
    (
        "bad_dtype",
        lambda u, r: (
            _honest_message(u),
            _header({"w": {"dtype": "O", "shape": [1], "data_offsets": [0, 8]}}, b"\0" * 8),
        ),
    ),
    (
        "bad_block_size",
        lambda u, r: (
            _honest_message(u),
            _header(
                {"__metadata__": {"codec": "int8", "block_size": r.choice(["0", "-1", "1e9", "99999999999"])}}
            ),
        ),
    ),
    ("metadata_not_str", lambda u, r: (_honest_message(u), _header({"__metadata__": {"codec": ["fp32"]}}))),
    ("truncated", lambda u, r: (_honest_message(u), _zeros(u.shapes)[:-7])),
    ("garbage", lambda u, r: (_honest_message(u), _randbytes(r))),
]


# --- the runner -----------------------------------------------------------------------------------


@dataclass
class Failure:
    """A connection the server ended abnormally (close code, or None: no close at all)."""

    close_code: int | None
    what: str  # "crash 1011", "stall", "dropped", "handshake 500"
    frames: list[Frame]  # the last frames sent before it, oldest first
    culprit: Frame | None = None  # named by triage
    exception: str = ""  # what the server logged when the culprit was replayed alone

    @property
    def key(self) -> str:
        if self.culprit is None:
            return f"{self.what} (not reproduced by any of its last frames alone)"
        return f"{self.what}: {self.exception or self.culprit.kind}"

    def describe(self) -> str:
        lines = [f"{self.key} (close code {self.close_code})"]
        if self.culprit is not None:
            lines.append(f"  culprit, reproduced alone: {self.culprit.describe()}")
        else:
            lines += [f"  sent before it: {f.describe(120)}" for f in self.frames[-3:]]
        return "\n".join(lines)


@dataclass
class FuzzReport:
    frames: int = 0
    connections: int = 0
    bytes_sent: int = 0
    seconds: float = 0.0
    closes: Counter[str] = field(default_factory=Counter)  # close code (or "none") -> connections
    kinds: Counter[str] = field(default_factory=Counter)  # frame kind -> frames sent
    server_errors: Counter[str] = field(default_factory=Counter)  # `error` code -> frames received
    handshakes: Counter[int] = field(default_factory=Counter)  # HTTP status of a refused handshake
    failures: list[Failure] = field(default_factory=list)

    @property
    def crashes(self) -> int:
        return self.closes[str(CRASH)]

    @property
    def stalls(self) -> int:
        return sum(1 for f in self.failures if f.what == "stall")

    @property
    def server_500s(self) -> int:
        return sum(n for status, n in self.handshakes.items() if status >= 500)

    @property
    def frames_per_second(self) -> float:
        return self.frames / self.seconds if self.seconds else 0.0

    def distinct(self) -> dict[str, Failure]:
        found: dict[str, Failure] = {}
        for failure in self.failures:
            found.setdefault(failure.key, failure)
        return found

    def counts(self) -> Counter[str]:
        return Counter(failure.key for failure in self.failures)

    def summary(self) -> dict[str, Any]:
        return {
            "frames": self.frames,
            "connections": self.connections,
            "seconds": round(self.seconds, 1),
            "frames_per_second": round(self.frames_per_second, 1),
            "bytes_sent": self.bytes_sent,
            "crashes_1011": self.crashes,
            "stalls": self.stalls,
            "handshake_5xx": self.server_500s,
            "closes": dict(self.closes),
            "handshakes_refused": dict(self.handshakes),
            "server_errors": dict(self.server_errors),
            "kinds": dict(self.kinds),
            "distinct_failures": [f.describe() for f in self.distinct().values()][:MAX_REPORTED],
        }

    def render(self) -> str:
        head = (
            f"{self.frames} frames on {self.connections} connections in {self.seconds:.0f}s "
            f"({self.frames_per_second:.0f}/s); closes {dict(self.closes)}; crashes {self.crashes}, "
            f"stalls {self.stalls}, handshake 5xx {self.server_500s}"
        )
        counts = self.counts()
        failures = list(self.distinct().items())[:MAX_REPORTED]
        return "\n".join([head, *(f"- {counts[key]} x {f.describe()}" for key, f in failures)])


@dataclass
class Account:
    username: str
    cookie: str
    sim: Simulator  # its HTTP client downloads the weights of assigned work units


async def fuzz_account(url: str, username: str) -> Account:
    """Sign up (or log in) like any volunteer."""
    sim = Simulator(SimulatorConfig(url=url, username=username, password=PASSWORD, signup=True))
    await sim.authenticate()
    return Account(username, sim.http.cookie_header(), sim)


class Fuzzer:
    def __init__(
        self,
        url: str,
        accounts: list[Account],
        *,
        seed: int = 0,
        connections: int = 2,
        batch: tuple[int, int] = (1, 150),
        web_log: Path | None = None,
    ) -> None:
        self.url, self.accounts, self.seed, self.web_log = url.rstrip("/"), accounts, seed, web_log
        self.connections, self.batch = connections, batch
        self.report = FuzzReport()
        self.foreign: set[int] = set()
        self.shapes: dict[str, dict[str, tuple[int, ...]]] = {}  # weights URL -> param shapes
        self.budget = 0
        self.deadline = 0.0

    @property
    def ws_url(self) -> str:
        return self.url.replace("http", "ws", 1) + "/ws/volunteer/"

    def more(self) -> bool:
        return self.report.frames < self.budget and time.monotonic() < self.deadline

    async def run(self, *, frames: int, seconds: float = 3600) -> FuzzReport:
        self.budget, self.deadline = frames, time.monotonic() + seconds
        started = time.monotonic()
        loops = [
            self._loop(account, random.Random(f"{self.seed}-{account.username}-{i}"))
            for account in self.accounts
            for i in range(self.connections)
        ]
        await asyncio.gather(*loops)
        self.report.seconds = time.monotonic() - started
        return self.report

    async def _loop(self, account: Account, rng: random.Random) -> None:
        while self.more():
            if await self._connection(account, rng) == THROTTLED:
                await asyncio.sleep(rng.uniform(5, 15))  # as the server asks: reconnect later

    async def _connection(self, account: Account, rng: random.Random) -> int | None:
        """One connection's batch; the close code the server sent."""
        self.report.connections += 1
        try:
            async with connect(
                self.ws_url,
                additional_headers={"Cookie": account.cookie},
                origin=Origin(self.url),
                max_size=None,
                open_timeout=30,
                close_timeout=STALL_SECONDS,
                ping_interval=None,
            ) as ws:
                await _Connection(self, account, ws, rng).run()
            received = ws.protocol.close_rcvd
            return received.code if received is not None else None
        except InvalidStatus as exc:
            status = exc.response.status_code
            self.report.handshakes[status] += 1
            if status >= 500:
                self.report.failures.append(Failure(None, f"handshake {status}", []))
            await asyncio.sleep(rng.uniform(0.5, 2))  # refused (throttled?): back off like a browser
        except (OSError, TimeoutError) as exc:
            self.report.failures.append(Failure(None, f"connect failed: {exc!r}"[:120], []))
            await asyncio.sleep(1)
        return None

    async def shapes_of(self, account: Account, weights_url: str) -> dict[str, tuple[int, ...]]:
        if weights_url not in self.shapes:
            tensors = codecs.decode(await account.sim.download(weights_url))[0]
            self.shapes[weights_url] = {n: tuple(t.shape) for n, t in tensors.items()}
        return self.shapes[weights_url]

    # --- triage

    async def triage(self, account: Account, seconds: float = TRIAGE_SECONDS) -> None:
        """Replay each failure's last frames alone (hello, frame, bye), oldest first, to name the culprit
        and the exception the server logged for it. Frames already replayed are not replayed again."""
        deadline, verdicts = time.monotonic() + seconds, {}
        for failure in self.report.failures:
            if failure.what not in ("crash 1011", "stall"):
                continue
            for frame in failure.frames:
                if time.monotonic() > deadline:
                    return
                if frame.kind != "abort" and frame not in verdicts:
                    verdicts[frame] = await self._replay(account, frame)
                code, exception = verdicts.get(frame, (None, ""))
                if code == failure.close_code or (failure.what == "stall" and code is None):
                    failure.culprit, failure.exception = frame, exception
                    break

    async def _replay(self, account: Account, frame: Frame) -> tuple[int | None, str]:
        offset = self.web_log.stat().st_size if self.web_log else 0
        code = await self.probe(account, frame)
        if self.web_log is None:
            return code, ""
        with self.web_log.open("rb") as log:
            log.seek(offset)
            logged = log.read().decode(errors="replace")
        return code, " / ".join(tracebacks(logged))[:300]

    async def probe(self, account: Account, frame: Frame) -> int | None:
        with contextlib.suppress(OSError, TimeoutError, InvalidStatus, ConnectionClosed):
            async with connect(
                self.ws_url,
                additional_headers={"Cookie": account.cookie},
                origin=Origin(self.url),
                max_size=None,
                ping_interval=None,
            ) as ws:
                await ws.send(dumps(hello()))
                await _send_frame(ws, frame)
                await ws.send(dumps({"type": "bye"}))
                await asyncio.wait_for(_drain(ws), STALL_SECONDS)
            return ws.close_code
        return None


async def _send_frame(ws: ClientConnection, frame: Frame) -> int:
    sent = 0
    if frame.text is not None:
        await ws.send(frame.text)
        sent += len(frame.text)
    if frame.binary is not None:
        await ws.send(frame.binary)
        sent += len(frame.binary)
    return sent


async def _drain(ws: ClientConnection) -> None:
    with contextlib.suppress(ConnectionClosed):
        async for _ in ws:
            pass


class _Connection:
    """One fuzz connection: hello, perhaps a work unit of its own, a batch of frames, bye, the close."""

    def __init__(self, fuzzer: Fuzzer, account: Account, ws: ClientConnection, rng: random.Random) -> None:
        self.fuzzer, self.account, self.ws, self.rng = fuzzer, account, ws, rng
        self.report = fuzzer.report
        self.known = Knowledge(foreign=fuzzer.foreign)
        self.frames = Frames(rng, self.known)
        self.history: deque[Frame] = deque(maxlen=HISTORY)
        self.assigned = asyncio.Event()
        self.aborted = self.stalled = False

    async def run(self) -> None:
        reader = asyncio.create_task(self._read())
        try:
            await self.ws.send(dumps(hello()))
            if self.rng.random() < 0.5:
                await self._take_work()
            await self._batch()
            await self._finish(reader)
        except ConnectionClosed:
            await self._wait_for(reader)
        finally:
            reader.cancel()
        self._judge_close()

    async def _take_work(self) -> None:
        """Hold a work unit so that poison can be aimed at one's own (its weights tell the shapes)."""
        await self.ws.send(dumps({"type": "ready"}))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.assigned.wait(), 3)

    async def _batch(self) -> None:
        for _ in range(self.rng.randint(*self.fuzzer.batch)):
            if not self.fuzzer.more():
                return
            frame = self.frames.next()
            self.history.append(frame)
            if frame.kind == "abort":
                self.aborted = True
                self.ws.transport.abort()
                return
            self.report.bytes_sent += await _send_frame(self.ws, frame)
            self.report.frames += 1  # counted once written: a closed socket refuses the rest
            self.report.kinds[frame.kind.split(":")[0]] += 1
            if frame.kind == "bye":
                return

    async def _finish(self, reader: asyncio.Task[None]) -> None:
        if self.aborted:
            return
        with contextlib.suppress(ConnectionClosed):
            await self.ws.send(dumps({"type": "bye"}))
        await self._wait_for(reader)

    async def _wait_for(self, reader: asyncio.Task[None]) -> None:
        """The server closes after `bye` (or after a crash); not closing at all is a stall."""
        done, _ = await asyncio.wait([reader], timeout=STALL_SECONDS)
        self.stalled = not done

    def _judge_close(self) -> None:
        received = self.ws.protocol.close_rcvd
        code = received.code if received is not None else None
        self.report.closes[str(code) if code is not None else ("aborted" if self.aborted else "none")] += 1
        if code == CRASH:
            self.report.failures.append(Failure(code, "crash 1011", list(self.history)))
        elif self.stalled or (code is None and not self.aborted):
            what = "stall" if self.stalled else "dropped"
            self.report.failures.append(Failure(code, what, list(self.history)))

    async def _read(self) -> None:
        with contextlib.suppress(ConnectionClosed):
            async for raw in self.ws:
                if isinstance(raw, str):
                    await self._on_message(raw)

    async def _on_message(self, raw: str) -> None:
        message = json.loads(raw)
        kind = message.get("type")
        if kind == "error":
            self.report.server_errors[str(message.get("code"))] += 1
        elif kind == "assign":
            await self._on_assign(message["work_unit"])

    async def _on_assign(self, raw: dict[str, Any]) -> None:
        shapes = await self.fuzzer.shapes_of(self.account, raw["weights_url"])
        samples = sum(int(s["count"]) for s in raw["shards"])
        unit = Assigned(int(raw["id"]), int(raw["model_version"]), samples, str(raw.get("codec")), shapes)
        self.known.own[unit.id] = unit
        self.fuzzer.foreign.add(unit.id)  # every other connection sees it as somebody else's
        self.assigned.set()


# --- what the process logs and the database must say afterwards -----------------------------------

TRACEBACK = re.compile(r"^Traceback \(most recent call last\):\n(?:[ \t].*\n|\n)*(.+)$", re.MULTILINE)


def tracebacks(log: str) -> dict[str, tuple[int, str]]:
    """Distinct tracebacks in a process log: final line -> (how many, an excerpt of the first)."""
    found: dict[str, tuple[int, str]] = {}
    for match in TRACEBACK.finditer(log):
        last = match.group(1).strip()[:200]
        count, excerpt = found.get(last, (0, "\n".join(match.group(0).splitlines()[-6:])))
        found[last] = (count + 1, excerpt)
    return found


INTERNAL_ERROR = re.compile(r"Internal Server Error: (\S+)|\" 5\d\d \d+|HTTP \S+ \S+ 5\d\d")


def server_errors_in(log: str) -> list[str]:
    """HTTP 500s a process logged (Django's "Internal Server Error", access-log lines with 5xx)."""
    return [m.group(0) for m in INTERNAL_ERROR.finditer(log)]


def scalar(database_url: str, sql: str, *params: Any) -> Any:
    with psycopg.connect(database_url) as conn:
        row = conn.execute(sql, params).fetchone()
    return row[0] if row else None


def round_state(database_url: str) -> list[tuple[Any, ...]]:
    """The newest version's work units and their results: (unit status, wanted, result status, validation,
    volunteer, how many)."""
    sql = (
        "SELECT w.status, w.wanted, r.status, r.validation, u.username, count(*) FROM projects_workunit w "
        "LEFT JOIN projects_result r ON r.work_unit_id = w.id LEFT JOIN auth_user u ON u.id = r.volunteer_id "
        "WHERE w.version_id = (SELECT max(id) FROM projects_modelversion) GROUP BY 1, 2, 3, 4, 5 "
        "ORDER BY 1, 2"
    )
    with psycopg.connect(database_url) as conn:
        return [tuple(row) for row in conn.execute(sql).fetchall()]


def latest_version(database_url: str) -> int:
    return int(scalar(database_url, "SELECT coalesce(max(number), 0) FROM projects_modelversion"))


def invariants(database_url: str, *, fuzz_prefix: str, give_up_seconds: float) -> list[str]:
    """The books after a fuzz: each broken invariant as a sentence (empty when all hold)."""
    checks: list[tuple[Any, ...]] = [
        (
            "results received but never judged for longer than the give-up bound",
            "SELECT count(*) FROM projects_result WHERE status = 'received' AND validation = 'pending' "
            "AND received_at < now() - make_interval(secs => %s)",
            give_up_seconds,
        ),
        (
            "ledger total differs from validated FLOPs (samples x flops_per_sample of valid results)",
            "SELECT (SELECT coalesce(sum(flops), 0) FROM workers_creditentry) - "
            "(SELECT coalesce(sum(r.samples * p.flops_per_sample), 0) FROM projects_result r "
            "JOIN projects_workunit w ON w.id = r.work_unit_id "
            "JOIN projects_project p ON p.id = w.project_id WHERE r.validation = 'valid')",
        ),
        (
            "volunteers whose total_flops differs from their ledger",
            "SELECT count(*) FROM workers_volunteer v WHERE v.total_flops <> "
            "(SELECT coalesce(sum(c.flops), 0) FROM workers_creditentry c WHERE c.volunteer_id = v.id)",
        ),
        (
            "FLOPs credited to fuzz accounts",
            "SELECT coalesce(sum(c.flops), 0) FROM workers_creditentry c JOIN workers_volunteer v "
            "ON v.id = c.volunteer_id JOIN auth_user u ON u.id = v.user_id WHERE u.username LIKE %s",
            fuzz_prefix + "%",
        ),
        (
            "valid results of fuzz accounts",
            "SELECT count(*) FROM projects_result r JOIN auth_user u ON u.id = r.volunteer_id "
            "WHERE u.username LIKE %s AND r.validation = 'valid'",
            fuzz_prefix + "%",
        ),
        (
            "results aggregated that are not valid",
            "SELECT count(*) FROM projects_result WHERE aggregated AND validation <> 'valid'",
        ),
    ]
    broken = []
    for sentence, sql, *params in checks:
        value = scalar(database_url, sql, *params)
        if value:
            broken.append(f"{sentence}: {value}")
    return broken


# --- a campaign: the fuzz while honest volunteers train ---------------------------------------------

HONEST_PASSWORD = "honest-volunteer-pass-2468"
FIRST_VERSION_SECONDS = 180.0  # the honest volunteers' first published version, from a cold stack
AFTER_SECONDS = 120.0  # after the fuzz, a new version must come within this


@dataclass
class Campaign:
    report: FuzzReport
    versions: dict[str, int] = field(default_factory=dict)  # "start", "fuzz_start", "fuzz_end", "after"
    version_times: list[float] = field(default_factory=list)  # monotonic time of each new version seen
    honest: list[Any] = field(default_factory=list)  # SimulatorStats, or the exception that ended one
    fuzz_window: tuple[float, float] = (0.0, 0.0)

    def longest_gap(self) -> float:
        """Longest time without a new version during the fuzz (the fuzz window's ends count)."""
        start, end = self.fuzz_window
        times = [start, *(t for t in self.version_times if start < t < end), end]
        return max(b - a for a, b in zip(times, times[1:], strict=False))

    def problems(self, logs: dict[str, str], database_url: str, *, give_up_seconds: float) -> list[str]:
        found = [f"{n} connection(s) ended in {key}" for key, n in self.report.counts().most_common()]
        for name, log in logs.items():
            for last, (count, excerpt) in tracebacks(log).items():
                found.append(f"{count} traceback(s) in {name}.log ending {last!r}:\n{excerpt}")
            found += [f"HTTP 5xx in {name}.log: {line}" for line in server_errors_in(log)[:5]]
        found += invariants(database_url, fuzz_prefix="fuzz-", give_up_seconds=give_up_seconds)
        training = self._training_problems()
        if training:  # what the stalled round looked like, for whoever reads the failure
            training.append(f"the newest round: {round_state(database_url)}; honest: {self.honest}")
        return found + training

    def _training_problems(self) -> list[str]:
        found = []
        v = self.versions
        if v.get("fuzz_end", 0) <= v.get("fuzz_start", 0):
            found.append(f"no model version was published during the fuzz: {v}")
        if v.get("after", 0) <= v.get("fuzz_end", 0):
            found.append(f"no model version was published within {AFTER_SECONDS:.0f}s after the fuzz: {v}")
        for stats in self.honest:
            if isinstance(stats, BaseException):
                found.append(f"an honest volunteer gave up: {stats!r}")
            elif stats.invalid:
                found.append(f"honest {stats.username} had {stats.invalid} invalid results: {stats.reasons}")
        return found


async def version_after(database_url: str, version: int, timeout: float, seen: list[float]) -> int:
    """Poll until a version newer than `version` is published (or the timeout); the newest seen."""
    deadline = time.monotonic() + timeout
    latest = version
    while latest <= version and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
        latest = await asyncio.to_thread(latest_version, database_url)
    if latest > version:
        seen.append(time.monotonic())
    return latest


async def watch_versions(database_url: str, seen: list[float], stop: asyncio.Event) -> None:
    latest = await asyncio.to_thread(latest_version, database_url)
    while not stop.is_set():
        latest = await version_after(database_url, latest, 5.0, seen)


async def campaign(
    url: str,
    database_url: str,
    *,
    frames: int,
    seconds: float = 3600,
    accounts: int = 3,
    honest: int = 2,
    seed: int = 0,
    connections: int = 2,
    web_log: Path | None = None,
) -> Campaign:
    """Honest volunteers train; once a version is out the fuzz accounts fuzz; then training must go on."""
    sims = [Simulator(_volunteer(url, f"honest-{i}")) for i in range(honest)]
    tasks = [asyncio.create_task(sim.run()) for sim in sims]
    fuzz_accounts = [await fuzz_account(url, f"fuzz-{i}") for i in range(accounts)]
    fuzzer = Fuzzer(url, fuzz_accounts, seed=seed, connections=connections, web_log=web_log)
    outcome = Campaign(fuzzer.report)
    outcome.versions["start"] = await version_after(database_url, 0, FIRST_VERSION_SECONDS, [])
    stop = asyncio.Event()
    watcher = asyncio.create_task(watch_versions(database_url, outcome.version_times, stop))
    outcome.versions["fuzz_start"] = await asyncio.to_thread(latest_version, database_url)
    started = time.monotonic()
    await fuzzer.run(frames=frames, seconds=seconds)
    outcome.fuzz_window = (started, time.monotonic())
    outcome.versions["fuzz_end"] = await asyncio.to_thread(latest_version, database_url)
    stop.set()
    await watcher
    await fuzzer.triage(fuzz_accounts[0])
    outcome.versions["after"] = await version_after(
        database_url, outcome.versions["fuzz_end"], AFTER_SECONDS, []
    )
    outcome.honest = await _stop_all(sims, tasks)
    return outcome


async def _stop_all(sims: list[Simulator], tasks: list[asyncio.Task[Any]]) -> list[Any]:
    for sim in sims:
        sim.stop()
    done = await asyncio.gather(*(asyncio.wait_for(t, 60) for t in tasks), return_exceptions=True)
    return list(done)


def peak_rss_mb(pid: int) -> float:
    """A process's peak resident memory (VmHWM), in MiB."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


# --- hostile volunteers: a share of the crowd sends poison for its own work units -------------------


@dataclass
class Phase:
    """One stretch of training: honest volunteers each doing `work_units`, attackers alongside."""

    label: str
    work_units: int
    versions: int = 0  # model versions published during the phase
    seconds: float = 0.0
    honest: list[Any] = field(default_factory=list)  # SimulatorStats, or the exception that ended one
    attackers: list[Any] = field(default_factory=list)

    def honest_stats(self) -> list[Any]:
        return [s for s in self.honest if not isinstance(s, BaseException)]

    @property
    def honest_results(self) -> int:
        return sum(s.work_units for s in self.honest_stats())

    @property
    def completed(self) -> bool:
        """Every honest volunteer did all its work units: training never stalled for the phase's cap."""
        stats = self.honest_stats()
        return len(stats) == len(self.honest) and all(s.work_units >= self.work_units for s in stats)

    @property
    def versions_per_honest_result(self) -> float:
        return self.versions / self.honest_results if self.honest_results else 0.0

    @property
    def versions_per_minute(self) -> float:
        return 60 * self.versions / self.seconds if self.seconds else 0.0

    def summary(self) -> dict[str, Any]:
        def total(stat: str) -> int:
            return sum(int(getattr(s, stat)) for s in self.honest_stats())

        return {
            "label": self.label,
            "versions": self.versions,
            "seconds": round(self.seconds, 1),
            "versions_per_minute": round(self.versions_per_minute, 2),
            "versions_per_honest_result": round(self.versions_per_honest_result, 3),
            "honest_results": self.honest_results,
            "honest_valid": total("valid"),
            "honest_invalid": total("invalid"),
            "honest_late": total("late"),
            "completed": self.completed,
            "attackers": [_describe(a) for a in self.attackers],
        }


def _describe(stats: Any) -> dict[str, Any] | str:
    if isinstance(stats, BaseException):
        return repr(stats)
    return {
        "username": stats.username,
        "results": stats.work_units,
        "valid": stats.valid,
        "invalid": stats.invalid,
        "late": stats.late,
        "unanswered": stats.unanswered,
        "errors": stats.errors,
        "reconnects": stats.reconnects,
        "credit_flops": stats.credit_flops,
    }


async def hostile_phase(
    url: str,
    database_url: str,
    *,
    label: str,
    honest: int,
    attackers: int,
    work_units: int,
    cap_seconds: float,
) -> Phase:
    """Run honest volunteers to `work_units` each (or the cap) with poisoning attackers alongside."""
    phase = Phase(label, work_units)
    honest_sims = [
        Simulator(_volunteer(url, f"{label}-honest-{i}", max_work_units=work_units)) for i in range(honest)
    ]
    attacker_sims = [
        Simulator(_volunteer(url, f"{label}-attacker-{i}", byzantine="poison")) for i in range(attackers)
    ]
    before, started = await asyncio.to_thread(latest_version, database_url), time.monotonic()
    honest_tasks = [asyncio.create_task(s.run()) for s in honest_sims]
    attacker_tasks = [asyncio.create_task(s.run()) for s in attacker_sims]
    await asyncio.wait(honest_tasks, timeout=cap_seconds)
    phase.honest = await _stop_all(honest_sims, honest_tasks)
    phase.seconds = time.monotonic() - started
    phase.versions = await asyncio.to_thread(latest_version, database_url) - before
    phase.attackers = await _stop_all(attacker_sims, attacker_tasks)
    return phase


def _volunteer(url: str, name: str, **overrides: Any) -> SimulatorConfig:
    return SimulatorConfig(
        url=url,
        username=name,
        password=HONEST_PASSWORD,
        signup=True,
        gflops=50,
        bandwidth_mbit=200,
        latency_ms=5,
        verdict_timeout_s=10,
        seed=len(name),
        **overrides,
    )


def earned(database_url: str, prefix: str) -> tuple[int, int]:
    """FLOPs credited to and valid results of the accounts whose names start with `prefix`."""
    pattern = prefix + "%"
    flops = scalar(
        database_url,
        "SELECT coalesce(sum(c.flops), 0) FROM workers_creditentry c "
        "JOIN workers_volunteer v ON v.id = c.volunteer_id "
        "JOIN auth_user u ON u.id = v.user_id WHERE u.username LIKE %s",
        pattern,
    )
    valid = scalar(
        database_url,
        "SELECT count(*) FROM projects_result r JOIN auth_user u ON "
        "u.id = r.volunteer_id WHERE u.username LIKE %s AND r.validation = 'valid'",
        pattern,
    )
    return int(flops), int(valid)
