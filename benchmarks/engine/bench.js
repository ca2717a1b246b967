// Benchmark page logic (driven by benchmarks/engine/run.py through Playwright): training steps per
// second of the graph interpreter (frontend/static/engine) vs the hand-written TF.js model, same
// backend, weights and batch. Classic script: attaches to self.bench.
(function (ns) {
  "use strict";
  const ct = self.crowdtrain;
  const LR = 0.01;

  async function useBackend(name) {
    if (!(await tf.setBackend(name))) throw new Error(`backend ${name} failed`);
    await tf.ready();
    return tf.getBackend();
  }

  async function fetchBytes(url) {
    const response = await fetch(url);
    if (!response.ok) throw new Error(`${url}: HTTP ${response.status}`);
    return new Uint8Array(await response.arrayBuffer());
  }

  // x as the graph wants it (NCHW / NCL, or [N, features], or token ids) and as the hand-written model wants
  // it (channels last: NHWC / NLC). y as the graph's target (class ids or floats) and one-hot for TF.js.
  function inputsFor(graph, batch, classes) {
    const x = batch.x, y = batch.y;
    const ints = graph.inputs[0].dtype === "int64";
    const xGraph = ints ? tf.tensor(Int32Array.from(x.data), x.shape, "int32") : tf.tensor(x.data, x.shape, "float32");
    const channelsLast = { 3: [0, 2, 1], 4: [0, 2, 3, 1] }[x.shape.length];
    const xHand = channelsLast && !ints ? tf.transpose(xGraph, channelsLast) : tf.clone(xGraph);
    if (!classes) return { xGraph, xHand, yGraph: tf.tensor(y.data, y.shape, "float32") };
    const yGraph = tf.tensor(Int32Array.from(y.data), y.shape, "int32");
    return { xGraph, xHand, yGraph, oneHot: tf.tidy(() => tf.oneHot(yGraph, classes).toFloat()) };
  }

  function interpreterTrainer(model, feeds) {
    const opt = new ct.optim.SGD(model.params, { lr: LR });
    function step() {
      const g = ct.runtime.gradients(model, feeds, { training: true });
      opt.step(g.grads);
      tf.dispose(Object.values(g.grads));
      return g.loss;
    }
    return { step, dispose: () => opt.dispose() };
  }

  // Milliseconds per step over `steps` steps; reading the last loss waits for the queued GPU work.
  async function timeSteps(step, steps) {
    const t0 = performance.now();
    let loss = null;
    for (let i = 0; i < steps; i++) {
      if (loss) loss.dispose();
      loss = step();
    }
    await loss.data();
    loss.dispose();
    return (performance.now() - t0) / steps;
  }

  // What one step runs, counted rather than timed, so machine load does not move it: TF.js kernels (Reshape
  // and Identity included, which cost no GPU work) and, on WebGL and WebGPU, the shader programs the backend
  // dispatches (layout conversions and uploads included; on SwiftShader each costs about the same fixed time).
  async function kernelsPerStep(step) {
    const engine = tf.engine(), backend = tf.backend();
    const dispatch = ["runWebGLProgram", "runWebGPUProgram"].find((m) => typeof backend[m] === "function");
    const counts = { kernels: 0, programs: dispatch ? 0 : null };
    const counted = (obj, method, key) => {
      const original = obj[method];
      obj[method] = function (...args) { counts[key]++; return original.apply(this, args); };
      return () => { obj[method] = original; };
    };
    const restore = [counted(engine, "runKernel", "kernels"), ...(dispatch ? [counted(backend, dispatch, "programs")] : [])];
    try {
      const loss = step();
      await loss.data();
      loss.dispose();
    } finally {
      restore.forEach((undo) => undo());
    }
    return counts;
  }

  // The engine sets WebGL's elementwise kernels unpacked page-wide (runtime.js, guardPackedTextures), and
  // packs them only within its own steps where that is safe (runtime.js packedSteps); the page-wide setting
  // changes the hand-written model's speed too. It is also timed with TF.js's defaults, and the faster of the
  // two is the yardstick (run.py): its widths are even, which the packed kernels get right.
  function withTfjsDefaults(step) {
    const flags = Object.keys(ct.runtime.SAFE_WEBGL_FLAGS);
    return (...args) => {
      const saved = flags.map((f) => tf.env().getBool(f));
      flags.forEach((f) => tf.env().set(f, tf.env().getBool("WEBGL_PACK")));
      try {
        return step(...args);
      } finally {
        flags.forEach((f, i) => tf.env().set(f, saved[i]));
      }
    };
  }

  // Same weights, eval mode: the two implementations must compute the same logits.
  async function logitsDiff(model, hand, inputs) {
    const a = ct.runtime.forward(model, { x: inputs.xGraph }, { training: false });
    const b = tf.tidy(() => hand.forward(inputs.xHand, false, []));
    const diff = tf.tidy(() => tf.max(tf.abs(tf.sub(a.output, b))));
    const scale = tf.tidy(() => tf.max(tf.abs(b)));
    const [d, s] = [(await diff.data())[0], (await scale.data())[0]];
    tf.dispose([a.output, b, diff, scale]);
    return d / Math.max(s, 1e-12);
  }

  // Steps per repetition and repetitions from a time budget, so a run lasts about as long on any machine:
  // a repetition lasts at least REP_MS (timer and sync overhead stay small), and the repetitions of all
  // trainers together fill budgetMs, within [minReps, maxReps].
  const REP_MS = 250;
  function schedule(msPerStep, trainers, { budgetMs, minReps, maxReps }) {
    const steps = Math.max(1, Math.ceil(REP_MS / msPerStep));
    const reps = Math.floor(budgetMs / (trainers * steps * msPerStep));
    return { steps, reps: Math.min(maxReps, Math.max(minReps, reps)) };
  }

  // Up to `steps` untimed steps (shader compilation, texture allocation), fewer once WARMUP_MS have passed:
  // the first steps on SwiftShader's WebGPU take seconds each.
  const WARMUP_MS = 3000;
  async function warmUp(step, steps) {
    const t0 = performance.now();
    for (let i = 0; i < steps && performance.now() - t0 < WARMUP_MS; i++) await timeSteps(step, 1);
  }

  // Alternates which implementation goes first (ABBAAB...), so drift in machine load hits both alike; rep r
  // of each forms a pair measured back to back. The last warmup step of each sets the schedule.
  async function measure(trainers, config) {
    const names = Object.keys(trainers);
    const times = Object.fromEntries(names.map((name) => [name, []]));
    let msPerStep = 0;
    for (const name of names) {
      await warmUp(trainers[name], config.warmup);
      msPerStep = Math.max(msPerStep, await timeSteps(trainers[name], 1));
    }
    const { steps, reps } = schedule(msPerStep, names.length, config);
    for (let r = 0; r < reps; r++) {
      const order = r % 2 ? [...names].reverse() : names;
      for (const name of order) times[name].push(await timeSteps(trainers[name], steps));
    }
    return { ...times, steps, reps };
  }

  // The hand-written twins to time, each its own model (same weights), so that each keeps its own texture
  // layouts from step to step: under the engine's flags, and on WebGL also under TF.js's defaults.
  function handTwins(config, backend, weights, inputs) {
    if (!config.handwritten) return [];
    const names = backend === "webgl" ? ["handwritten", "handwritten_tfjs_defaults"] : ["handwritten"];
    return names.map((name) => {
      const model = self.handwritten.models[config.model](weights);
      const trainer = self.handwritten.trainer(model, LR);
      const step = () => trainer.step(inputs.xHand, inputs.oneHot);
      return { name, model, trainer, step: name === "handwritten" ? step : withTfjsDefaults(step) };
    });
  }

  // config: {backend, model, graphUrl, weightsUrl, batchUrl, classes, handwritten, warmup, budgetMs, minReps,
  // maxReps}.
  // Without a hand-written twin (config.handwritten false) only the interpreter is timed.
  async function run(config) {
    const backend = await useBackend(config.backend);
    const graph = ct.graph.load(await fetchBytes(config.graphUrl));
    const weights = ct.codecs.decode(await fetchBytes(config.weightsUrl));
    const batch = ct.codecs.decode(await fetchBytes(config.batchUrl));
    const tensorsBefore = tf.memory().numTensors;
    const model = ct.runtime.createModel(graph, weights);
    const inputs = inputsFor(graph, batch, config.classes);
    const interp = interpreterTrainer(model, { x: inputs.xGraph, y: inputs.yGraph });
    const twins = handTwins(config, backend, weights, inputs);
    try {
      const relDiff = twins.length ? await logitsDiff(model, twins[0].model, inputs) : null;
      const trainers = { interpreter: interp.step };
      for (const twin of twins) trainers[twin.name] = twin.step;
      const times = await measure(trainers, config);
      const kernels = {};
      for (const [name, step] of Object.entries(trainers)) kernels[name] = await kernelsPerStep(step);
      return { backend, relDiff, ...times, kernels };
    } finally {
      interp.dispose();
      for (const twin of twins) { twin.trainer.dispose(); self.handwritten.dispose(twin.model); }
      model.dispose();
      tf.dispose(Object.values(inputs));
      if (tf.memory().numTensors !== tensorsBefore) console.warn("benchmark leaked tensors");
    }
  }

  // Whether the browser offers the backend at all (WebGPU needs an adapter: --enable-unsafe-webgpu here).
  async function offers(name) {
    if (name !== "webgpu") return true;
    return !!(navigator.gpu && (await navigator.gpu.requestAdapter()));
  }

  ns.bench = { run, useBackend, offers };
})(self);
