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
    const hand = config.handwritten ? self.handwritten.models[config.model](weights) : null;
    const inputs = inputsFor(graph, batch, config.classes);
    const interp = interpreterTrainer(model, { x: inputs.xGraph, y: inputs.yGraph });
    const handTrainer = hand ? self.handwritten.trainer(hand, LR) : null;
    try {
      const relDiff = hand ? await logitsDiff(model, hand, inputs) : null;
      const trainers = { interpreter: interp.step };
      if (hand) trainers.handwritten = () => handTrainer.step(inputs.xHand, inputs.oneHot);
      return { backend, relDiff, ...(await measure(trainers, config)) };
    } finally {
      interp.dispose();
      if (hand) { handTrainer.dispose(); self.handwritten.dispose(hand); }
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
