// Stage work units of pipeline mode (docs/pipeline.md): the browser's twin of engine/pipeline.py, run on
// a runtime model of one stage's graph (engine/partition.py makes it; weights may be the whole model's).
// Units are stateless, as BOINC work units are: a forward unit maps a micro-batch's input activation to
// the stage's output and reports the batch-norm statistics it updated without keeping them; a backward
// unit gets the same input again, recomputes the forward (activation recomputation) with the forward
// unit's seed, so dropout draws the same masks, reports that forward's batch-norm statistics too (the
// server applies a backward result's), and backpropagates the output's gradient (or, in the last
// stage, the loss of the targets times the micro-batch's loss scale) to the input and the params.
// Returned tensors belong to the caller. Classic script: attaches to self.crowdtrain.pipeline; needs
// runtime.js and the global `tf`.
(function (ns) {
  "use strict";

  // Seeds travel as JSON numbers: integers beyond 2**53 would reach the page rounded.
  const MAX_SEED = Number.MAX_SAFE_INTEGER;

  const fail = (msg) => { throw new Error(`pipeline: ${msg}`); };

  function checkSeed(seed) {
    if (seed === undefined || seed === null) return undefined; // random masks, as seed=None in Python
    if (!Number.isSafeInteger(seed) || seed < 0) fail(`seed must be an integer from 0 to ${MAX_SEED}, got ${seed}`);
    return seed;
  }

  // A tensor fed for `spec`: int64 specs (token ids, labels) arrive as int32, as everywhere in the engine.
  function checkFeed(spec, t) {
    if (!(t instanceof tf.Tensor)) fail(`${spec.name} must be a tf.Tensor`);
    const fits = t.rank === spec.shape.length && spec.shape.every((d, i) => d === -1 || d === t.shape[i]);
    if (!fits || (spec.dtype === "float32") !== (t.dtype === "float32")) {
      fail(`${spec.name} is [${t.shape}] ${t.dtype}, the stage expects [${spec.shape}] ${spec.dtype}`);
    }
    return t;
  }

  // A stage with one input takes its tensor; the first stage reads the graph's inputs by name.
  function inputFeeds(graph, inputs) {
    if (inputs instanceof tf.Tensor) {
      if (graph.inputs.length !== 1) fail(`this stage takes inputs ${graph.inputs.map((s) => s.name)} by name`);
      inputs = { [graph.inputs[0].name]: inputs };
    }
    const feeds = {};
    for (const spec of graph.inputs) {
      if (!inputs || !inputs[spec.name]) fail(`missing input ${spec.name}`);
      feeds[spec.name] = checkFeed(spec, inputs[spec.name]);
    }
    return feeds;
  }

  function targetFeeds(graph, targets) {
    const feeds = {};
    for (const spec of graph.targets) if (targets[spec.name]) feeds[spec.name] = checkFeed(spec, targets[spec.name]);
    if (!feeds[graph.loss.inputs[1]]) fail(`missing target ${graph.loss.inputs[1]}`);
    return feeds;
  }

  // Buffers an op updates while training (batch norm's running statistics), as Graph.trained_buffers.
  function trainedBuffers(graph) {
    const names = graph.nodes.filter((n) => n.op === "batch_norm").flatMap((n) => [n.inputs[3], n.inputs[4]]);
    return [...new Set(names.filter((name) => name))];
  }

  // Decoded tensors ({name: {shape, data}}, codecs.decode) -> {name: tf.Tensor} for the graph's inputs and
  // targets present, int64 ones as int32. The caller disposes them.
  function feedsFor(graph, decoded) {
    const feeds = {};
    for (const spec of [...graph.inputs, ...graph.targets]) {
      const t = decoded[spec.name];
      if (!t) continue;
      const int = spec.dtype === "int64";
      feeds[spec.name] = tf.tensor(int ? Int32Array.from(t.data) : t.data, t.shape, int ? "int32" : "float32");
    }
    return feeds;
  }

  // The forward unit: {output, buffers: {name: tf.Tensor}, the trained buffers after this micro-batch}.
  // The model's own buffers are left as they were (the worker keeps one model per stage and version).
  function stageForward(model, inputs, { seed, training = true } = {}) {
    const feeds = inputFeeds(model.graph, inputs);
    const r = ns.runtime.forward(model, feeds, { training, seed: checkSeed(seed), update: false });
    return { output: r.output, buffers: stageBuffers(model, r.buffers) };
  }

  // {name: tf.Tensor} for each of the stage's trained buffers: its value after the unit's forward, or (not
  // updated, e.g. in eval mode) the model's own. The other updates are disposed.
  function stageBuffers(model, updates) {
    const buffers = {};
    for (const name of trainedBuffers(model.graph)) {
      buffers[name] = updates[name] || model.buffers[name].clone();
      delete updates[name];
    }
    tf.dispose(Object.values(updates));
    return buffers;
  }

  // The backward unit. Not the last stage: options.outputGrad, the gradient of the output. The last stage:
  // options.targets ({name: tf.Tensor}) and lossScale. inputGrad: whether to return d/d(input), the
  // stage's needs_input_grad (default: when its one input is float32). Returns {inputGrad (or null),
  // grads: {param: tf.Tensor}, loss: the unscaled loss, a scalar tf.Tensor (last stage), else null,
  // buffers: {name: tf.Tensor}, the trained buffers after the recomputed forward, as stageForward's}: the
  // server applies those a backward result reports (docs/protocol.md "Stage units").
  function stageBackward(model, inputs, { outputGrad, targets, lossScale = 1, seed, training = true, inputGrad } = {}) {
    const graph = model.graph, last = targets !== undefined && targets !== null;
    if (last === (outputGrad !== undefined && outputGrad !== null)) {
      fail("a backward unit takes the gradient of its output or, in the last stage, targets: one of them");
    }
    if (!(typeof lossScale === "number" && Number.isFinite(lossScale) && lossScale >= 0)) {
      fail(`lossScale must be finite and non-negative, got ${lossScale}`);
    }
    const feeds = inputFeeds(graph, inputs);
    const wantInput = inputGrad === undefined ? graph.inputs.length === 1 && graph.inputs[0].dtype === "float32" : !!inputGrad;
    if (wantInput && (graph.inputs.length !== 1 || graph.inputs[0].dtype !== "float32")) fail("only a float32 input has a gradient");
    const wrt = wantInput ? [graph.inputs[0].name] : [];
    if (!last && !(outputGrad instanceof tf.Tensor && outputGrad.dtype === "float32")) fail("outputGrad must be a float32 tf.Tensor");
    const dy = last ? tf.scalar(lossScale) : outputGrad;
    try {
      const all = last ? { ...targetFeeds(graph, targets), ...feeds } : feeds;
      const r = ns.runtime.backpropagate(model, all, dy, { fromLoss: last, wrt, training, seed: checkSeed(seed) });
      if (!last) r.value.dispose();
      return {
        inputGrad: wantInput ? r.inputGrads[wrt[0]] : null, grads: r.grads, loss: last ? r.value : null,
        buffers: stageBuffers(model, r.buffers),
      };
    } finally {
      if (last) dy.dispose();
    }
  }

  ns.pipeline = { stageForward, stageBackward, trainedBuffers, feedsFor, MAX_SEED };
})((self.crowdtrain = self.crowdtrain || {}));
