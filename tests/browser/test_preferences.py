"""Computing preferences enforced in Chromium on WebGL: the Contribute page (as Django renders it) with the
real worker, against a scripted server that hands out work forever and sends the preferences in `welcome`
and live in `preferences`. The duty cycle is measured from the worker's own timestamps; a hidden tab, a
battery (an injected navigator.getBattery) and typing pause the worker between work units."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.browser.pages import contribute_html

pytestmark = [pytest.mark.browser, pytest.mark.slow]
codecs = pytest.importorskip("engine.codecs")
protocol = pytest.importorskip("workers.protocol")
presets = pytest.importorskip("engine.presets")
ws_server = pytest.importorskip("websockets.sync.server")

SAMPLES = 256  # per work unit: long enough that timer jitter is small beside its compute time
PREFERENCES: dict[str, Any] = {
    "duty_cycle": 100,
    "pause_when_hidden": True,
    "pause_on_battery": True,
    "battery_min_percent": 0,
    "pause_while_active": False,
    "source": "volunteer",
    "limits": {"projects": "any", "max_work_unit_mb": None, "max_download_mb_per_day": None},
}
STEPS = "() => self.crowdtrainContribute.steps()"
PAUSE = "() => self.crowdtrainContribute.state().pause"
HIDE = """(hidden) => {
  Object.defineProperty(document, "hidden", {value: hidden, configurable: true});
  const state = hidden ? "hidden" : "visible";
  Object.defineProperty(document, "visibilityState", {value: state, configurable: true});
  document.dispatchEvent(new Event("visibilitychange"));
}"""
# A battery the test controls: navigator.getBattery() as Chrome has it, an EventTarget with level, charging.
BATTERY_STUB = """(() => {
  const battery = new EventTarget();
  battery.level = 0.9; battery.charging = true; battery.chargingTime = 0; battery.dischargingTime = Infinity;
  self.testBattery = (changes) => {
    for (const [key, value] of Object.entries(changes)) {
      battery[key] = value;
      battery.dispatchEvent(new Event(key === "level" ? "levelchange" : "chargingchange"));
    }
  };
  const getBattery = () => Promise.resolve(battery);
  Object.defineProperty(Navigator.prototype, "getBattery", {value: getBattery, configurable: true});
})();"""


class WorkServer:
    """Assigns a work unit for every `ready` (the same slice, numbered anew), acks every result, records every
    frame with the time it arrived; `push` sends a message to the connected page."""

    def __init__(self, assign: dict[str, Any], preferences: dict[str, Any]) -> None:
        self.assign, self.preferences = assign, preferences
        self.next_id = 0
        self.result_for: int | None = None  # the unit whose binary frame comes next
        self.frames: list[tuple[float, Any]] = []
        self.lock = threading.Lock()
        self.ws: Any = None
        self.server = ws_server.serve(self.handle, "127.0.0.1", 0)
        self.url = f"ws://127.0.0.1:{self.server.socket.getsockname()[1]}/ws/volunteer/"

    def send(self, message: dict[str, Any]) -> None:
        with self.lock:
            self.ws.send(json.dumps(message))

    push = send

    def handle(self, ws: Any) -> None:
        self.ws = ws
        for frame in ws:
            msg = None if isinstance(frame, bytes) else json.loads(frame)
            self.frames.append((time.monotonic(), msg))
            if msg is None:
                self.send(
                    {"type": "ack", "work_unit": self.result_for, "accepted": True, "status": "pending"}
                )
            elif msg["type"] == "hello":
                welcome = {
                    "type": "welcome",
                    "protocol": 1,
                    "volunteer": {"username": "alice", "credit_flops": 0},
                }
                self.send({**welcome, "preferences": self.preferences})
            elif msg["type"] == "ready":
                self.next_id += 1
                self.send({"type": "assign", "work_unit": {**self.assign, "id": self.next_id}})
            elif msg["type"] == "result":
                self.result_for = msg["work_unit"]

    def messages(self, kind: str) -> list[tuple[float, dict[str, Any]]]:
        return [(at, msg) for at, msg in self.frames if msg is not None and msg["type"] == kind]


@pytest.fixture(scope="module")
def assign(static_server: Any) -> dict[str, Any]:
    torch = pytest.importorskip("torch")
    g, weights = presets.export_preset("mlp", seed=0)
    x, y = torch.rand(SAMPLES, 1, 28, 28), torch.randint(0, 10, (SAMPLES,), dtype=torch.int32)
    put = lambda data: static_server.put_blob(hashlib.sha256(data).hexdigest(), data)  # noqa: E731
    return {
        "project": {"id": 4, "name": "Digits MLP", "why": "share"},
        "model_version": 1,
        "task": "local_steps",
        "local": {"optimizer": "sgd", "lr": 0.05, "momentum": 0.9, "batch_size": 16},
        "graph_url": put(json.dumps(g).encode()),
        "weights_url": put(codecs.encode(weights)),
        "shards": [{"url": put(codecs.encode({"x": x, "y": y})), "offset": 0, "count": SAMPLES}],
        "batch_size": SAMPLES,
        "deadline": "2030-01-01T00:00:00Z",
        "codec": "fp32",
    }


@pytest.fixture
def contribute(browser: Any, static_server: Any, assign: dict[str, Any], request: Any) -> Iterator[Any]:
    """Opens the page against a fresh server and starts. `request.param` (indirect parametrization): the
    preferences that differ from PREFERENCES, and `battery` for a battery the test controls."""
    options = dict(getattr(request, "param", {}))
    battery = options.pop("battery", False)
    server = WorkServer(assign, {**PREFERENCES, **options})
    threading.Thread(target=server.server.serve_forever, daemon=True).start()
    name = f"contribute-{request.node.name}.html"
    static_server.put_blob(name, contribute_html(server.url).encode())
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    if battery:
        context.add_init_script(BATTERY_STUB)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(f"{static_server.url}/blobs/{name}")
    page.click("#contribute")
    page.server = server
    yield page
    context.close()
    server.server.shutdown()
    assert not errors, errors


def steps(page: Any) -> list[dict[str, Any]]:
    return list(page.evaluate(STEPS))


def wait_for_steps(page: Any, n: int, timeout: float = 180) -> list[dict[str, Any]]:
    page.wait_for_function(f"() => ({STEPS})().length >= {n}", timeout=timeout * 1000)
    return steps(page)


def compute_share(done: list[dict[str, Any]]) -> float:
    """Computing time over wall time, from the start of the first step to the start of the last: each step
    but the last is in it with the rest that follows it (the rest is sized on the step before it)."""
    computing = sum(step["end"] - step["start"] for step in done[:-1])
    return computing / (done[-1]["start"] - done[0]["start"])


@pytest.mark.parametrize("contribute", [{"duty_cycle": 50}], indirect=True)
def test_the_duty_cycle_is_kept_between_work_units(contribute: Any) -> None:
    done = wait_for_steps(contribute, 9)[2:]  # past the first units' shader compilation
    share = compute_share(done)
    seconds = [round((step["end"] - step["start"]) / 1000, 2) for step in done]
    print(f"duty cycle 50 %: compute share {share:.3f} over {len(done) - 1} steps of {seconds} s")
    assert 0.45 <= share <= 0.55, (share, seconds)
    assert contribute.evaluate("document.title") in {
        "▶ Training Digits MLP — Crowdtrain",
        "⏸ Paused (throttle) — Crowdtrain",
    }
    # Throttled, the page never holds a unit while the worker rests: one `ready` per result, no prefetch.
    assert len(contribute.server.messages("ready")) <= len(contribute.server.messages("result")) + 1

    contribute.server.push({"type": "preferences", "preferences": {**PREFERENCES, "duty_cycle": 100}})
    before = len(steps(contribute))
    flat_out = wait_for_steps(contribute, before + 5)[before + 1 :]  # the rest in progress over
    share = compute_share(flat_out)
    print(f"duty cycle set to 100 % live: compute share {share:.3f}")
    assert share >= 0.8, share


def test_a_hidden_tab_stops_training_within_one_work_unit_and_resumes_when_shown(contribute: Any) -> None:
    wait_for_steps(contribute, 3)
    pauses_before = len(contribute.server.messages("pause"))
    contribute.evaluate(HIDE, True)
    hidden_at = time.monotonic()
    contribute.wait_for_function("() => document.title === '⏸ Paused (hidden) — Crowdtrain'")
    results = lambda: len(contribute.server.messages("result"))  # noqa: E731
    at_hide = results()
    assert contribute.is_visible("#pause-reason")
    assert "hidden" in (contribute.text_content("#status") or "")
    # The unit being computed may finish; none other starts. After 10 s the prefetched unit is given back.
    deadline = time.monotonic() + 30
    while not contribute.server.messages("release") and time.monotonic() < deadline:
        time.sleep(0.2)
    released = contribute.server.messages("release")
    assert released and released[0][0] - hidden_at >= 9, released
    # ... and the server is told the device is paused, so that no crowd round is planned for it meanwhile.
    paused = contribute.server.messages("pause")[pauses_before:]
    assert [msg for _, msg in paused] == [{"type": "pause", "paused": True}] and paused[0][0] - hidden_at >= 9
    assert protocol.parse_message(json.dumps(paused[0][1])) == protocol.Pause(type="pause", paused=True)
    assert results() <= at_hide + 1
    ended = len(steps(contribute))
    time.sleep(2)
    assert len(steps(contribute)) == ended and results() <= at_hide + 1

    contribute.evaluate(HIDE, False)
    contribute.wait_for_function("() => document.title === '▶ Training Digits MLP — Crowdtrain'")
    wait_for_steps(contribute, ended + 2)
    assert not contribute.is_visible("#pause-reason")
    assert [msg["paused"] for _, msg in contribute.server.messages("pause")[pauses_before:]] == [True, False]


def test_a_paused_page_that_reconnects_tells_the_server_again(contribute: Any) -> None:
    """A hello starts the device unpaused on the server, so a page still paused says so again."""
    wait_for_steps(contribute, 2)
    contribute.evaluate(HIDE, True)
    wait_for_messages(contribute, "pause", 1)
    hellos = len(contribute.server.messages("hello"))
    contribute.server.ws.close()
    wait_for_messages(contribute, "pause", 2)
    pauses, again = contribute.server.messages("pause"), contribute.server.messages("hello")[hellos:]
    assert [msg for _, msg in pauses] == [{"type": "pause", "paused": True}] * 2
    assert again and pauses[1][0] > again[0][0]  # on the new connection, after its hello
    contribute.evaluate(HIDE, False)
    wait_for_messages(contribute, "pause", 3)
    assert contribute.server.messages("pause")[2][1]["paused"] is False


def wait_for_messages(page: Any, kind: str, count: int, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while len(page.server.messages(kind)) < count and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(page.server.messages(kind)) >= count, page.server.messages(kind)


@pytest.mark.parametrize("contribute", [{"pause_when_hidden": False}], indirect=True)
def test_a_hidden_tab_keeps_training_when_the_volunteer_says_so(contribute: Any) -> None:
    wait_for_steps(contribute, 2)
    contribute.evaluate(HIDE, True)
    before = len(steps(contribute))
    wait_for_steps(contribute, before + 2)
    assert contribute.evaluate(PAUSE) is None
    # ...and the volunteer changes their mind: the preferences arrive live and the page pauses.
    contribute.server.push({"type": "preferences", "preferences": PREFERENCES})
    contribute.wait_for_function(f"() => ({PAUSE})() === 'hidden'")
    assert "preferences updated" in (contribute.text_content("#log") or "")


@pytest.mark.parametrize("contribute", [{"battery": True, "battery_min_percent": 20}], indirect=True)
def test_the_battery_pauses_while_discharging_and_below_its_level(contribute: Any) -> None:
    wait_for_steps(contribute, 2)
    contribute.evaluate("testBattery({charging: false})")
    contribute.wait_for_function(f"() => ({PAUSE})() === 'battery'")
    assert contribute.evaluate("document.title") == "⏸ Paused (battery) — Crowdtrain"
    paused_steps = len(steps(contribute))
    time.sleep(3)
    assert len(steps(contribute)) <= paused_steps + 1  # at most the unit that was computing
    contribute.evaluate("testBattery({charging: true})")
    contribute.wait_for_function(f"() => ({PAUSE})() === null")
    wait_for_steps(contribute, paused_steps + 3)
    contribute.evaluate("testBattery({level: 0.1})")  # charging, but below the volunteer's 20 %
    contribute.wait_for_function(f"() => ({PAUSE})() === 'battery_low'")
    assert "battery is low" in (contribute.text_content("#status") or "")
    contribute.evaluate("testBattery({level: 0.5})")
    contribute.wait_for_function(f"() => ({PAUSE})() === null")


@pytest.mark.parametrize("contribute", [{"pause_while_active": True}], indirect=True)
def test_typing_pauses_until_a_few_seconds_after_the_last_key(contribute: Any) -> None:
    wait_for_steps(contribute, 2)
    typing_until = time.monotonic() + 8
    contribute.keyboard.press("a")
    contribute.wait_for_function(f"() => ({PAUSE})() === 'active'")
    started = len(steps(contribute))
    while time.monotonic() < typing_until:
        contribute.keyboard.press("a")
        contribute.mouse.move(100 + 50 * (time.monotonic() % 2), 200)
        time.sleep(0.3)
    assert contribute.evaluate(PAUSE) == "active"
    assert len(steps(contribute)) <= started + 1  # 8 s of typing: only the unit that was computing ended
    assert contribute.evaluate("document.title") == "⏸ Paused (typing) — Crowdtrain"
    contribute.wait_for_function(f"() => ({PAUSE})() === null", timeout=10_000)
    wait_for_steps(contribute, started + 3)
