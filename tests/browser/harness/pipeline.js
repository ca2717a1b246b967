// Test-only glue for pipeline mode (tests/browser/test_pipeline.py): stage work units and activation
// blobs in and out of the page as base64 safetensors. Attaches self.pipelineHarness.
"use strict";
(function () {
  const ct = self.crowdtrain;

  const { fromB64, toB64 } = self.harnessB64;

  const decodeB64 = (s) => ct.codecs.decode(fromB64(s));

  async function namedB64(named) {
    const list = [];
    for (const [name, t] of Object.entries(named)) list.push({ name, shape: t.shape, data: await t.data() });
    return toB64(ct.codecs.encode(list, "fp32"));
  }

  function modelFor(graphJson, weights) {
    return ct.runtime.createModel(ct.graph.load(graphJson), weights);
  }

  // Largest change of any param or buffer from `weights`: units must leave the cached model as they found it.
  async function moved(model, weights) {
    let most = 0;
    for (const [name, v] of Object.entries({ ...model.params, ...model.buffers })) {
      const now = await v.data(), was = weights[name].data;
      for (let i = 0; i < now.length; i++) most = Math.max(most, Math.abs(now[i] - was[i]));
    }
    return most;
  }

  function inputsOf(graph, feeds) {
    return Object.fromEntries(graph.inputs.map((s) => [s.name, feeds[s.name]]));
  }

  async function stageForward(graphJson, weightsB64, inputsB64, seed, training) {
    const weights = decodeB64(weightsB64), model = modelFor(graphJson, weights);
    const feeds = ct.pipeline.feedsFor(model.graph, decodeB64(inputsB64));
    const before = tf.memory().numTensors;
    try {
      const r = ct.pipeline.stageForward(model, inputsOf(model.graph, feeds), { seed, training });
      const out = { output: await namedB64({ output: r.output }), buffers: await namedB64(r.buffers) };
      tf.dispose([r.output, ...Object.values(r.buffers)]);
      return { ...out, leaked: tf.memory().numTensors - before, moved: await moved(model, weights), backend: tf.getBackend() };
    } finally {
      tf.dispose(Object.values(feeds));
      model.dispose();
    }
  }

  // gradB64: {grad} for a stage that is not the last, else null and targetsB64 holds the targets.
  async function stageBackward(graphJson, weightsB64, inputsB64, gradB64, targetsB64, lossScale, seed, training, inputGrad) {
    const weights = decodeB64(weightsB64), model = modelFor(graphJson, weights), graph = model.graph;
    const feeds = ct.pipeline.feedsFor(graph, decodeB64(inputsB64));
    const targets = targetsB64 ? ct.pipeline.feedsFor(graph, decodeB64(targetsB64)) : null;
    const grad = gradB64 ? decodeB64(gradB64).grad : null;
    const outputGrad = grad ? tf.tensor(grad.data, grad.shape, "float32") : undefined;
    const before = tf.memory().numTensors;
    try {
      const r = ct.pipeline.stageBackward(model, inputsOf(graph, feeds), { outputGrad, targets, lossScale, seed, training, inputGrad });
      const out = {
        grads: await namedB64(r.grads),
        inputGrad: r.inputGrad ? await namedB64({ input: r.inputGrad }) : null,
        loss: r.loss ? (await r.loss.data())[0] : null,
        buffers: await namedB64(r.buffers),
      };
      tf.dispose([...Object.values(r.grads), ...Object.values(r.buffers), r.inputGrad, r.loss].filter(Boolean));
      return { ...out, leaked: tf.memory().numTensors - before, moved: await moved(model, weights), backend: tf.getBackend() };
    } finally {
      tf.dispose([...Object.values(feeds), ...Object.values(targets || {}), outputGrad].filter(Boolean));
      model.dispose();
    }
  }

  // A blob's trip from one stage's volunteer to the next: encoded, decoded, back on the device. `sent`
  // keeps every blob (base64) by kind, for the server to replay.
  async function send(t, kind, codec, blockSize, sent) {
    const blob = ct.activations.encode(await t.data(), t.shape, { codec, kind, blockSize });
    sent[kind].push(toB64(blob));
    const d = ct.activations.decode(blob, t.shape, { kind, codec });
    return tf.tensor(d.data, d.shape, "float32");
  }

  function addInto(total, grads) {
    for (const [name, g] of Object.entries(grads)) {
      if (total[name]) { const sum = tf.add(total[name], g); total[name].dispose(); g.dispose(); total[name] = sum; }
      else total[name] = g;
    }
  }

  // One micro-batch through every stage in this page, activations and gradients sent under `codec`:
  // forward units in order, the last stage's unit, backward units in reverse. Returns the summed grads
  // (tied weights add up), the loss and the blobs sent: activations from stage 0 on, gradients from the
  // last stage back.
  async function chain(stageJsons, needsInputGrad, weightsB64, batchB64, seeds, codec, blockSize) {
    const weights = decodeB64(weightsB64), batch = decodeB64(batchB64);
    const models = stageJsons.map((json) => modelFor(json, weights));
    const last = models.length - 1, sent = { activation: [], gradient: [] };
    const first = ct.pipeline.feedsFor(models[0].graph, batch);
    const targets = ct.pipeline.feedsFor(models[last].graph, batch);
    const acts = [inputsOf(models[0].graph, first)], total = {};
    try {
      for (let k = 0; k < last; k++) {
        const r = ct.pipeline.stageForward(models[k], acts[k], { seed: seeds[k] });
        tf.dispose(Object.values(r.buffers));
        acts.push(await send(r.output, "activation", codec, blockSize, sent));
        r.output.dispose();
      }
      const end = ct.pipeline.stageBackward(models[last], acts[last], { targets, seed: seeds[last], inputGrad: needsInputGrad[last] });
      const loss = (await end.loss.data())[0];
      tf.dispose([end.loss, ...Object.values(end.buffers)]);
      addInto(total, end.grads);
      let grad = end.inputGrad;
      for (let k = last - 1; k >= 0 && grad; k--) {
        const g = await send(grad, "gradient", codec, blockSize, sent);
        grad.dispose();
        const u = ct.pipeline.stageBackward(models[k], acts[k], { outputGrad: g, seed: seeds[k], inputGrad: needsInputGrad[k] });
        tf.dispose([g, ...Object.values(u.buffers)]);
        addInto(total, u.grads);
        grad = u.inputGrad;
      }
      if (grad) grad.dispose();
      return { grads: await namedB64(total), loss, sent };
    } finally {
      tf.dispose([...Object.values(total), ...Object.values(first), ...Object.values(targets), ...acts.slice(1)]);
      models.forEach((m) => m.dispose());
    }
  }

  function activationsEncode(tensorB64, codec, kind, blockSize) {
    const t = decodeB64(tensorB64).x;
    return toB64(ct.activations.encode(t.data, t.shape, { codec, kind, blockSize }));
  }

  // {tensor: base64 fp32 safetensors} or {error: the message} for refused bytes.
  function activationsDecode(blobB64, shape, kind, codec) {
    try {
      const d = ct.activations.decode(fromB64(blobB64), shape, { kind, codec });
      return { tensor: toB64(ct.codecs.encode([{ name: "x", shape: d.shape, data: d.data }], "fp32")), codec: d.codec };
    } catch (err) {
      return { error: String(err.message) };
    }
  }

  self.pipelineHarness = { stageForward, stageBackward, chain, activationsEncode, activationsDecode, digest: (s) => ct.activations.digest(fromB64(s)) };
})();
