// The browser's side of the facts it shares with the server (engine/spec.json), checked in Node without a
// browser: spec.js is the current text of that file, graph.js and runtime.js implement exactly its ops and
// validate by its rules, and the Contribute page speaks its protocol. Run with `node --test tests/js/`.
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { test } from "node:test";
import vm from "node:vm";

const ROOT = new URL("../../", import.meta.url);
const read = (path) => readFileSync(new URL(path, ROOT), "utf8");
const SPEC = JSON.parse(read("engine/spec.json"));
const OPS = SPEC.graph.ops;
const LOSSES = SPEC.graph.losses;

// Classic scripts in a fresh global whose `self` is the global itself, as in a page or a worker.
function load(files, globals = {}) {
  const context = vm.createContext({ ...globals });
  context.self = context.window = context;
  for (const file of files) vm.runInContext(read(file), context, { filename: file });
  return context;
}

// Values made in another realm have that realm's prototypes; deepStrictEqual compares those too.
const here = (value) => JSON.parse(JSON.stringify(value));

const engine = () => load(["frontend/static/engine/spec.js", "frontend/static/engine/graph.js",
  "frontend/static/engine/runtime.js"]).crowdtrain;

test("spec.js carries engine/spec.json (else run `python -m engine.spec`)", () => {
  assert.deepStrictEqual(here(engine().spec), SPEC);
});

test("runtime.js implements exactly the spec's ops and losses", () => {
  const { runtime } = engine();
  assert.deepStrictEqual(Object.keys(runtime.OPS).sort(), Object.keys(OPS).sort());
  assert.deepStrictEqual(Object.keys(runtime.LOSSES).sort(), Object.keys(LOSSES).sort());
});

// ---- graph.js validates by the spec ---------------------------------------------------------------
const SAMPLE = { int: 1, int_or_none: null, float: 0.5, bool: true, ints: [1], pair: [1, 1], pair_or_none: null };
const sample = (a) => (a.kind === "str" ? a.choices[0] : SAMPLE[a.kind]);
const attrsOf = (op) => Object.entries(OPS[op].attrs || {});
const required = (op) =>
  Object.fromEntries(attrsOf(op).filter(([, a]) => !("default" in a)).map(([k, a]) => [k, sample(a)]));
const defaults = (op) => Object.fromEntries(attrsOf(op).map(([k, a]) => [k, "default" in a ? a.default : sample(a)]));

// One node of `op` over a float input and params named after its slots.
function graphWith(op, { inputs, attrs = required(op) } = {}) {
  const slots = OPS[op].inputs.map((s) => s.replace(/[?*]$/, ""));
  const params = slots.slice(1).map((name) => ({ name, shape: [4], dtype: "float32" }));
  return {
    format: SPEC.graph.format, version: SPEC.graph.version, name: "g",
    inputs: [{ name: slots[0], shape: [-1, 4], dtype: "float32" }],
    targets: [{ name: "y", shape: [-1], dtype: "int64" }],
    params, nodes: [{ name: "n", op, inputs: inputs || slots, attrs }], output: "n",
    loss: { op: Object.keys(LOSSES)[0], inputs: ["n", "y"] },
  };
}

test("graph.js accepts every op of the spec with its inputs and fills in its defaults", () => {
  const { graph } = engine();
  for (const op of Object.keys(OPS)) {
    const loaded = graph.load(JSON.stringify(graphWith(op)));
    assert.deepStrictEqual(here(loaded.nodes[0].attrs), defaults(op), op);
  }
});

test("graph.js holds every op to its input slots and attrs", () => {
  const { graph } = engine();
  for (const [op, spec] of Object.entries(OPS)) {
    const slots = graphWith(op).nodes[0].inputs;
    const variadic = spec.inputs.at(-1).endsWith("*");
    assert.throws(() => graph.validate(graphWith(op, { inputs: variadic ? [] : slots.slice(1) })), /inputs/, op);
    spec.inputs.forEach((slot, i) => {
      const nulled = slots.map((name, j) => (j === i ? null : name));
      if (slot.endsWith("?")) graph.validate(graphWith(op, { inputs: nulled }));
      else assert.throws(() => graph.validate(graphWith(op, { inputs: nulled })), /may not be null/, `${op} ${slot}`);
    });
    assert.throws(() => graph.validate(graphWith(op, { attrs: { ...required(op), bogus: 1 } })), /unknown attrs/, op);
    for (const key of Object.keys(required(op))) {
      const { [key]: _, ...missing } = required(op);
      assert.throws(() => graph.validate(graphWith(op, { attrs: missing })), /missing required attr/, `${op} ${key}`);
    }
  }
});

// Per kind: values the server accepts (engine/graph.py, _norm_attr) and values it refuses.
const KIND_VALUES = {
  int: [[0, -3, 2147483647], [1.5, true, "1", null, [1], 2147483648]],
  int_or_none: [[null, 0, -1, 7], [1.5, false, "0", [0], {}]],
  float: [[0, 0.5, -2], ["0.5", true, null, [0.5]]],
  bool: [[true, false], [0, 1, "true", null]],
  ints: [[[], [1, -1]], [1, [1.5], ["1"], null]],
  pair: [[2, [1, 2]], [[1], [1, 2, 3], null, [1.5, 1]]],
  pair_or_none: [[null, 2, [1, 2]], [[1], "2", [null, 1]]],
};

test("graph.js checks every attr kind of the spec as the server does", () => {
  const { graph } = engine();
  for (const [op, spec] of Object.entries(OPS)) {
    for (const [key, a] of Object.entries(spec.attrs || {})) {
      const [good, bad] = a.kind === "str" ? [a.choices, ["bogus", 1, null]] : KIND_VALUES[a.kind];
      assert.ok(good, `no test values for kind ${a.kind}`);
      for (const value of good) graph.validate(graphWith(op, { attrs: { ...required(op), [key]: value } }));
      for (const value of bad) {
        const g = graphWith(op, { attrs: { ...required(op), [key]: value } });
        assert.throws(() => graph.validate(g), new RegExp(`attr ${key}: invalid value`), `${op} ${key} ${value}`);
      }
    }
  }
});

test("graph.js knows no op and no loss the spec does not name", () => {
  const { graph } = engine();
  for (const op of ["constructor", "toString", "__proto__", "conv3d"]) {
    const g = graphWith("relu");
    g.nodes[0].op = op;
    assert.throws(() => graph.validate(g), /unknown op/, op);
    assert.throws(() => graph.validate({ ...graphWith("relu"), loss: { op, inputs: ["n", "y"] } }), /unknown op/);
  }
  for (const op of Object.keys(LOSSES)) graph.validate({ ...graphWith("relu"), loss: { op, inputs: ["n", "y"] } });
});

test("graph.js fills in loss attrs and takes class weights only from a buffer, as the server does", () => {
  const { graph } = engine();
  const base = { ...graphWith("relu"), buffers: [{ name: "cw", shape: [4], dtype: "float32" }] };
  const withLoss = (loss) => graph.validate({ ...base, loss: { op: "cross_entropy", ...loss } });
  for (const op of Object.keys(LOSSES)) {
    const { attrs } = graph.validate({ ...base, loss: { op, inputs: ["n", "y"] } }).loss;
    assert.deepStrictEqual(here(attrs), Object.fromEntries(Object.entries(LOSSES[op].attrs || {}).map(([k, a]) => [k, a.default])));
  }
  assert.deepStrictEqual(here(withLoss({ inputs: ["n", "y", "cw"] }).loss.inputs), ["n", "y", "cw"]);
  assert.deepStrictEqual(here(withLoss({ inputs: ["n", "y", null] }).loss.inputs), ["n", "y"]);
  assert.equal(withLoss({ inputs: ["n", "y"], attrs: { ignore_index: 3 } }).loss.attrs.ignore_index, 3);
  for (const inputs of [["n", "y", "x"], ["n", "y", "cw", "cw"], ["x", "y"], ["n", "cw"], ["n"]]) {
    assert.throws(() => withLoss({ inputs }), /loss inputs/, JSON.stringify(inputs));
  }
  assert.throws(() => graph.validate({ ...base, loss: { op: "mse", inputs: ["n", "y", "cw"] } }), /loss inputs/);
  assert.throws(() => withLoss({ inputs: ["n", "y"], attrs: { reduction: "sum" } }), /unknown attrs/);
});

test("graph.js applies the spec's format, names, dtypes and limits", () => {
  const { graph } = engine();
  const { limits } = SPEC.graph;
  const base = { ...graphWith("relu"), loss: undefined };
  assert.throws(() => graph.validate({ ...base, version: SPEC.graph.version + 1 }), /not crowdtrain/);
  const relu = (i) => ({ name: `n${i}`, op: "relu", inputs: ["x"], attrs: {} });
  const nodes = (count) => ({ ...base, nodes: Array.from({ length: count }, (_, i) => relu(i)), output: "n0" });
  graph.validate(nodes(limits.nodes));
  assert.throws(() => graph.validate(nodes(limits.nodes + 1)), /too many nodes/);
  const named = (name) => ({ ...base, nodes: [{ ...relu(0), name }], output: name });
  graph.validate(named("a".repeat(limits.name_length)));
  assert.throws(() => graph.validate(named("a".repeat(limits.name_length + 1))), /bad node name/);
  assert.throws(() => graph.validate(named("a b")), /bad node name/);
  const param = (count, dtype = "float32") => ({ name: "p", shape: [count], dtype });
  const withParam = (p) => ({ ...base, params: [p] });
  graph.validate(withParam(param(limits.param_elements)));
  assert.throws(() => graph.validate(withParam(param(limits.param_elements + 1))), /too many parameter elements/);
  for (const dtype of ["int64", "float16"].filter((d) => !SPEC.graph.dtypes.params.includes(d))) {
    assert.throws(() => graph.validate(withParam(param(1, dtype))), /bad dtype/);
  }
});

// ---- the Contribute page speaks the spec's protocol ---------------------------------------------------
// Just enough DOM, Worker and WebSocket for contribute.js; `sent` collects its frames, `lines` its log.
function contributePage({ storedId = null } = {}) {
  const page = { sent: [], lines: [], sockets: [], workers: [], timers: [], stored: storedId };
  const element = () => ({
    dataset: {}, children: [], listeners: {}, textContent: "", disabled: false,
    addEventListener(type, fn) { this.listeners[type] = fn; },
    append(...parts) { this.text = parts.map((p) => (typeof p === "string" ? p : p.textContent)).join(" "); },
    prepend(li) { page.lines.push(li.text); },
  });
  const elements = new Map();
  const document = {
    title: "Contribute", hidden: false, addEventListener() {},
    getElementById: (id) => elements.get(id) || elements.set(id, element()).get(id),
    createElement: () => element(),
  };
  // The template's translated texts (frontend/contribute_page.py), those these tests read.
  document.getElementById("contribute-strings").textContent = JSON.stringify({
    status_reconnecting: "%(why)s, retrying in %(seconds)s s…", throttled: "Too many connections",
    connection_lost: "Connection lost", log_unknown_type: "unknown message type %(type)s",
    log_bad_message: "bad server message: %(error)s",
    log_result: "work unit %(id)s: %(samples)s samples, loss %(loss)s, %(compute)s ms compute, %(download)s ms download",
    recent_average: "%(credit)s crédits/jour", decimal_separator: ",", thousand_separator: "\u00a0",
  });
  class Worker { constructor() { page.workers.push(this); } postMessage() {} terminate() {} }
  class WebSocket {
    static OPEN = 1;
    constructor(url) { this.url = url; this.readyState = 0; page.sockets.push(this); }
    send(data) { if (typeof data === "string") page.sent.push(JSON.parse(data)); } // not a result's bytes
    close() {}
  }
  const localStorage = { getItem: () => page.stored, setItem: (key, value) => { page.stored = value; } };
  page.window = load(["frontend/static/engine/spec.js", "frontend/static/frontend/backoff.js", "frontend/static/frontend/ring.js",
    "frontend/static/frontend/contribute.js"], {
    document, Worker, WebSocket, localStorage, crypto, performance, TextEncoder, TextDecoder, location: { protocol: "http:", host: "test" },
    setTimeout: (fn, ms) => page.timers.push(ms), clearTimeout: () => {}, setInterval: () => 0, clearInterval: () => {},
    navigator: { userAgent: "node" }, addEventListener: () => {},
  });
  page.$ = document.getElementById;
  return page;
}

// Clicks Contribute, lets the engine report ready and the socket open: the page says hello.
function connected(page) {
  page.$("contribute").listeners.click();
  page.workers[0].onmessage({ data: { type: "ready", backend: "cpu", gflops: 1 } });
  const socket = page.sockets[0];
  socket.readyState = socket.constructor.OPEN;
  socket.onopen();
  return (msg) => socket.onmessage({ data: JSON.stringify(msg) });
}

const assign = (id) => ({ type: "assign", work_unit: { id, project: { id: 1, name: "p" }, shards: [{ count: 1 }] } });

test("the Contribute page says hello in the spec's protocol version, with a device id of its pattern", () => {
  const page = contributePage({ storedId: "not valid!" });
  connected(page);
  const hello = page.sent[0];
  assert.equal(hello.type, "hello");
  assert.equal(hello.protocol, SPEC.protocol.version);
  assert.match(hello.device.id, new RegExp(SPEC.protocol.device_id_pattern));
  assert.notEqual(hello.device.id, "not valid!");
  const kept = contributePage({ storedId: "browser-0123456789" });
  connected(kept);
  assert.equal(kept.sent[0].device.id, "browser-0123456789");
});

test("the Contribute page holds at most the spec's MAX_IN_FLIGHT work units", () => {
  const page = contributePage();
  const receive = connected(page);
  for (let id = 1; id <= SPEC.protocol.max_in_flight + 2; id++) receive(assign(id));
  const readies = page.sent.filter((m) => m.type === "ready").length;
  assert.equal(readies, SPEC.protocol.max_in_flight);
  assert.ok(page.sent.every((m) => SPEC.protocol.client_messages.includes(m.type)));
});

test("the Contribute page handles every server message type of the spec, and only those", () => {
  const page = contributePage();
  const receive = connected(page);
  const fields = { work_units: [], work_unit: 1, status: "valid", credit_flops: 0, code: "x", message: "m" };
  for (const type of SPEC.protocol.server_messages) {
    receive(type === "assign" ? assign(9) : { type, ...fields });
  }
  assert.deepStrictEqual(page.lines.filter((line) => /unknown message type|bad server message/.test(line)), []);
  receive({ type: "surprise" });
  assert.match(page.lines.at(-1), /unknown message type surprise/);
});

test("the Contribute page waits a minute after the spec's throttled close code, less after others", () => {
  const throttled = contributePage();
  connected(throttled);
  throttled.sockets[0].onclose({ code: SPEC.protocol.close_codes.throttled });
  assert.match(throttled.$("status").textContent, /Too many connections/);
  assert.ok(throttled.timers.at(-1) >= 45000);
  const dropped = contributePage();
  connected(dropped);
  dropped.sockets[0].onclose({ code: 1006 });
  assert.match(dropped.$("status").textContent, /Connection lost/);
  assert.ok(dropped.timers.at(-1) < 2000);
});

const workerResult = (id, loss) => ({
  type: "result", work_unit: id, model_version: 1, samples: 8, loss, timings: { download_ms: 1, compute_ms: 2 },
  step: { start: 0, end: 2 }, rest_ms: 0, bytes: new ArrayBuffer(1),
});

test("the Contribute page logs no loss for a unit without one, and sends null for it", () => {
  const page = contributePage();
  const receive = connected(page);
  receive({ type: "welcome", volunteer: { username: "ann", credit_flops: 0 } });
  page.workers[0].onmessage({ data: workerResult(1, null) }); // a pipeline stage unit but the last stage's
  assert.match(page.lines.at(-1), /work unit 1: 8 samples, loss —, /);
  page.workers[0].onmessage({ data: workerResult(2, 0) }); // a real 0 still shows
  assert.match(page.lines.at(-1), /work unit 2: 8 samples, loss 0\.0000, /);
  assert.deepStrictEqual(page.sent.filter((m) => m.type === "result").map((m) => m.loss), [null, 0]);
});

test("the Contribute page shows the server's recent average with the highest total, as the template does", () => {
  const page = contributePage();
  const receive = connected(page);
  const shown = () => page.$("recent-average").textContent;
  receive({ type: "welcome", volunteer: { username: "ann", credit_flops: 10, recent_credit: 1234.6 } });
  assert.equal(shown(), "1\u00a0235 crédits/jour");
  const verdict = { type: "credit", work_unit: 1, status: "valid", credit_flops: 5, total_credit_flops: 15 };
  receive({ ...verdict, recent_credit: 0.000116 });
  assert.equal(shown(), "0,000116 crédits/jour");
  assert.equal(page.$("recent-average").dataset.credit, "0.000116");
  // An ack read before that grant, arriving after it: its average would undo the grant.
  receive({ type: "ack", work_unit: 2, accepted: true, status: "pending", total_credit_flops: 10, recent_credit: 1 });
  assert.equal(shown(), "0,000116 crédits/jour");
  receive({ ...verdict, total_credit_flops: 20, recent_credit: 12.345 });
  assert.equal(shown(), "12,35 crédits/jour");
});
