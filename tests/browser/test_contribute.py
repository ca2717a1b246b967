"""The Contribute page (real template markup + contribute.js + worker.js) against a scripted fake
volunteer server that speaks docs/protocol.md: hello, assign, result + binary frame, ack, cancel,
idle, bye."""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.browser, pytest.mark.slow]
codecs = pytest.importorskip("engine.codecs")
presets = pytest.importorskip("engine.presets")
ws_server = pytest.importorskip("websockets.sync.server")

TEMPLATE = Path(__file__).resolve().parents[2] / "frontend" / "templates" / "frontend" / "contribute.html"
CREDIT = 123_456_789


def page_from_template(socket_url: str) -> str:
    """The template's content and scripts blocks with Django tags replaced by what they render to."""
    text = TEMPLATE.read_text()
    block = lambda name: re.search(r"{% block " + name + r" %}(.*?){% endblock %}", text, re.S).group(1)  # noqa: E731
    html = block("content") + block("scripts")
    html = re.sub(r"{% static '([^']+)' %}", r"/static/\1", html)
    html = html.replace("{{ volunteer.total_flops|default:0 }}", "0")
    html = html.replace("{{ volunteer.total_flops|flops }}", "0 FLOP")
    html = html.replace('data-socket-path="/ws/volunteer/"', f'data-socket-url="{socket_url}"')
    assert "{%" not in html and "{{" not in html
    head = '<link rel="stylesheet" href="/static/frontend/site.css">'
    return f"<!doctype html><html><head>{head}</head><body>{html}</body></html>"


class FakeServer:
    """Assigns work unit 1, then work unit 2 and cancels it at once, then says idle."""

    def __init__(self, assign: dict[str, Any]) -> None:
        self.assign, self.frames, self.assigned = assign, [], 0
        self.server = ws_server.serve(self.handle, "127.0.0.1", 0)
        self.url = f"ws://127.0.0.1:{self.server.socket.getsockname()[1]}/ws/volunteer/"

    def handle(self, ws: Any) -> None:
        for frame in ws:
            if isinstance(frame, bytes):
                self.frames.append(("binary", frame))
                ws.send(json.dumps({"type": "ack", "work_unit": 1, "accepted": True, "credit_flops": CREDIT,
                                    "total_credit_flops": 1000 + CREDIT}))
                continue
            msg = json.loads(frame)
            self.frames.append(("json", msg))
            if msg["type"] == "hello":
                ws.send(json.dumps({"type": "welcome", "protocol": 1,
                                    "volunteer": {"username": "alice", "credit_flops": 1000}}))
            elif msg["type"] == "ready":
                self.on_ready(ws)

    def on_ready(self, ws: Any) -> None:
        self.assigned += 1
        if self.assigned > 2:
            ws.send(json.dumps({"type": "idle"}))
            return
        ws.send(json.dumps({"type": "assign", "work_unit": {**self.assign, "id": self.assigned}}))
        if self.assigned == 2:
            ws.send(json.dumps({"type": "cancel", "work_units": [2], "reason": "round closed"}))

    def json_types(self) -> list[str]:
        return [m["type"] if kind == "json" else "<binary>" for kind, m in self.frames]


@pytest.fixture
def fake_server(static_server: Any) -> Iterator[FakeServer]:
    g, weights = presets.export_preset("mlp", seed=0)
    torch = pytest.importorskip("torch")
    shard = codecs.encode({"x": torch.rand(40, 784), "y": torch.randint(0, 10, (40,), dtype=torch.int32)})
    put = lambda data: static_server.put_blob(hashlib.sha256(data).hexdigest(), data)  # noqa: E731
    assign = {"project": {"id": 4, "name": "Digits MLP"}, "model_version": 1, "task": "gradient",
              "graph_url": put(json.dumps(g).encode()), "weights_url": put(codecs.encode(weights)),
              "shards": [{"url": put(shard), "offset": 0, "count": 40}], "batch_size": 16,
              "deadline": "2030-01-01T00:00:00Z", "codec": "fp16"}
    server = FakeServer(assign)
    thread = threading.Thread(target=server.server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.server.shutdown()


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
    page.wait_for_function("() => document.getElementById('work-units-done').textContent === '1'",
                           timeout=120_000)
    page.wait_for_function("() => /Waiting for work/.test(document.getElementById('status').textContent)")
    elapsed = time.monotonic() - started

    assert page.get_attribute("#credit", "data-flops") == str(1000 + CREDIT)
    assert page.text_content("#credit") == "123 MFLOP"
    assert page.text_content("#backend").startswith("webgl")
    assert page.text_content("#project") == "Digits MLP"
    assert float(page.text_content("#samples-per-second")) > 0
    time.sleep(2)  # let the worker finish cancelled unit 2, whose result must be dropped
    page.click("#stop")
    page.wait_for_function("() => !document.getElementById('contribute').disabled")
    deadline = time.monotonic() + 5
    while "bye" not in fake_server.json_types() and time.monotonic() < deadline:
        time.sleep(0.05)
    context.close()

    types = fake_server.json_types()
    hello = fake_server.frames[0][1]
    assert hello["protocol"] == 1 and hello["device"]["backend"] == "webgl" and hello["device"]["gflops"] > 0
    assert types[:2] == ["hello", "ready"]
    assert types.count("result") == 1 and types[types.index("result") + 1] == "<binary>"
    result = next(m for kind, m in fake_server.frames if kind == "json" and m["type"] == "result")
    assert result["work_unit"] == 1 and result["samples"] == 40 and result["model_version"] == 1
    binary = next(m for kind, m in fake_server.frames if kind == "binary")
    grads, meta = codecs.decode(binary)
    assert meta["codec"] == "fp16" and set(grads) == {p["name"] for p in json.loads(
        json.dumps(presets.export_preset("mlp")[0]))["params"]}
    assert types.count("ready") == 3 and types[-1] == "bye"  # after result, after cancel; then bye
    assert not errors, errors
    print(f"contribute flow: {elapsed:.1f} s from click to first ack")
