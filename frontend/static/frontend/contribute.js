// The Contribute page: runs worker.js and speaks docs/protocol.md over /ws/volunteer/.
// Prefetch: while the worker computes one work unit, a second `ready` asks for the next, so it (and its
// blobs, which the worker starts downloading at once) is waiting when the first finishes. The protocol
// allows at most MAX_IN_FLIGHT work units per connection.
(function () {
  "use strict";

  const app = document.getElementById("contribute-app");
  if (!app) return;
  const PROTOCOL = self.crowdtrain.spec.protocol; // spec.js: engine/spec.json, the server's own constants
  const $ = (id) => document.getElementById(id);
  const WORKER_URL = app.dataset.workerUrl || "/static/frontend/worker.js";
  const SOCKET_PATH = app.dataset.socketPath || "/ws/volunteer/";
  const SOCKET_URL = app.dataset.socketUrl; // optional absolute ws(s):// URL (separate WebSocket host)
  const BACKOFF_MS = [1000, 2000, 5000, 10000, 30000];
  const THROTTLED = PROTOCOL.close_codes.throttled; // too many connects in the last minute (docs/protocol.md)
  const THROTTLED_MS = 60000;
  const BUSY_RETRY_MS = 5000; // a result refused with `busy` is sent again after this (jittered)
  const DEVICE_ID_KEY = "crowdtrain-device-id";
  const LOG_LINES = 60;
  const MAX_IN_FLIGHT = PROTOCOL.max_in_flight;
  const DEVICE_ID_RE = new RegExp(PROTOCOL.device_id_pattern);
  const SHARE_REFRESH_MS = 5000;
  const FLOP_UNITS = ["FLOP", "kFLOP", "MFLOP", "GFLOP", "TFLOP", "PFLOP", "EFLOP", "ZFLOP", "YFLOP"];

  let s = freshState();

  function freshState() {
    return {
      running: false, worker: null, socket: null, device: null, retries: 0, reconnectTimer: null,
      inFlight: new Map(), // id -> work unit given to the worker, result not yet sent (oldest first)
      asking: false, // a `ready` not yet answered by an assign (after `idle` the server still owes one)
      cancelled: new Set(), // ids whose late results must be dropped
      outbox: [], // finished results waiting for the socket to come back
      unacked: new Map(), // id -> result sent on this connection, kept until acked (resent on `busy`)
      done: 0, rate: 0,
      engineSince: null, computeMs: 0, shareTimer: null, // for the share of time spent computing
    };
  }

  // ---- display ---------------------------------------------------------------------------------
  // Same rule as the server's `flops` filter: 3 significant digits, SI prefixes.
  function formatFlops(value) {
    let n = Math.abs(value), unit = 0;
    while (unit < FLOP_UNITS.length - 1 && Number(n.toPrecision(3)) >= 1000) { n /= 1000; unit++; }
    const digits = n >= 1000 ? Math.round(n).toLocaleString("en-US") : String(Number(n.toPrecision(3)));
    return `${value < 0 ? "-" : ""}${digits} ${FLOP_UNITS[unit]}`;
  }

  function setCredit(flops) {
    const el = $("credit");
    el.dataset.flops = BigInt(Math.round(flops)).toString(); // no 1e+21 notation for big totals
    el.textContent = formatFlops(flops);
  }

  // Acks and verdicts may cross on the wire; the total only ever grows.
  function raiseCredit(total) {
    if (total !== undefined && total >= Number($("credit").dataset.flops || 0)) setCredit(total);
  }

  function setStatus(text, state) {
    $("status").textContent = text;
    $("status-dot").dataset.state = state || "idle";
  }

  function log(text, isError) {
    const li = document.createElement("li");
    const time = document.createElement("time");
    time.textContent = new Date().toLocaleTimeString();
    li.append(time, text);
    if (isError) li.className = "ct-log-error";
    const list = $("log");
    list.prepend(li);
    while (list.children.length > LOG_LINES) list.lastChild.remove();
  }

  function setRunning(running) {
    $("contribute").disabled = running;
    $("stop").disabled = !running;
  }

  // Exponential moving average of samples per second of (download + compute) time.
  function updateRate(msg) {
    const seconds = (msg.timings.download_ms + msg.timings.compute_ms) / 1000;
    if (seconds <= 0) return;
    const now = msg.samples / seconds;
    s.rate = s.rate ? 0.7 * s.rate + 0.3 * now : now;
    $("samples-per-second").textContent = s.rate >= 100 ? Math.round(s.rate).toString() : s.rate.toFixed(1);
  }

  // Share of the time since the engine started that the device spent computing: with prefetch it should
  // stay near 100 % while there is work (downloads overlap computing).
  function showComputeShare() {
    if (s.engineSince === null) return;
    const elapsed = performance.now() - s.engineSince;
    if (elapsed > 0) $("compute-share").textContent = `${Math.min(100, Math.round((100 * s.computeMs) / elapsed))} %`;
  }

  // Status line for the oldest unit in flight: the one the worker is computing.
  function showWork() {
    const wu = s.inFlight.values().next().value;
    if (!wu) { setStatus("Waiting for work…", "waiting"); return; }
    $("project").textContent = wu.project.name;
    const samples = wu.shards.reduce((n, shard) => n + shard.count, 0);
    const next = s.inFlight.size > 1 ? " (next one ready)" : "";
    setStatus(`Training ${wu.project.name}: ${samples} samples…${next}`, "working");
  }

  // ---- device id ---------------------------------------------------------------------------------
  // One random id per browser, kept in localStorage, so the server keeps one Device across reconnections.
  // getRandomValues works on plain-http pages too (randomUUID needs a secure context).
  function newDeviceId() {
    const bytes = crypto.getRandomValues(new Uint8Array(16));
    return Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
  }

  function deviceId() {
    try {
      let id = localStorage.getItem(DEVICE_ID_KEY);
      if (!DEVICE_ID_RE.test(id || "")) {
        id = newDeviceId();
        localStorage.setItem(DEVICE_ID_KEY, id);
      }
      return id;
    } catch (err) { // storage disabled: one id for this page at least
      s.fallbackDeviceId = s.fallbackDeviceId || newDeviceId();
      return s.fallbackDeviceId;
    }
  }

  // ---- socket ------------------------------------------------------------------------------------
  function send(msg) {
    if (s.socket && s.socket.readyState === WebSocket.OPEN) { s.socket.send(JSON.stringify(msg)); return true; }
    return false;
  }

  // One `ready` outstanding at a time, and never more than MAX_IN_FLIGHT units assigned.
  function askForWork() {
    if (!s.running || s.asking || s.outbox.length || s.inFlight.size >= MAX_IN_FLIGHT) return;
    if (send({ type: "ready" })) s.asking = true;
  }

  function connect() {
    const scheme = location.protocol === "https:" ? "wss" : "ws";
    const socket = new WebSocket(SOCKET_URL || `${scheme}://${location.host}${SOCKET_PATH}`);
    socket.binaryType = "arraybuffer";
    s.socket = socket;
    socket.onopen = () => {
      s.retries = 0;
      s.asking = false; // a new connection owes us nothing
      s.unacked.clear();
      send({ type: "hello", protocol: PROTOCOL.version, device: s.device });
      flushOutbox();
      askForWork();
      setStatus("Connected, asking for work…", "waiting");
    };
    socket.onmessage = (event) => {
      if (typeof event.data !== "string") return; // the server sends no binary frames to volunteers
      try { onServerMessage(JSON.parse(event.data)); } catch (err) { log(`bad server message: ${err.message}`, true); }
    };
    socket.onclose = (event) => { if (s.socket === socket) reconnectLater(event.code); };
  }

  function reconnectLater(code) {
    s.socket = null;
    if (!s.running) return;
    const throttled = code === THROTTLED;
    const base = throttled ? THROTTLED_MS : BACKOFF_MS[Math.min(s.retries, BACKOFF_MS.length - 1)];
    const delay = base * (0.75 + Math.random() / 2);
    s.retries++;
    const why = throttled ? "Too many connections" : "Connection lost";
    setStatus(`${why}, retrying in ${Math.round(delay / 1000)} s…`, "error");
    s.reconnectTimer = setTimeout(connect, delay);
  }

  // The JSON frame and its binary frame must be adjacent, so both go out together or not at all.
  function flushOutbox() {
    while (s.outbox.length && s.socket && s.socket.readyState === WebSocket.OPEN) {
      const item = s.outbox.shift();
      const { bytes, type, ...fields } = item;
      send({ type: "result", ...fields });
      s.socket.send(bytes);
      s.unacked.set(item.work_unit, item);
    }
  }

  // The server refused a result's bytes for now (`busy`: too many uploads at once): send it again later.
  function resendLater(id) {
    const item = s.unacked.get(id);
    if (!item) return;
    s.unacked.delete(id);
    setTimeout(() => {
      if (!s.running) return;
      s.outbox.push(item);
      flushOutbox();
    }, BUSY_RETRY_MS * (0.5 + Math.random()));
  }

  const handlers = {
    welcome(msg) {
      if (msg.volunteer) setCredit(msg.volunteer.credit_flops || 0);
      log(`connected as ${msg.volunteer ? msg.volunteer.username : "volunteer"}`);
    },
    assign(msg) {
      const wu = msg.work_unit;
      s.asking = false;
      s.inFlight.set(wu.id, wu);
      s.worker.postMessage({ cmd: "compute", assign: wu });
      showWork();
      askForWork(); // prefetch the next one while this one computes
    },
    // Works for the unit being computed (its late result is dropped) and for a prefetched one (the
    // worker skips it).
    cancel(msg) {
      for (const id of msg.work_units) {
        if (!s.inFlight.delete(id)) continue;
        s.cancelled.add(id);
        s.worker.postMessage({ cmd: "cancel", work_unit: id });
        log(`work unit ${id} cancelled (${msg.reason || "no reason"})`);
      }
      showWork();
      askForWork();
    },
    ack(msg) {
      s.unacked.delete(msg.work_unit);
      if (msg.accepted) {
        s.done++;
        $("work-units-done").textContent = String(s.done);
        log(`work unit ${msg.work_unit} uploaded (${msg.status || "accepted"})`);
      } else {
        log(`work unit ${msg.work_unit} not used: ${msg.reason || msg.status || "no reason"}`, true);
      }
      raiseCredit(msg.total_credit_flops);
    },
    // The verdict arrives once the server has validated the update (see docs/protocol.md).
    credit(msg) {
      if (msg.status === "valid") log(`work unit ${msg.work_unit} validated: +${formatFlops(msg.credit_flops)}`);
      else log(`work unit ${msg.work_unit} ${msg.status}: ${msg.reason || "no reason"}`, true);
      raiseCredit(msg.total_credit_flops);
    },
    idle() {
      if (!s.inFlight.size) setStatus("Waiting for work…", "waiting");
    },
    error(msg) {
      if (msg.code === "busy" && msg.work_unit !== undefined) resendLater(msg.work_unit); // a result
      else if (msg.code === "busy") s.asking = false; // that `ready` was refused, not queued
      else if (msg.work_unit !== undefined) s.unacked.delete(msg.work_unit); // refused for good
      log(`server error ${msg.code}: ${msg.message}`, true);
    },
  };

  function onServerMessage(msg) {
    const handler = handlers[msg.type];
    if (handler) handler(msg);
    else log(`unknown message type ${msg.type}`, true);
  }

  // ---- worker ------------------------------------------------------------------------------------
  function onWorkerMessage(event) {
    const msg = event.data;
    if (msg.type === "ready") onEngineReady(msg);
    else if (msg.type === "init_failed") {
      log(`could not start the engine: ${msg.error}`, true);
      stop();
      setStatus("This browser cannot run the engine.", "error");
    } else onWorkUnitMessage(msg);
  }

  function onEngineReady(msg) {
    s.device = { id: deviceId(), backend: msg.backend, gflops: msg.gflops, user_agent: navigator.userAgent };
    if (navigator.deviceMemory) s.device.memory_mb = navigator.deviceMemory * 1024; // Chrome only
    $("backend").textContent = `${msg.backend} · ${msg.gflops} GFLOP/s`;
    log(`engine ready on ${msg.backend} (${msg.gflops} GFLOP/s)`);
    setStatus("Connecting…", "waiting");
    s.engineSince = performance.now();
    s.shareTimer = setInterval(showComputeShare, SHARE_REFRESH_MS);
    connect();
  }

  function onWorkUnitMessage(msg) {
    if (msg.type === "result") { // cancelled or not, the device spent this time computing
      s.computeMs += msg.timings.compute_ms;
      showComputeShare();
    }
    if (s.cancelled.delete(msg.work_unit)) {
      // Late result (or skip notice) of cancelled work: drop it. Its slot was freed at cancel time.
    } else if (msg.type === "result") {
      onResult(msg);
    } else if (msg.type === "failed") {
      log(`work unit ${msg.work_unit} failed: ${msg.error}`, true);
      s.inFlight.delete(msg.work_unit);
      showWork();
      setTimeout(askForWork, 2000); // don't spin if every unit fails the same way
    }
  }

  function onResult(msg) {
    s.inFlight.delete(msg.work_unit);
    showWork();
    updateRate(msg);
    log(`work unit ${msg.work_unit}: ${msg.samples} samples, loss ${msg.loss.toFixed(4)}, ` +
      `${msg.timings.compute_ms} ms compute, ${msg.timings.download_ms} ms download`);
    s.outbox.push(msg);
    flushOutbox();
    askForWork();
  }

  // ---- start / stop --------------------------------------------------------------------------------
  function start() {
    if (s.running) return;
    s = freshState();
    s.running = true;
    setRunning(true);
    setStatus("Starting the engine (benchmarking your device)…", "waiting");
    s.worker = new Worker(WORKER_URL);
    s.worker.onmessage = onWorkerMessage;
    s.worker.onerror = (event) => { log(`engine crashed: ${event.message}`, true); stop(); };
    s.worker.postMessage({ cmd: "init" });
  }

  function stop() {
    if (!s.running) return;
    s.running = false;
    clearTimeout(s.reconnectTimer);
    clearInterval(s.shareTimer);
    if (s.socket) {
      send({ type: "bye" });
      const socket = s.socket;
      s.socket = null;
      socket.close(1000, "bye");
    }
    if (s.worker) s.worker.terminate();
    s.worker = null;
    setRunning(false);
    setStatus("Stopped.", "idle");
    log("stopped");
  }

  $("contribute").addEventListener("click", start);
  $("stop").addEventListener("click", stop);
  window.addEventListener("pagehide", stop);
})();
