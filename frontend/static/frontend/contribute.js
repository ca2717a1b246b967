// The Contribute page: runs worker.js and speaks docs/protocol.md over /ws/volunteer/.
// Prefetch: while the worker computes one work unit, a second `ready` asks for the next, so it (and its
// blobs, which the worker starts downloading at once) is waiting when the first finishes. The protocol
// allows at most MAX_IN_FLIGHT work units per connection.
// Computing preferences (from `welcome`, and live from `preferences`): the worker rests between units for
// the duty cycle; this page pauses it while the tab is hidden, on battery, or while the volunteer uses the
// page, and gives back (`release`) work it has not started when a pause lasts, telling the server (`pause`).
// Every text shown comes from the template's #contribute-strings (translated there).
// Pipeline mode: a stage unit's activation or gradient from the volunteer of the adjacent stage comes over
// the peer ring when the project uses it (ring.js PayloadRing: from the peer, else relayed by the server),
// before the unit goes to the worker; what this page's units send by the ring it keeps for its consumers.
(function () {
  "use strict";

  const app = document.getElementById("contribute-app");
  if (!app) return;
  const PROTOCOL = self.crowdtrain.spec.protocol; // spec.js: engine/spec.json, the server's own constants
  const $ = (id) => document.getElementById(id);
  const WORKER_URL = app.dataset.workerUrl || "/static/frontend/worker.js";
  const SOCKET_PATH = app.dataset.socketPath || "/ws/volunteer/";
  const SOCKET_URL = app.dataset.socketUrl; // optional absolute ws(s):// URL (separate WebSocket host)
  const { reconnectDelay, retryLaterDelay } = self.crowdtrain.backoff; // backoff.js: full-jitter back-off
  const { PayloadRing } = self.crowdtrain.ring; // ring.js: pipeline mode's peer ring
  const THROTTLED = PROTOCOL.close_codes.throttled; // too many connects in the last minute (docs/protocol.md)
  const RETRY_LATER = PROTOCOL.close_codes.retry_later; // the server is busy admitting others
  const THROTTLED_MS = 60000;
  const BUSY_RETRY_MS = 5000; // a result refused with `busy` is sent again after this (jittered)
  const DEVICE_ID_KEY = "crowdtrain-device-id";
  const LOG_LINES = 60;
  const MAX_IN_FLIGHT = PROTOCOL.max_in_flight;
  const DEVICE_ID_RE = new RegExp(PROTOCOL.device_id_pattern);
  const SHARE_REFRESH_MS = 5000;
  const INPUT_PAUSE_MS = 3000; // "pause while I use the page": this long after the last input
  const RELEASE_AFTER_MS = 10000; // a pause this long gives back the work units not started
  const ASK_BEFORE_REST_ENDS_MS = 3000; // resting: ask for the next unit this long before the rest ends
  const MAX_STEPS = 200;
  const INPUT_EVENTS = ["keydown", "mousemove", "pointerdown", "wheel", "touchstart"];
  const FLOP_UNITS = ["FLOP", "kFLOP", "MFLOP", "GFLOP", "TFLOP", "PFLOP", "EFLOP", "ZFLOP", "YFLOP"];
  const DEFAULT_PREFERENCES = {
    duty_cycle: 100, pause_when_hidden: true, pause_on_battery: true, battery_min_percent: 0,
    pause_while_active: false, source: "default", limits: {},
  };
  const STRINGS = readStrings();
  const DECIMAL_SEPARATOR = STRINGS.decimal_separator || "."; // the server's `credit` filter's, in this language
  const THOUSAND_SEPARATOR = STRINGS.thousand_separator || ",";
  const PAGE_TITLE = document.title;

  let battery = null; // navigator.getBattery()'s manager, where the browser has one
  let lastInput = -Infinity;
  let inputTimer = null;
  let s = freshState();

  function freshState() {
    return {
      running: false, worker: null, socket: null, device: null, retries: 0, reconnectTimer: null,
      welcomed: false, // results go out only on a connection the server has welcomed (flushOutbox)
      inFlight: new Map(), // id -> work unit given to the worker, result not yet sent (oldest first)
      started: new Set(), // ids the worker has started computing
      computing: null, // the id being computed
      asking: false, // a `ready` not yet answered by an assign (after `idle` the server still owes one)
      cancelled: new Set(), // ids whose late results must be dropped
      outbox: [], // finished results waiting for the socket to come back
      unacked: new Map(), // id -> result sent on this connection, kept until acked (resent on `busy`)
      done: 0, rate: 0,
      engineSince: null, computeMs: 0, weightsByDelta: 0, shareTimer: null, // for the share of time spent computing
      preferences: DEFAULT_PREFERENCES,
      pause: null, pausedSince: null, releaseTimer: null, // why the worker is paused, since when
      pauseReported: false, // the server was told of a lasting pause (`pause`): no round is planned for us
      restUntil: 0, restTimer: null, askTimer: null, // the duty cycle's rest (this page's clock)
      idle: null, // the reason of the latest `idle`, until work comes
      project: null, // the latest work unit's project {id, name, why}
      stage: null, // the latest stage unit's {index, count} (pipeline mode)
      ring: null, // PayloadRing while running
      steps: [], // the worker's own {work_unit, start, end} of each unit, for the volunteer's (and tests') eyes
    };
  }

  // ---- texts -----------------------------------------------------------------------------------------
  function readStrings() {
    const element = $("contribute-strings");
    try { return JSON.parse((element && element.textContent) || "{}"); } catch (err) { return {}; }
  }

  // The template's text for `key`, with %(name)s replaced by params.name and %% by %.
  function t(key, params) {
    const text = Object.prototype.hasOwnProperty.call(STRINGS, key) ? STRINGS[key] : key;
    return text.replace(/%(?:\((\w+)\)s|%)/g, (match, name) => {
      if (!name) return "%"; // %% as in Python's format
      return params && name in params ? String(params[name]) : match;
    });
  }

  // ---- display ---------------------------------------------------------------------------------
  // Same rule as the server's `flops` filter: 3 significant digits, SI prefixes.
  function formatFlops(value) {
    let n = Math.abs(value), unit = 0;
    while (unit < FLOP_UNITS.length - 1 && Number(n.toPrecision(3)) >= 1000) { n /= 1000; unit++; }
    const digits = n >= 1000 ? Math.round(n).toLocaleString("en-US") : String(Number(n.toPrecision(3)));
    return `${value < 0 ? "-" : ""}${digits} ${FLOP_UNITS[unit]}`;
  }

  function setFlops(id, flops) {
    const el = $(id);
    el.dataset.flops = BigInt(Math.round(flops)).toString(); // no 1e+21 notation for big totals
    el.textContent = formatFlops(flops);
  }

  // Same rule as the server's `credit` filter (format_credit): whole numbers from 100 on, 2 decimals from 1,
  // 3 significant digits below; grouped, with the separators of the page's language.
  function formatCredit(value) {
    if (!Number.isFinite(value) || value === 0) return "0";
    const magnitude = Math.abs(value);
    const places = magnitude >= 100 ? 0 : magnitude >= 1 ? 2 : Math.min(12, 2 - Math.floor(Math.log10(magnitude)));
    const [whole, fraction] = magnitude.toFixed(places).split(".");
    const grouped = whole.replace(/\B(?=(\d{3})+$)/g, THOUSAND_SEPARATOR);
    return `${value < 0 ? "-" : ""}${grouped}${fraction ? DECIMAL_SEPARATOR + fraction : ""}`;
  }

  // The recent average credit as the server computed it (credit per day): the page cannot, it lacks the
  // stored average and its time.
  function setRecentAverage(recent) {
    if (typeof recent !== "number" || !Number.isFinite(recent)) return; // from a server that sends none
    const el = $("recent-average");
    el.dataset.credit = String(recent);
    el.textContent = t("recent_average", { credit: formatCredit(recent) });
  }

  // Acks and verdicts may cross on the wire; the total only ever grows. The recent average was read with
  // the total: one that came with a lower total would undo a grant.
  function raiseCredit(msg) {
    const total = msg.total_credit_flops;
    if (total === undefined || total < Number($("credit").dataset.flops || 0)) return;
    setFlops("credit", total);
    setRecentAverage(msg.recent_credit);
  }

  function addCreditToday(flops) {
    if (flops > 0) setFlops("credit-today", Number($("credit-today").dataset.flops || 0) + flops);
  }

  function setStatus(text, state) {
    $("status").textContent = text;
    $("status-dot").dataset.state = state || "idle";
  }

  function setTitle(text) {
    document.title = text || PAGE_TITLE;
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
  // stay near 100 % while there is work (downloads overlap computing), near the duty cycle when throttled.
  function showComputeShare() {
    if (s.engineSince === null) return;
    const elapsed = performance.now() - s.engineSince;
    if (elapsed > 0) $("compute-share").textContent = `${Math.min(100, Math.round((100 * s.computeMs) / elapsed))} %`;
  }

  function showProject() {
    if (!s.project) return;
    $("project").textContent = s.project.name;
    $("project-why").textContent = s.project.why ? t(`why_${s.project.why}`) : "";
    const stage = $("project-stage");
    stage.hidden = !s.stage;
    stage.textContent = s.stage ? t("stage_of", { stage: s.stage.index + 1, stages: s.stage.count }) : "";
    stage.dataset.stage = s.stage ? String(s.stage.index) : "";
  }

  function showPause(reason, text) {
    const el = $("pause-reason");
    el.hidden = !reason;
    el.dataset.reason = reason || "";
    el.textContent = text || "";
  }

  // Status line, pause line and tab title, from the state: paused, resting, computing, waiting or idle.
  function showWork() {
    if (!s.running) return;
    const resting = s.computing === null && s.restUntil > performance.now();
    const reason = s.pause || (resting ? "throttle" : null) || (s.inFlight.size ? null : s.idle);
    const wu = s.inFlight.get(s.computing) || s.inFlight.values().next().value;
    showPause(reason, reason && t(`pause_${reason}`, { percent: s.preferences.duty_cycle, ...s.preferences.limits }));
    if (reason) {
      setStatus(t(`status_${reason}`, { percent: s.preferences.duty_cycle }), "paused");
      setTitle(t("title_paused", { reason: t(`short_${reason}`) }));
    } else if (wu) {
      const samples = wu.shards.reduce((n, shard) => n + shard.count, 0);
      const next = s.inFlight.size > 1 ? t("next_ready") : "";
      setStatus(t("status_training", { project: wu.project.name, samples, next }), "working");
      setTitle(t("title_training", { project: wu.project.name }));
    } else {
      setStatus(t("status_waiting"), "waiting");
      setTitle(t("title_waiting"));
    }
  }

  function showPreferences() {
    const p = s.preferences;
    const parts = [t(p.duty_cycle < 100 ? "pref_duty" : "pref_full", { percent: p.duty_cycle })];
    if (p.pause_when_hidden) parts.push(t("pref_hidden"));
    if (p.pause_on_battery) parts.push(t("pref_battery"));
    if (p.battery_min_percent > 0) parts.push(t("pref_battery_min", { percent: p.battery_min_percent }));
    if (p.pause_while_active) parts.push(t("pref_active"));
    const limits = p.limits || {};
    if (limits.projects && limits.projects !== "any") parts.push(t(`pref_projects_${limits.projects}`));
    if (limits.max_work_unit_mb) parts.push(t("pref_work_unit", { mb: limits.max_work_unit_mb }));
    if (limits.max_download_mb_per_day) parts.push(t("pref_download", { mb: limits.max_download_mb_per_day }));
    $("preferences-summary").textContent = parts.join(" · ");
    $("preferences-source").textContent = t(`source_${p.source || "default"}`);
  }

  // ---- preferences: pauses and the duty cycle ------------------------------------------------------
  function pauseReason() {
    const p = s.preferences;
    if (p.pause_when_hidden && document.hidden) return "hidden";
    if (battery && p.pause_on_battery && !battery.charging) return "battery";
    if (battery && p.battery_min_percent > 0 && battery.level * 100 < p.battery_min_percent) return "battery_low";
    if (p.pause_while_active && performance.now() - lastInput < INPUT_PAUSE_MS) return "active";
    return null;
  }

  // Tells the worker when the reason to pause changes; a pause that lasts gives unstarted work back.
  function applyPause() {
    if (!s.running || !s.worker) return;
    const reason = pauseReason();
    clearTimeout(inputTimer);
    if (reason === "active") inputTimer = setTimeout(applyPause, lastInput + INPUT_PAUSE_MS - performance.now() + 20);
    if (reason !== s.pause) {
      const was = s.pause;
      s.pause = reason;
      if (!reason || !was) s.worker.postMessage({ cmd: reason ? "pause" : "resume" });
      if (!was) {
        s.pausedSince = performance.now();
        s.releaseTimer = setTimeout(releaseUnstarted, RELEASE_AFTER_MS);
      }
      if (!reason) {
        clearTimeout(s.releaseTimer);
        s.pausedSince = null;
        reportPause(false);
        log(t("log_resumed"));
        askForWork();
      } else {
        log(t("log_paused", { reason: t(`short_${reason}`) }));
      }
    }
    showWork();
  }

  function releaseUnstarted() {
    if (!s.pause) return;
    reportPause(true);
    const ids = [...s.inFlight.keys()].filter((id) => !s.started.has(id));
    if (!ids.length) return;
    for (const id of ids) {
      s.inFlight.delete(id);
      s.cancelled.add(id);
      s.worker.postMessage({ cmd: "cancel", work_unit: id });
    }
    if (send({ type: "release", work_units: ids })) log(t("log_released", { ids: ids.join(", ") }));
    showWork();
  }

  // A pause that lasts (or its end) is told to the server, which plans crowd rounds without this device
  // meanwhile; short ones (a few seconds of typing) are not worth a message.
  function reportPause(paused) {
    if (s.pauseReported !== paused && send({ type: "pause", paused })) s.pauseReported = paused;
  }

  // Cheap on every mouse move: only the first input of a pause changes anything; the check that ends the
  // pause (applyPause) looks again at the latest input when it comes.
  function onInput() {
    lastInput = performance.now();
    if (s.running && s.preferences.pause_while_active && s.pause !== "active") applyPause();
  }

  function applyPreferences(preferences) {
    s.preferences = { ...DEFAULT_PREFERENCES, ...preferences };
    if (s.worker) s.worker.postMessage({ cmd: "duty", percent: s.preferences.duty_cycle });
    showPreferences();
    applyPause();
  }

  // The worker rests `ms` from now before its next unit (the duty cycle).
  function resting(ms) {
    s.restUntil = performance.now() + ms;
    clearTimeout(s.restTimer);
    if (ms > 0) s.restTimer = setTimeout(showWork, ms + 20);
    showWork();
  }

  function watchBattery() {
    if (!navigator.getBattery) return; // Firefox and Safari: the battery preferences cannot apply
    navigator.getBattery().then((manager) => {
      battery = manager;
      manager.addEventListener("chargingchange", applyPause);
      manager.addEventListener("levelchange", applyPause);
      applyPause();
    }).catch(() => {});
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

  // One `ready` outstanding at a time, and never more than MAX_IN_FLIGHT units assigned. Not while paused.
  // Throttled, no prefetch: the next unit is asked for shortly before the rest ends, so that it does not
  // wait out a long rest (and its deadline) on this device.
  function askForWork() {
    if (!s.running || s.asking || s.pause || s.outbox.length) return;
    const throttled = s.preferences.duty_cycle < 100;
    if (s.inFlight.size >= (throttled ? 1 : MAX_IN_FLIGHT)) return;
    const wait = s.restUntil - ASK_BEFORE_REST_ENDS_MS - performance.now();
    clearTimeout(s.askTimer);
    if (wait > 0) { s.askTimer = setTimeout(askForWork, wait); return; }
    if (send({ type: "ready" })) s.asking = true;
  }

  function connect() {
    const scheme = location.protocol === "https:" ? "wss" : "ws";
    const socket = new WebSocket(SOCKET_URL || `${scheme}://${location.host}${SOCKET_PATH}`);
    socket.binaryType = "arraybuffer";
    s.socket = socket;
    socket.onopen = () => {
      s.asking = false; // a new connection owes us nothing
      s.unacked.clear();
      // Results wait for the welcome: a server busy admitting others closes with 4503 without reading them.
      s.welcomed = false;
      send({ type: "hello", protocol: PROTOCOL.version, device: s.device });
      askForWork();
      setStatus(t("status_connected"), "waiting");
    };
    socket.onmessage = (event) => {
      if (typeof event.data !== "string") return; // the server sends no binary frames to volunteers
      try { onServerMessage(JSON.parse(event.data)); } catch (err) { log(t("log_bad_message", { error: err.message }), true); }
    };
    socket.onclose = (event) => { if (s.socket === socket) reconnectLater(event.code); };
  }

  function reconnectLater(code) {
    s.socket = null;
    if (!s.running) return;
    const throttled = code === THROTTLED;
    const delay = code === RETRY_LATER ? retryLaterDelay(s.retries)
      : (throttled ? THROTTLED_MS : 0) + reconnectDelay(s.retries);
    s.retries++;
    const why = t(throttled ? "throttled" : "connection_lost");
    setStatus(t("status_reconnecting", { why, seconds: Math.ceil(delay / 1000) }), "error");
    s.reconnectTimer = setTimeout(connect, delay);
  }

  // The JSON frame and its binary frame must be adjacent, so both go out together or not at all.
  function flushOutbox() {
    while (s.outbox.length && s.welcomed && s.socket && s.socket.readyState === WebSocket.OPEN) {
      const item = s.outbox.shift();
      const { work_unit, model_version, samples, loss, timings } = item;
      const sent = item.sent ? { sent: { digest: item.sent.digest } } : {};
      send({ type: "result", work_unit, model_version, samples, loss, timings, ...sent });
      s.socket.send(item.bytes);
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
      s.retries = 0; // not at open: a server that accepts and then drops sockets still gets backed off from
      s.welcomed = true;
      s.pauseReported = false; // a hello starts the device unpaused on the server
      if (s.pause && performance.now() - s.pausedSince >= RELEASE_AFTER_MS) reportPause(true);
      flushOutbox();
      askForWork(); // at open it waited if results were queued (askForWork sends those first)
      if (msg.volunteer) {
        setFlops("credit", msg.volunteer.credit_flops || 0);
        setRecentAverage(msg.volunteer.recent_credit);
      }
      log(t("log_connected", { username: msg.volunteer ? msg.volunteer.username : "" }));
      if (msg.preferences) applyPreferences(msg.preferences);
    },
    preferences(msg) {
      applyPreferences(msg.preferences);
      log(t("log_preferences"));
      askForWork();
    },
    assign(msg) {
      const wu = msg.work_unit;
      s.asking = false;
      s.idle = null;
      s.inFlight.set(wu.id, wu);
      s.project = wu.project;
      s.stage = wu.stage ? { index: wu.stage.index, count: wu.stage.count } : null;
      if (wu.ring) computeWithRing(wu);
      else s.worker.postMessage({ cmd: "compute", assign: wu });
      showProject();
      showWork();
      if (s.pause && performance.now() - s.pausedSince >= RELEASE_AFTER_MS) releaseUnstarted();
      askForWork(); // prefetch the next one while this one computes
    },
    // Works for the unit being computed (its late result is dropped) and for a prefetched one (the
    // worker skips it).
    cancel(msg) {
      for (const id of msg.work_units) {
        if (!s.inFlight.delete(id)) continue;
        s.cancelled.add(id);
        s.worker.postMessage({ cmd: "cancel", work_unit: id });
        log(t("log_cancelled", { id, reason: msg.reason || t("no_reason") }));
      }
      showWork();
      askForWork();
    },
    ack(msg) {
      s.unacked.delete(msg.work_unit);
      if (msg.accepted) {
        s.done++;
        $("work-units-done").textContent = String(s.done);
        log(t("log_uploaded", { id: msg.work_unit, status: msg.status || t("accepted") }));
      } else {
        log(t("log_not_used", { id: msg.work_unit, reason: msg.reason || msg.status || t("no_reason") }), true);
      }
      raiseCredit(msg);
    },
    // The verdict arrives once the server has validated the update (see docs/protocol.md).
    credit(msg) {
      if (msg.status === "valid") {
        log(t("log_validated", { id: msg.work_unit, credit: formatFlops(msg.credit_flops) }));
        addCreditToday(msg.credit_flops);
      } else {
        log(t("log_verdict", { id: msg.work_unit, status: msg.status, reason: msg.reason || t("no_reason") }), true);
      }
      raiseCredit(msg);
    },
    idle(msg) {
      s.idle = PROTOCOL.idle_reasons.includes(msg.reason) ? msg.reason : "no_work";
      showWork();
    },
    // Pipeline mode's peer ring (ring.js PayloadRing): signals of this page's links, and offers from the
    // volunteers of adjacent stages (the server forwards no others) for the payloads this page kept.
    signal(msg) {
      if (s.ring) s.ring.onSignal(msg);
    },
    // The server asks for a payload this page sent by the ring: its consumer could not get it from here.
    upload(msg) {
      if (s.ring) s.ring.onUpload(msg);
    },
    error(msg) {
      if (msg.code === "busy" && msg.work_unit !== undefined) resendLater(msg.work_unit); // a result
      else if (msg.code === "busy") s.asking = false; // that `ready` was refused, not queued
      else if (msg.work_unit !== undefined) s.unacked.delete(msg.work_unit); // refused for good
      log(t("log_server_error", { code: msg.code, message: msg.message }), true);
    },
  };

  function onServerMessage(msg) {
    const handler = handlers[msg.type];
    if (handler) handler(msg);
    else log(t("log_unknown_type", { type: msg.type }), true);
  }

  // ---- pipeline mode's peer ring ------------------------------------------------------------------------
  // Gets what the stage unit reads from other volunteers (ring.js PayloadRing.pull), then hands it to the
  // worker. A page that cannot use WebRTC sends its own payloads through the server and has others' relayed.
  async function computeWithRing(wu) {
    const usable = PayloadRing.usable();
    const assign = { ...wu, ring: { ...wu.ring, send: Boolean(wu.ring.send && usable) } };
    const payloads = {};
    const shapes = { input: wu.stage.input_shape, output_grad: wu.stage.output_shape };
    try {
      for (const what of ["input", "output_grad"]) {
        const source = wu.ring[what];
        if (!source) continue;
        const pulled = await s.ring.pull({
          source: usable ? source : { ...source, peer: null }, url: wu[`${what}_url`], workUnit: wu.id, what,
          shape: shapes[what], alive: () => s.running && s.inFlight.has(wu.id),
        });
        payloads[what] = pulled.buffer.byteLength === pulled.byteLength ? pulled.buffer : pulled.slice().buffer;
      }
    } catch (err) {
      if (!s.inFlight.delete(wu.id)) return; // cancelled meanwhile
      log(t("log_ring_failed", { id: wu.id, error: err.message }), true);
      send({ type: "release", work_units: [wu.id] });
      showWork();
      setTimeout(askForWork, 2000);
      return;
    }
    if (!s.inFlight.has(wu.id)) { s.cancelled.delete(wu.id); return; }
    s.worker.postMessage({ cmd: "compute", assign, payloads }, Object.values(payloads));
  }

  // ---- worker ------------------------------------------------------------------------------------
  function onWorkerMessage(event) {
    const msg = event.data;
    if (msg.type === "ready") onEngineReady(msg);
    else if (msg.type === "init_failed") {
      log(t("log_engine_failed", { error: msg.error }), true);
      stop();
      setStatus(t("status_unsupported"), "error");
    } else if (msg.type === "started") {
      s.started.add(msg.work_unit);
      s.computing = msg.work_unit;
      showWork();
    } else if (msg.type === "rest") {
      resting(msg.ms);
      askForWork();
    } else onWorkUnitMessage(msg);
  }

  function onEngineReady(msg) {
    s.device = { id: deviceId(), backend: msg.backend, gflops: msg.gflops, user_agent: navigator.userAgent };
    if (navigator.deviceMemory) s.device.memory_mb = navigator.deviceMemory * 1024; // Chrome only
    $("speed").textContent = `${msg.gflops} GFLOP/s`;
    $("backend").textContent = t("speed_note", { backend: msg.backend });
    log(t("log_engine_ready", { backend: msg.backend, gflops: msg.gflops }));
    setStatus(t("status_connecting"), "waiting");
    s.engineSince = performance.now();
    s.shareTimer = setInterval(showComputeShare, SHARE_REFRESH_MS);
    connect();
  }

  function onWorkUnitMessage(msg) {
    s.started.delete(msg.work_unit);
    if (s.computing === msg.work_unit) s.computing = null;
    if (msg.type === "result") { // cancelled or not, the device spent this time computing
      s.computeMs += msg.timings.compute_ms;
      if (msg.weights_by === "delta") s.weightsByDelta += 1;
      s.steps.push({ work_unit: msg.work_unit, ...msg.step });
      if (s.steps.length > MAX_STEPS) s.steps.shift();
      resting(msg.rest_ms || 0);
      showComputeShare();
    }
    if (s.cancelled.delete(msg.work_unit)) {
      // Late result (or skip notice) of cancelled work: drop it. Its slot was freed at cancel time.
      showWork();
    } else if (msg.type === "result") {
      onResult(msg);
    } else if (msg.type === "failed") {
      log(t("log_failed", { id: msg.work_unit, error: msg.error }), true);
      s.inFlight.delete(msg.work_unit);
      showWork();
      setTimeout(askForWork, 2000); // don't spin if every unit fails the same way
    }
  }

  function onResult(msg) {
    s.inFlight.delete(msg.work_unit);
    if (msg.sent) s.ring.keep(msg.sent.digest, new Uint8Array(msg.sent.bytes));
    showWork();
    updateRate(msg);
    log(t("log_result", {
      // null: the unit computes no loss (a pipeline stage's but the last); a real 0 still shows.
      id: msg.work_unit, samples: msg.samples, loss: msg.loss === null ? "—" : msg.loss.toFixed(4),
      compute: msg.timings.compute_ms, download: msg.timings.download_ms,
    }));
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
    setStatus(t("status_starting"), "waiting");
    s.ring = new PayloadRing({ sendJson: send, sendBinary: (bytes) => s.socket && s.socket.send(bytes) });
    s.worker = new Worker(WORKER_URL);
    s.worker.onmessage = onWorkerMessage;
    s.worker.onerror = (event) => { log(t("log_engine_crashed", { error: event.message }), true); stop(); };
    s.worker.postMessage({ cmd: "init" });
    applyPause();
  }

  function stop() {
    if (!s.running) return;
    s.running = false;
    for (const timer of [s.reconnectTimer, s.releaseTimer, s.restTimer, s.askTimer]) clearTimeout(timer);
    clearInterval(s.shareTimer);
    if (s.socket) {
      send({ type: "bye" });
      const socket = s.socket;
      s.socket = null;
      socket.close(1000, "bye");
    }
    if (s.worker) s.worker.terminate();
    s.worker = null;
    if (s.ring) s.ring.close();
    setRunning(false);
    setStatus(t("status_stopped"), "idle");
    showPause(null);
    setTitle(null);
    log(t("log_stopped"));
  }

  // For the volunteer's console and the browser tests: the worker's own timestamps of each unit.
  self.crowdtrainContribute = {
    steps: () => s.steps.slice(),
    state: () => ({ pause: s.pause, idle: s.idle, stage: s.stage, weightsByDelta: s.weightsByDelta }),
    ring: () => (s.ring ? { ...s.ring.stats, kept: s.ring.kept.size } : null), // bytes by the peer and relayed
  };

  $("contribute").addEventListener("click", start);
  $("stop").addEventListener("click", stop);
  window.addEventListener("pagehide", stop);
  document.addEventListener("visibilitychange", applyPause);
  for (const type of INPUT_EVENTS) document.addEventListener(type, onInput, { passive: true });
  watchBattery();
})();
