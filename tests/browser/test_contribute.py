"""The Contribute page (real template markup + contribute.js + worker.js) against a scripted fake
volunteer server that speaks docs/protocol.md: hello, assign, prefetching `ready`, result + binary frame,
ack (pending), credit (the verdict), cancel of a prefetched unit, idle, bye."""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.browser.pages import contribute_html

pytestmark = [pytest.mark.browser, pytest.mark.slow]
codecs = pytest.importorskip("engine.codecs")
presets = pytest.importorskip("engine.presets")
runtime = pytest.importorskip("engine.runtime")
ws_server = pytest.importorskip("websockets.sync.server")

CREDIT = 123_456_789


def page_from_template(socket_url: str) -> str:
    return contribute_html(socket_url)


class FakeServer:
    """Assigns unit 1; the prefetching `ready` gets unit 2, cancelled at once; the next gets unit 3; then
    idle. Acks are `pending`; the verdict follows as `credit`: unit 1 valid, unit 3 invalid. Refuses a
    `ready` with 2 units in flight (`busy`), like workers/consumers.py, and records that it had to."""

    MAX_IN_FLIGHT = 2

    def __init__(self, assign: dict[str, Any]) -> None:
        self.assign, self.assigned = assign, 0
        self.frames: list[tuple[str, Any]] = []
        self.in_flight: set[int] = set()
        self.reference: dict[str, Any] = {}  # what an honest volunteer sends (set by the fixture)
        self.busy = 0
        self.result_for: int | None = None  # the unit whose binary frame comes next
        self.server = ws_server.serve(self.handle, "127.0.0.1", 0)
        self.url = f"ws://127.0.0.1:{self.server.socket.getsockname()[1]}/ws/volunteer/"

    def handle(self, ws: Any) -> None:
        for frame in ws:
            if isinstance(frame, bytes):
                self.frames.append(("binary", frame))
                self.on_tensors(ws)
                continue
            msg = json.loads(frame)
            self.frames.append(("json", msg))
            if msg["type"] == "hello":
                ws.send(
                    json.dumps(
                        {
                            "type": "welcome",
                            "protocol": 1,
                            "volunteer": {"username": "alice", "credit_flops": 1000},
                        }
                    )
                )
            elif msg["type"] == "ready":
                self.on_ready(ws)
            elif msg["type"] == "result":
                self.result_for = msg["work_unit"]

    def on_ready(self, ws: Any) -> None:
        if len(self.in_flight) >= self.MAX_IN_FLIGHT:
            self.busy += 1
            ws.send(json.dumps({"type": "error", "code": "busy", "message": "at most 2 at a time"}))
            return
        self.assigned += 1
        if self.assigned > 3:
            ws.send(json.dumps({"type": "idle"}))
            return
        unit = self.assigned
        self.in_flight.add(unit)
        ws.send(json.dumps({"type": "assign", "work_unit": {**self.assign, "id": unit}}))
        if unit == 2:  # the prefetched unit is dropped before the worker gets to it
            self.in_flight.discard(unit)
            ws.send(json.dumps({"type": "cancel", "work_units": [unit], "reason": "round closed"}))

    def on_tensors(self, ws: Any) -> None:
        unit, self.result_for = self.result_for, None
        self.in_flight.discard(unit)
        ws.send(
            json.dumps(
                {
                    "type": "ack",
                    "work_unit": unit,
                    "accepted": True,
                    "status": "pending",
                    "reason": "",
                    "credit_flops": 0,
                    "total_credit_flops": 1000,
                }
            )
        )
        valid = unit == 1
        ws.send(
            json.dumps(
                {
                    "type": "credit",
                    "work_unit": unit,
                    "status": "valid" if valid else "invalid",
                    "reason": "" if valid else "differs from the server's recomputation by 80%",
                    "credit_flops": CREDIT if valid else 0,
                    "total_credit_flops": 1000 + CREDIT,
                }
            )
        )

    def json_types(self) -> list[str]:
        return [m["type"] if kind == "json" else "<binary>" for kind, m in self.frames]

    def results(self) -> list[tuple[dict[str, Any], bytes]]:
        """(result message, the binary frame right after it) pairs, in order."""
        return [
            (m, self.frames[i + 1][1])
            for i, (kind, m) in enumerate(self.frames)
            if kind == "json" and m["type"] == "result"
        ]


@pytest.fixture
def fake_server(static_server: Any) -> Iterator[FakeServer]:
    g, weights = presets.export_preset("mlp", seed=0)
    torch = pytest.importorskip("torch")
    x, y = torch.rand(40, 1, 28, 28), torch.randint(0, 10, (40,), dtype=torch.int32)
    put = lambda data: static_server.put_blob(hashlib.sha256(data).hexdigest(), data)  # noqa: E731
    assign = {
        "project": {"id": 4, "name": "Digits MLP"},
        "model_version": 1,
        "task": "local_steps",
        "local": {"optimizer": "sgd", "lr": 0.05, "momentum": 0.9},
        "graph_url": put(json.dumps(g).encode()),
        "weights_url": put(codecs.encode(weights)),
        "shards": [{"url": put(codecs.encode({"x": x, "y": y})), "offset": 0, "count": 40}],
        "batch_size": 16,
        "deadline": "2030-01-01T00:00:00Z",
        "codec": "int8",
    }
    server = FakeServer(assign)
    server.reference = runtime.local_steps(
        g, weights, {"x": x}, {"y": y}, batch_size=16, lr=0.05, momentum=0.9
    ).delta
    thread = threading.Thread(target=server.server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.server.shutdown()


def rel_l2(got: dict[str, Any], want: dict[str, Any]) -> float:
    diff = sum(float(((got[k] - want[k]) ** 2).sum()) for k in want)
    return (diff / sum(float((want[k] ** 2).sum()) for k in want)) ** 0.5


def wait_for(condition: Any, timeout: float = 30) -> None:
    """Poll `condition` until it holds: the page talks to the fake server on its own schedule."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_contribute_page_runs_the_protocol(browser: Any, static_server: Any, fake_server: FakeServer) -> None:
    static_server.put_blob("contribute.html", page_from_template(fake_server.url).encode())
    context = browser.new_context()
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(f"{static_server.url}/blobs/contribute.html")
    assert page.is_disabled("#stop")
    started = time.monotonic()
    page.click("#contribute")
    page.wait_for_function(
        "() => document.getElementById('work-units-done').textContent === '2'", timeout=120_000
    )
    page.wait_for_function("() => /invalid/.test(document.getElementById('log').textContent)")
    page.wait_for_function("() => /Waiting for work/.test(document.getElementById('status').textContent)")
    elapsed = time.monotonic() - started

    assert page.get_attribute("#credit", "data-flops") == str(1000 + CREDIT)  # from the `credit` verdict
    assert page.text_content("#credit") == "123 MFLOP"
    assert page.get_attribute("#credit-today", "data-flops") == str(CREDIT)  # only the valid verdict's
    assert page.title() == "⏸ Paused (no work) — Crowdtrain"  # `idle`: no work for this volunteer
    log = page.text_content("#log")
    assert "work unit 1 validated: +123 MFLOP" in log and "work unit 3 invalid: differs" in log
    assert page.text_content("#backend").startswith("webgl")
    assert page.text_content("#project") == "Digits MLP"
    assert float(page.text_content("#samples-per-second")) > 0
    share = re.fullmatch(r"(\d+) %", page.text_content("#compute-share"))
    assert share and 0 < int(share.group(1)) <= 100, page.text_content("#compute-share")
    # Nothing more is asked for while idle: the fourth `ready` (after result 3) is the last before `bye`.
    wait_for(lambda: fake_server.json_types().count("ready") == 4)
    page.click("#stop")
    page.wait_for_function("() => !document.getElementById('contribute').disabled")
    wait_for(lambda: "bye" in fake_server.json_types())
    context.close()

    types = fake_server.json_types()
    hello = fake_server.frames[0][1]
    assert hello["protocol"] == 1 and hello["device"]["backend"] == "webgl" and hello["device"]["gflops"] > 0
    assert types[:3] == ["hello", "ready", "ready"]  # the second one prefetches while unit 1 computes
    assert fake_server.busy == 0  # never more than 2 units in flight
    results = fake_server.results()
    assert [m["work_unit"] for m, _ in results] == [1, 3]  # cancelled prefetched unit 2: no result
    params = {p["name"] for p in presets.export_preset("mlp")[0]["params"]}
    for msg, binary in results:
        assert msg["samples"] == 40 and msg["model_version"] == 1
        update, meta = codecs.decode(binary)
        assert meta["codec"] == "int8" and set(update) == params
        assert rel_l2(update, fake_server.reference) <= 0.25  # projects/validation.py TOLERANCE["int8"]
    assert types.index("result") > 2  # ...so unit 2 was assigned before unit 1 finished
    assert types.count("ready") == 4 and types[-1] == "bye"  # 1, prefetch, after cancel, after result 1
    assert not errors, errors
    print(f"contribute flow: {elapsed:.1f} s from click to both verdicts")


class AdmittingServer:
    """A restart, then a server busy admitting others: connection 1 assigns unit 1 and drops (1012);
    connection 2's handshake completes only once the page has computed unit 1 (its result waits to be
    sent), and it is closed at once with 4503 without reading anything, as config/admission.py does;
    connection 3 welcomes the page and should receive the result."""

    def __init__(self, assign: dict[str, Any]) -> None:
        self.assign, self.connections = assign, 0
        self.computed = threading.Event()  # set by the test when the page logs unit 1's result
        self.results_on: list[int] = []  # the connection each result arrived on
        self.opened: dict[int, float] = {}  # each connection's time.monotonic() at its handshake
        self.server = ws_server.serve(self.handle, "127.0.0.1", 0, process_request=self.admit)
        self.url = f"ws://127.0.0.1:{self.server.socket.getsockname()[1]}/ws/volunteer/"

    def admit(self, connection: Any, request: Any) -> None:
        if self.connections == 1:
            self.computed.wait(120)

    def handle(self, ws: Any) -> None:
        self.connections += 1
        number = self.connections
        self.opened[number] = time.monotonic()
        if number == 2:
            ws.close(4503, "try again later")
            return
        for frame in ws:
            msg = json.loads(frame) if isinstance(frame, str) else {"type": "<binary>"}
            if msg["type"] == "hello":
                ws.send(json.dumps({"type": "welcome", "protocol": 1, "volunteer": {"username": "alice"}}))
            elif msg["type"] == "ready" and number == 1:
                ws.send(json.dumps({"type": "assign", "work_unit": {**self.assign, "id": 1}}))
                ws.close(1012, "restart")
                return
            elif msg["type"] == "ready":
                ws.send(json.dumps({"type": "idle"}))
            elif msg["type"] == "result":
                self.results_on.append(number)


def test_a_result_computed_while_away_survives_a_retry_later_close(
    browser: Any, static_server: Any, fake_server: FakeServer
) -> None:
    """Sent only after the welcome: on connection 2 (closed with 4503 unread) it would have been lost."""
    server = AdmittingServer(fake_server.assign)
    threading.Thread(target=server.server.serve_forever, daemon=True).start()
    static_server.put_blob("contribute.html", page_from_template(server.url).encode())
    context = browser.new_context()
    page = context.new_page()
    try:
        page.goto(f"{static_server.url}/blobs/contribute.html")
        page.click("#contribute")
        computed = "() => /work unit 1: 40 samples/.test(document.getElementById('log').textContent)"
        page.wait_for_function(computed, timeout=120_000)
        server.computed.set()
        wait_for(lambda: server.results_on == [3], timeout=60)
        assert server.connections == 3
        # backoff.js's floor after 4503: a client told to come back later does not come back at once.
        assert server.opened[3] - server.opened[2] >= 4.9
    finally:
        server.computed.set()
        context.close()
        server.server.shutdown()


# --- pipeline stage units: no loss where none is computed; the recent average from the server -----------

RECENT = {1: 0.000116, 2: 1234.5678}  # the server's recent average after each unit's verdict


class StageServer:
    """Gives out a stage-0 forward unit (no loss) and a last-stage backward unit (the loss) of a pipeline
    project at once, then `idle`; each result is acked and credited with the recent average RECENT says."""

    def __init__(self, assigns: list[dict[str, Any]]) -> None:
        self.assigns = list(assigns)
        self.losses: list[float | None] = []  # as each result message said
        self.server = ws_server.serve(self.handle, "127.0.0.1", 0)
        self.url = f"ws://127.0.0.1:{self.server.socket.getsockname()[1]}/ws/volunteer/"

    def handle(self, ws: Any) -> None:
        for frame in ws:
            msg: dict[str, Any] = json.loads(frame) if isinstance(frame, str) else {"type": "<binary>"}
            if msg["type"] == "hello":
                volunteer = {"username": "alice", "credit_flops": 0, "recent_credit": 0.0}
                ws.send(json.dumps({"type": "welcome", "protocol": 1, "volunteer": volunteer}))
            elif msg["type"] == "ready":
                unit = self.assigns.pop(0) if self.assigns else None
                ws.send(json.dumps({"type": "assign", "work_unit": unit} if unit else {"type": "idle"}))
            elif msg["type"] == "result":
                self.losses.append(msg["loss"])
            elif msg["type"] == "<binary>":
                self.credit(ws, unit=len(self.losses))  # the units are computed in the order given

    def credit(self, ws: Any, *, unit: int) -> None:
        verdict = {
            "work_unit": unit,
            "reason": "",
            "total_credit_flops": unit * CREDIT,
            "recent_credit": RECENT[unit],
        }
        ws.send(
            json.dumps({"type": "ack", "accepted": True, "status": "pending", "credit_flops": 0, **verdict})
        )
        ws.send(json.dumps({"type": "credit", "status": "valid", "credit_flops": CREDIT, **verdict}))


def test_stage_units_log_no_loss_and_the_recent_average_follows_the_verdicts(
    browser: Any, static_server: Any
) -> None:
    from frontend.templatetags.crowdtrain import format_credit
    from tests.browser.test_worker import server_units, stage_assign

    work = server_units(static_server, *presets.export_preset("mlp", seed=0))
    forward = stage_assign(work, 1, 0, "forward")
    backward = stage_assign(work, 2, 2, "backward", input_url=work["urls"]["out1"])
    server = StageServer([forward, backward])
    threading.Thread(target=server.server.serve_forever, daemon=True).start()
    static_server.put_blob("contribute-stages.html", page_from_template(server.url).encode())
    context = browser.new_context()
    page = context.new_page()
    try:
        page.goto(f"{static_server.url}/blobs/contribute-stages.html")
        before = page.text_content("#recent-average")
        started = time.monotonic()
        page.click("#contribute")
        page.wait_for_function(
            "() => /work unit 2 validated/.test(document.getElementById('log').textContent)",
            timeout=120_000,
        )
        elapsed = time.monotonic() - started
        log = page.text_content("#log") or ""
        assert "work unit 1: 8 samples, loss —," in log and "loss 0.0000" not in log, log
        assert re.search(r"work unit 2: 8 samples, loss \d+\.\d{4},", log), log
        assert server.losses[0] is None and isinstance(server.losses[1], float)
        assert before == "0 credit/day"
        assert (
            page.text_content("#recent-average")
            == f"{format_credit(RECENT[2])} credit/day"
            == "1,235 credit/day"
        )
    finally:
        context.close()
        server.server.shutdown()
    print(f"stage units: {elapsed:.1f} s from click to the second verdict")
