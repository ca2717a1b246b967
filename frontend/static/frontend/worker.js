// Crowdtrain compute worker (classic Web Worker). The page talks to it with postMessage:
//   page -> worker  {cmd: "init", backends?: [..preference order..]}
//                   {cmd: "compute", assign: <work_unit of the protocol's `assign` message>,
//                    payloads?: {input?, output_grad?: ArrayBuffer} (a stage unit's inputs the page got from
//                    the peer ring, already checked against their digests; the others are downloaded)}
//                   {cmd: "cancel", work_unit}
//                   {cmd: "duty", percent}   {cmd: "pause"}   {cmd: "resume"}
// Computes run one at a time in arrival order, but each unit's blobs start downloading as soon as it
// arrives, so a prefetched unit is ready to go when the one before it finishes.
// The volunteer's computing preferences are enforced here, between work units: a unit starts only while not
// paused (the page pauses for a hidden tab, the battery, input) and after the rest the duty cycle asks for
// (compute / (compute + rest) = percent), so a pause stops training within the unit being computed.
//   worker -> page  {type: "ready", backend, gflops}
//                   {type: "started", work_unit}
//                   {type: "result", work_unit, model_version, samples, loss (null: the unit has none),
//                    timings: {download_ms, compute_ms}, bytes: ArrayBuffer (transferred),
//                    weights_by: "cache" | "delta" | "download" (how its weights came: protocol.md, assign),
//                    step: {start, end} (this worker's performance.now()), rest_ms (before the next unit),
//                    sent?: {digest, bytes: ArrayBuffer} (a stage unit's payload for the next volunteer, sent
//                    by the peer ring: `bytes` above then leaves it out, as docs/protocol.md says)}
//                   {type: "rest", ms} (the duty cycle changed: the rest from now)
//                   {type: "failed", work_unit, error}   {type: "cancelled", work_unit}
//                   {type: "init_failed", error}
"use strict";

const VENDOR = "/static/vendor/";
const ENGINE = "/static/engine/";
importScripts(`${VENDOR}tf.min.js`);
// Optional backends: a browser without one must still get webgl/cpu.
for (const script of ["tf-backend-wasm.min.js", "tf-backend-webgpu.min.js"]) {
  try { importScripts(VENDOR + script); } catch (err) { console.warn(`could not load ${script}`, err); }
}
importScripts(`${ENGINE}spec.js`, `${ENGINE}codecs.js`, `${ENGINE}graph.js`, `${ENGINE}runtime.js`, `${ENGINE}optim.js`,
  `${ENGINE}train.js`, `${ENGINE}activations.js`, `${ENGINE}pipeline.js`);

const ct = self.crowdtrain;
const CACHE_BUDGET_BYTES = 768 * 1024 * 1024; // decoded graphs/weights/shards kept by URL
// TF.js's WASM backend lacks some gradient kernels (Conv2DBackpropFilter, MaxPoolGrad,
// UnsortedSegmentSum for embeddings); graphs using them train on the CPU backend there.
const WASM_UNTRAINABLE_OPS = ["conv2d", "max_pool2d", "avg_pool2d", "embedding"];

let chosenBackend = null; // picked at init
let current = null; // {graphKey, weightsKey, backend, model}: stage units keep their stage's model too
const cancelled = new Set();
const cpuGraphs = new Set(); // graph URLs that hit a missing WASM kernel at run time
let queue = Promise.resolve(); // computes run one after another
const feedbacks = new Map(); // project id -> ErrorFeedback: the residual of int8/int4/topk, carried across units

// ---- duty cycle and pauses ----------------------------------------------------------------------
const pacing = {
  duty: 100, // percent of the time spent computing
  paused: false,
  lastCompute: 0, lastEnd: null, // the latest unit's compute time and when it ended
  restUntil: 0,
  wake: null, // ends the current wait early (resume, a new duty cycle)
};

// The rest after `computeMs` of computing that makes compute / (compute + rest) the duty cycle.
function restFor(computeMs) {
  return (computeMs * (100 - pacing.duty)) / pacing.duty;
}

function waitFor(ms) {
  return new Promise((resolve) => {
    const done = () => { clearTimeout(timer); pacing.wake = null; resolve(); };
    const timer = ms === Infinity ? null : setTimeout(done, ms);
    pacing.wake = done;
  });
}

// Resolves once a unit may start: not paused, and rested.
async function ourTurn() {
  for (;;) {
    if (pacing.paused) { await waitFor(Infinity); continue; }
    const rest = pacing.restUntil - performance.now();
    if (rest <= 0) return;
    await waitFor(rest);
  }
}

function setDuty(percent) {
  const [least, most] = ct.spec.protocol.preferences.duty_cycle_percent;
  pacing.duty = Math.min(most, Math.max(least, Number(percent) || most));
  if (pacing.lastEnd !== null) {
    pacing.restUntil = pacing.lastEnd + restFor(pacing.lastCompute);
    self.postMessage({ type: "rest", ms: Math.max(0, pacing.restUntil - performance.now()) });
  }
  if (pacing.wake) pacing.wake();
}

function setPaused(paused) {
  pacing.paused = paused;
  if (!paused && pacing.wake) pacing.wake();
}

// ---- backend selection ------------------------------------------------------------------------
async function usable(name) {
  if (name === "webgl") {
    if (typeof OffscreenCanvas === "undefined") return false;
    return !!new OffscreenCanvas(1, 1).getContext("webgl2");
  }
  if (name === "webgpu") return !!(self.navigator && navigator.gpu && (await navigator.gpu.requestAdapter()));
  if (name === "wasm") {
    if (!tf.wasm) return false;
    tf.wasm.setWasmPaths(VENDOR);
  }
  return true;
}

async function pickBackend(order) {
  for (const name of order) {
    try {
      if (!(await usable(name)) || !(await tf.setBackend(name))) continue;
      await tf.ready();
      // Gradients in half-float textures are useless; such GPUs get the next backend.
      if (name === "webgl" && !tf.env().getBool("WEBGL_RENDER_FLOAT32_CAPABLE")) continue;
      return name;
    } catch (err) {
      console.warn(`backend ${name} unavailable`, err);
    }
  }
  throw new Error("no TensorFlow.js backend available");
}

// Matmul throughput, timed until ~200 ms have passed so slow devices finish quickly.
async function benchmarkGflops() {
  const n = tf.getBackend() === "cpu" ? 128 : 512;
  const a = tf.randomNormal([n, n]), b = tf.randomNormal([n, n]);
  const runs = async (reps) => {
    const t0 = performance.now();
    let c = tf.matMul(a, b);
    for (let i = 1; i < reps; i++) { const next = tf.matMul(c, b); c.dispose(); c = next; }
    await c.data(); // also the only sync point: WebGPU has no dataSync
    c.dispose();
    return performance.now() - t0;
  };
  await runs(1); // warm-up: shader compilation
  let reps = 2, ms = await runs(reps);
  while (ms < 200 && reps < 256) { reps *= 2; ms = await runs(reps); }
  a.dispose(); b.dispose();
  return Math.round(((2 * n ** 3 * reps) / (ms / 1000) / 1e9) * 100) / 100;
}

// ---- downloads (content-addressed: a URL's path names its bytes, so cache by path) -------------
// A shard's query is a grant signed afresh for every work unit; the path stays the same.
const cache = new Map(); // path -> {promise, bytes}; Map order = least recently used first

function evict() {
  let total = 0;
  for (const e of cache.values()) total += e.bytes;
  for (const [url, e] of cache) {
    if (total <= CACHE_BUDGET_BYTES) break;
    if (!e.bytes) continue; // still downloading
    cache.delete(url);
    total -= e.bytes;
  }
}

async function fetchBytes(url) {
  const response = await fetch(url, { credentials: "same-origin" });
  if (!response.ok) throw new Error(`GET ${url}: HTTP ${response.status}`);
  return response.arrayBuffer();
}

// What a decoded blob holds: bytes as they are, or tensors ({name: {shape, data}}); 0 for a graph.
function decodedBytes(value) {
  if (ArrayBuffer.isView(value)) return value.byteLength;
  return Object.values(value).reduce((n, t) => n + (ArrayBuffer.isView(t && t.data) ? t.data.byteLength : 0), 0);
}

// A version's weights: built from the previous version's, when this worker holds them, and the delta the
// server offers (docs/protocol.md, assign): the same values as weights_url's, for a fraction of its bytes.
// Returns {by: "cache" | "delta" | "download", weights: Promise}.
function weightsFor(assign) {
  const delta = assign.weights_delta;
  const base = delta && cache.get(keyOf(delta.base_url));
  if (cache.has(keyOf(assign.weights_url)) || !base) {
    const by = cache.has(keyOf(assign.weights_url)) ? "cache" : "download";
    return { by, weights: cached(assign.weights_url, (buf) => ct.codecs.decode(buf)) };
  }
  const build = async (buf) => ct.codecs.applyDelta(await base.promise, buf);
  return { by: "delta", weights: cached(assign.weights_url, build, delta.url) };
}

// A blob's URL without its grant: stage units' URLs carry one signed afresh for every unit.
const keyOf = (url) => url.split("?")[0];

// `source`: where the bytes come from when not from `url` itself (a delta that builds it).
function cached(url, decode, source = url) {
  const key = keyOf(url);
  let entry = cache.get(key);
  if (entry) {
    cache.delete(key);
    cache.set(key, entry);
    return entry.promise;
  }
  entry = { bytes: 0 };
  entry.promise = fetchBytes(source).then(async (buf) => {
    const value = await decode(buf);
    entry.bytes = Math.max(buf.byteLength, decodedBytes(value));
    evict();
    return value;
  });
  entry.promise.catch(() => cache.delete(key));
  cache.set(key, entry);
  return entry.promise;
}

// ---- slices and models ----------------------------------------------------------------------
function rowsOf(t, offset, count) {
  const per = t.shape.slice(1).reduce((a, b) => a * b, 1);
  if (offset < 0 || offset + count > t.shape[0]) throw new Error(`slice [${offset}, ${offset + count}) out of range`);
  return t.data.subarray(offset * per, (offset + count) * per);
}

// Concatenates [offset, offset+count) of every shard's `key` tensor into one {shape, data}.
function gather(shards, parts, key) {
  const first = shards[0][key];
  const chunks = parts.map((p, i) => rowsOf(shards[i][key], p.offset, p.count));
  const total = parts.reduce((n, p) => n + p.count, 0);
  let data = chunks[0];
  if (chunks.length > 1) {
    data = new first.data.constructor(chunks.reduce((n, c) => n + c.length, 0));
    let pos = 0;
    for (const c of chunks) { data.set(c, pos); pos += c.length; }
  }
  return { shape: [total, ...first.shape.slice(1)], data };
}

async function backendFor(graph, graphUrl) {
  const wasmCannot = ct.graph.hasOp(graph, WASM_UNTRAINABLE_OPS) || cpuGraphs.has(keyOf(graphUrl));
  const want = chosenBackend === "wasm" && wasmCannot ? "cpu" : chosenBackend;
  if (tf.getBackend() !== want) {
    if (current) { current.model.dispose(); current = null; } // variables live on the old backend
    await tf.setBackend(want);
  }
  return want;
}

// One model, kept while units name the same graph (a stage's graph for stage units), its weights set anew
// when the version changes: a volunteer that stays on a stage downloads and uploads them once a version.
async function modelFor(assign, graph, weights) {
  const backend = await backendFor(graph, assign.graph_url);
  const graphKey = keyOf(assign.graph_url), weightsKey = keyOf(assign.weights_url);
  if (current && current.graphKey === graphKey && current.backend === backend) {
    if (current.weightsKey !== weightsKey) current.model.setWeights(weights);
  } else {
    if (current) current.model.dispose();
    current = { graphKey, backend, model: ct.runtime.createModel(graph, weights) };
  }
  current.weightsKey = weightsKey;
  return current.model;
}

// A stage unit's activation or gradient: from the page (the peer ring), else downloaded. Kept by content
// address like every blob, so a backward unit finds its forward unit's input still here.
function payload(url, given) {
  if (given) return Promise.resolve(new Uint8Array(given));
  return url ? cached(url, (buf) => new Uint8Array(buf)) : Promise.resolve(null);
}

async function download(assign, payloads = {}) {
  const t0 = performance.now();
  const source = weightsFor(assign);
  const [graph, weights, input, outputGrad, ...shards] = await Promise.all([
    cached(assign.graph_url, (buf) => ct.graph.load(buf)),
    source.weights,
    payload(assign.input_url, payloads.input),
    payload(assign.output_grad_url, payloads.output_grad),
    ...assign.shards.map((s) => cached(s.url, (buf) => ct.codecs.decode(buf))),
  ]);
  return { graph, weights, shards, input, outputGrad, weightsBy: source.by, ms: performance.now() - t0 };
}

// ---- tasks ---------------------------------------------------------------------------------------
// One residual per project, kept across model versions like the Python simulator does: what int8 drops
// from one update is owed to the project, whichever version the next update is computed on.
// int4 and topk too (topk drops most of each update: feedback is what makes it converge); a project whose
// codec changed starts a fresh residual.
const FEEDBACK_CODECS = ["int8", "int4", "topk"];
function feedbackFor(assign) {
  if (!FEEDBACK_CODECS.includes(assign.codec)) return null;
  const id = assign.project.id;
  const known = feedbacks.get(id);
  if (!known || known.codec !== assign.codec) feedbacks.set(id, new ct.codecs.ErrorFeedback(assign.codec));
  return feedbacks.get(id);
}

function sliceOf(assign, d) {
  const x = gather(d.shards, assign.shards, "x");
  return { x, y: gather(d.shards, assign.shards, "y"), batchSize: Math.max(1, assign.batch_size || x.shape[0]) };
}

// Each task -> {bytes: Uint8Array (the encoded update), loss, samples}.
const TASKS = {
  async gradient(model, assign, { x, y, batchSize }) {
    const r = await ct.train.sliceGradients(model, x, y, { batchSize, codec: assign.codec || "fp32", feedback: feedbackFor(assign) });
    return { bytes: r.grads, loss: r.loss, samples: r.samples };
  },
  async local_steps(model, assign, { x, y, batchSize }) {
    const local = assign.local || {};
    if ((local.optimizer || "sgd") !== "sgd") throw new Error(`unsupported local optimizer ${local.optimizer}`);
    const r = await ct.train.localSteps(model, x, y, {
      batchSize: local.batch_size || batchSize, lr: local.lr, momentum: local.momentum || 0,
      codec: assign.codec || "fp32", feedback: feedbackFor(assign),
    });
    return { bytes: r.delta, loss: r.loss, samples: r.samples };
  },
};

// ---- stage units (pipeline mode: docs/protocol.md "Stage units") ------------------------------------
const LENGTH_BYTES = 8; // a backward frame starts with the input gradient's length, 8 bytes little-endian

// Activations and gradients come from other volunteers: decoded against the shape the server states.
function decodedTensor(bytes, shape, kind, codec) {
  const d = ct.activations.decode(bytes, shape, { kind, codec });
  return tf.tensor(d.data, d.shape, "float32");
}

function stageFeeds(model, assign, d) {
  const st = assign.stage, graph = model.graph, count = assign.batch_size;
  const { x, y } = sliceOf(assign, d);
  const named = st.index === 0 ? { [graph.inputs[0].name]: x } : {};
  if (st.last) named[graph.loss.inputs[1]] = y;
  const feeds = ct.pipeline.feedsFor(graph, named);
  if (st.index > 0) {
    const shape = st.input_shape || [count, ...graph.inputs[0].shape.slice(1)];
    feeds[graph.inputs[0].name] = decodedTensor(d.input, shape, "activation", assign.activation_codec);
  }
  const inputs = Object.fromEntries(graph.inputs.map((s) => [s.name, feeds[s.name]]));
  const targets = st.last ? { [graph.loss.inputs[1]]: feeds[graph.loss.inputs[1]] } : null;
  return { inputs, targets, all: Object.values(feeds) };
}

async function encodedActivation(t, kind, codec) {
  return ct.activations.encode(await t.data(), t.shape, { codec, kind });
}

async function encodedGrads(grads) {
  const named = {};
  for (const [name, t] of Object.entries(grads)) named[name] = { shape: t.shape, data: await t.data() };
  return Object.keys(named).length ? ct.codecs.encode(named, "fp32") : new Uint8Array(0);
}

function framed(inputGrad, grads) {
  const out = new Uint8Array(LENGTH_BYTES + inputGrad.length + grads.length);
  new DataView(out.buffer).setBigUint64(0, BigInt(inputGrad.length), true);
  out.set(inputGrad, LENGTH_BYTES);
  out.set(grads, LENGTH_BYTES + inputGrad.length);
  return out;
}

// -> {bytes: the result's frame, loss, samples, sent: the payload for the next volunteer when the assign
// lets it go by the peer ring (then left out of `bytes`)}.
async function stageTask(model, assign, d) {
  const st = assign.stage, codec = assign.activation_codec, byRing = !!(assign.ring && assign.ring.send);
  const { inputs, targets, all } = stageFeeds(model, assign, d);
  const one = model.graph.inputs.length === 1 ? inputs[model.graph.inputs[0].name] : inputs;
  const made = [];
  try {
    if (st.kind === "forward") {
      const r = ct.pipeline.stageForward(model, one, { seed: st.seed, training: true });
      made.push(r.output, ...Object.values(r.buffers));
      const out = await encodedActivation(r.output, "activation", codec);
      return { bytes: byRing ? new Uint8Array(0) : out, sent: byRing ? out : null, loss: null, samples: assign.batch_size };
    }
    let outputGrad;
    if (!st.last) {
      outputGrad = decodedTensor(d.outputGrad, st.output_shape, "gradient", codec);
      made.push(outputGrad);
    }
    const r = ct.pipeline.stageBackward(model, one, {
      outputGrad, targets, lossScale: st.loss_scale === null ? 1 : st.loss_scale, seed: st.seed, training: true,
      inputGrad: st.needs_input_grad,
    });
    made.push(...Object.values(r.grads), ...Object.values(r.buffers), r.inputGrad, r.loss);
    const inputGrad = r.inputGrad ? await encodedActivation(r.inputGrad, "gradient", codec) : new Uint8Array(0);
    // The stage's batch-norm statistics after the recomputed forward go beside the parameter gradients,
    // named as the buffers: the server applies them, and refuses a result of such a stage without them.
    const grads = await encodedGrads({ ...r.grads, ...r.buffers });
    const loss = r.loss ? (await r.loss.data())[0] : null; // only the last stage computes one
    const sent = byRing && inputGrad.length ? inputGrad : null;
    return { bytes: framed(sent ? new Uint8Array(0) : inputGrad, grads), sent, loss, samples: assign.batch_size };
  } finally {
    tf.dispose([...all, ...made].filter(Boolean));
  }
}

async function runTask(assign, d) {
  if (assign.stage) return stageTask(await modelFor(assign, d.graph, d.weights), assign, d);
  const task = TASKS[assign.task || "gradient"];
  if (!task) throw new Error(`unknown task ${assign.task}`);
  const model = await modelFor(assign, d.graph, d.weights);
  return task(model, assign, sliceOf(assign, d));
}

// A kernel missing on WASM shows up only when the graph runs: retry that graph on the CPU backend.
// (Tasks encode only after computing, so a failed attempt never touches the int8 residual.)
async function runTaskWithFallback(assign, d) {
  try {
    return await runTask(assign, d);
  } catch (err) {
    const missingKernel = /not registered for backend 'wasm'/.test(String(err && err.message));
    if (!missingKernel || cpuGraphs.has(keyOf(assign.graph_url))) throw err;
    cpuGraphs.add(keyOf(assign.graph_url));
    return runTask(assign, d);
  }
}

async function compute(assign, downloading) {
  const d = await downloading;
  const t0 = performance.now();
  const r = await runTaskWithFallback(assign, d);
  const end = performance.now();
  pacing.lastCompute = end - t0;
  pacing.lastEnd = end;
  pacing.restUntil = end + restFor(pacing.lastCompute);
  return {
    type: "result", work_unit: assign.id, model_version: assign.model_version, samples: r.samples, loss: r.loss,
    timings: { download_ms: Math.round(d.ms), compute_ms: Math.round(end - t0) }, bytes: ownBuffer(r.bytes),
    weights_by: d.weightsBy, step: { start: t0, end }, rest_ms: restFor(pacing.lastCompute),
    sent: r.sent ? { digest: await ct.activations.digest(r.sent), bytes: ownBuffer(r.sent) } : undefined,
  };
}

function ownBuffer(bytes) {
  return bytes.buffer.byteLength === bytes.byteLength ? bytes.buffer : bytes.slice().buffer;
}

async function runCompute(assign, downloading) {
  await ourTurn();
  if (cancelled.delete(assign.id)) { self.postMessage({ type: "cancelled", work_unit: assign.id }); return; }
  self.postMessage({ type: "started", work_unit: assign.id });
  try {
    const result = await compute(assign, downloading);
    self.postMessage(result, result.sent ? [result.bytes, result.sent.bytes] : [result.bytes]);
  } catch (err) {
    self.postMessage({ type: "failed", work_unit: assign.id, error: String((err && err.message) || err) });
  } finally {
    cancelled.delete(assign.id); // a cancel that arrived mid-compute; the page drops the result
  }
}

// ---- messages -----------------------------------------------------------------------------------
self.onmessage = (event) => {
  const msg = event.data || {};
  if (msg.cmd === "init") {
    queue = queue.then(async () => {
      try {
        chosenBackend = await pickBackend(msg.backends || ["webgl", "webgpu", "wasm", "cpu"]);
        self.postMessage({ type: "ready", backend: chosenBackend, gflops: await benchmarkGflops() });
      } catch (err) {
        self.postMessage({ type: "init_failed", error: String((err && err.message) || err) });
      }
    });
  } else if (msg.cmd === "compute") {
    // Start downloading now, while an earlier unit may still be computing (prefetch).
    const downloading = download(msg.assign, msg.payloads);
    downloading.catch(() => {}); // reported by runCompute when its turn comes
    queue = queue.then(() => runCompute(msg.assign, downloading));
  } else if (msg.cmd === "cancel") {
    cancelled.add(msg.work_unit); // only skips work not yet started; the page drops late results
  } else if (msg.cmd === "duty") {
    setDuty(msg.percent);
  } else if (msg.cmd === "pause" || msg.cmd === "resume") {
    setPaused(msg.cmd === "pause");
  }
};
