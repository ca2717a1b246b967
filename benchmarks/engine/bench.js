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

  // x as the graph wants it (NCHW, or [N, features]) and as the hand-written model wants it (NHWC).
  function inputsFor(graph, batch) {
    const x = batch.x, y = batch.y;
    const xGraph = tf.tensor(x.data, x.shape, "float32");
    const xHand = x.shape.length === 4 ? tf.transpose(xGraph, [0, 2, 3, 1]) : tf.clone(xGraph);
    const yInt = tf.tensor(Int32Array.from(y.data), y.shape, "int32");
    const classes = graph.params.find((p) => p.name === lastLinear(graph)).shape[0];
    return { xGraph, xHand, yInt, oneHot: tf.tidy(() => tf.oneHot(yInt, classes).toFloat()) };
  }

  function lastLinear(graph) {
    const out = graph.nodes.find((n) => n.name === graph.output);
    return out.inputs[1];
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

  // Alternates which implementation goes first, so drift in machine load hits both alike.
  async function measure(trainers, { steps, reps, warmup }) {
    const times = { interpreter: [], handwritten: [] };
    for (const name of Object.keys(times)) await timeSteps(trainers[name], warmup);
    for (let r = 0; r < reps; r++) {
      const order = r % 2 ? ["handwritten", "interpreter"] : ["interpreter", "handwritten"];
      for (const name of order) times[name].push(await timeSteps(trainers[name], steps));
    }
    return times;
  }

  // config: {backend, model, graphUrl, weightsUrl, batchUrl, steps, reps, warmup}
  async function run(config) {
    const backend = await useBackend(config.backend);
    const graph = ct.graph.load(await fetchBytes(config.graphUrl));
    const weights = ct.codecs.decode(await fetchBytes(config.weightsUrl));
    const batch = ct.codecs.decode(await fetchBytes(config.batchUrl));
    const tensorsBefore = tf.memory().numTensors;
    const model = ct.runtime.createModel(graph, weights);
    const hand = self.handwritten.models[config.model](weights);
    const inputs = inputsFor(graph, batch);
    const interp = interpreterTrainer(model, { x: inputs.xGraph, y: inputs.yInt });
    const handTrainer = self.handwritten.trainer(hand, LR);
    try {
      const relDiff = await logitsDiff(model, hand, inputs);
      const times = await measure({
        interpreter: interp.step, handwritten: () => handTrainer.step(inputs.xHand, inputs.oneHot),
      }, config);
      return { backend, relDiff, ...times };
    } finally {
      interp.dispose();
      handTrainer.dispose();
      model.dispose();
      self.handwritten.dispose(hand);
      tf.dispose(Object.values(inputs));
      if (tf.memory().numTensors !== tensorsBefore) console.warn("benchmark leaked tensors");
    }
  }

  ns.bench = { run, useBackend };
})(self);
