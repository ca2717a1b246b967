// Test-only glue: Playwright passes graphs and safetensors (base64) in and reads safetensors back.
"use strict";
(function () {
  const ct = self.crowdtrain;

  const { fromB64, toB64 } = self.harnessB64;

  async function useBackend(name) {
    if (name === "wasm") tf.wasm.setWasmPaths("/static/vendor/");
    if (!(await tf.setBackend(name))) throw new Error(`backend ${name} failed`);
    await tf.ready();
    return tf.getBackend();
  }

  function feedsFor(graph, batch) {
    const feeds = {};
    for (const spec of [...graph.inputs, ...graph.targets]) {
      const t = batch[spec.name];
      if (!t) continue;
      const dtype = spec.dtype === "int64" ? "int32" : "float32";
      feeds[spec.name] = tf.tensor(dtype === "int32" ? Int32Array.from(t.data) : t.data, t.shape, dtype);
    }
    return feeds;
  }

  async function tensorsToB64(named) {
    const list = [];
    for (const [name, t] of Object.entries(named)) list.push({ name, shape: t.shape, data: await t.data() });
    return toB64(ct.codecs.encode(list, "fp32"));
  }

  // One train-mode step on a fresh model: output, loss, grads, buffers after the update.
  async function gradients(graphJson, weightsB64, batchB64) {
    const graph = ct.graph.load(graphJson);
    const weights = ct.codecs.decode(fromB64(weightsB64));
    const batch = ct.codecs.decode(fromB64(batchB64));
    const model = ct.runtime.createModel(graph, weights);
    const feeds = feedsFor(graph, batch);
    try {
      const g = ct.runtime.gradients(model, feeds, { training: true });
      const grads = await tensorsToB64(g.grads);
      const loss = (await g.loss.data())[0];
      const buffers = await tensorsToB64(model.buffers);
      tf.dispose([g.loss, ...Object.values(g.grads)]);
      model.setWeights(weights); // forward from the same starting point as the gradient pass
      const f = ct.runtime.forward(model, feeds, { training: true });
      const output = await tensorsToB64({ output: f.output });
      tf.dispose(Object.values(f));
      return { grads, loss, buffers, output, backend: tf.getBackend() };
    } finally {
      tf.dispose(Object.values(feeds));
      model.dispose();
    }
  }

  // Slice gradients through train.js (mini-batches, codec): returns safetensors base64.
  async function sliceGradients(graphJson, weightsB64, batchB64, batchSize, codec) {
    const graph = ct.graph.load(graphJson);
    const model = ct.runtime.createModel(graph, ct.codecs.decode(fromB64(weightsB64)));
    const batch = ct.codecs.decode(fromB64(batchB64));
    try {
      const x = batch[graph.inputs[0].name], y = batch[graph.targets[0].name];
      const r = await ct.train.sliceGradients(model, x, y, { batchSize, codec });
      return { grads: toB64(r.grads), loss: r.loss, samples: r.samples };
    } finally {
      model.dispose();
    }
  }

  // Local SGD steps through train.js on a fresh model. Also reports whether localSteps left the model as
  // it found it (the worker reuses models across units), how many tensors it leaked, and how many steps
  // ran WebGL's packed elementwise kernels (runtime.js "packed textures").
  async function localSteps(graphJson, weightsB64, batchB64, batchSize, lr, momentum, codec) {
    const graph = ct.graph.load(graphJson);
    const weights = ct.codecs.decode(fromB64(weightsB64));
    const model = ct.runtime.createModel(graph, weights);
    const batch = ct.codecs.decode(fromB64(batchB64));
    try {
      const x = batch[graph.inputs[0].name], y = batch[graph.targets[0].name];
      const before = tf.memory().numTensors;
      const r = await ct.train.localSteps(model, x, y, { batchSize, lr, momentum, codec });
      const leaked = tf.memory().numTensors - before;
      let moved = 0;
      for (const [name, v] of Object.entries({ ...model.params, ...model.buffers })) {
        const now = await v.data(), was = weights[name].data;
        for (let i = 0; i < now.length; i++) moved = Math.max(moved, Math.abs(now[i] - was[i]));
      }
      const packing = ct.runtime.packingStats(model); // WebGL: steps run with packed elementwise kernels or not
      return { delta: toB64(r.delta), loss: r.loss, samples: r.samples, leaked, moved, packing };
    } finally {
      model.dispose();
    }
  }

  // Bytes held in GPU textures where the backend has a GPU (webgl: tensor count alone would miss a
  // texture that grows or is never released), else bytes of all tensors.
  function deviceBytes() {
    const m = tf.memory();
    return typeof m.numBytesInGPU === "number" ? m.numBytesInGPU : m.numBytes;
  }

  // `steps` optimizer steps; returns the tensor count and device bytes after every step and the final params.
  async function trainSteps(graphJson, weightsB64, batchB64, steps, optimizer, options) {
    const graph = ct.graph.load(graphJson);
    const model = ct.runtime.createModel(graph, ct.codecs.decode(fromB64(weightsB64)));
    const batch = ct.codecs.decode(fromB64(batchB64));
    const opt = new ct.optim[optimizer](model.params, options);
    const counts = [];
    const deviceBytesPerStep = [];
    const losses = [];
    try {
      for (let i = 0; i < steps; i++) {
        const feeds = feedsFor(graph, batch);
        const g = ct.runtime.gradients(model, feeds, { training: true });
        opt.step(g.grads);
        losses.push((await g.loss.data())[0]);
        tf.dispose([g.loss, ...Object.values(g.grads), ...Object.values(feeds)]);
        counts.push(tf.memory().numTensors);
        deviceBytesPerStep.push(deviceBytes());
      }
      return { counts, deviceBytes: deviceBytesPerStep, losses, params: await tensorsToB64(model.params),
        bytes: tf.memory().numBytes };
    } finally {
      opt.dispose();
      model.dispose();
    }
  }

  function encode(tensorsB64, codec, blockSize, keep) {
    const decoded = ct.codecs.decode(fromB64(tensorsB64));
    return toB64(ct.codecs.encode(decoded, codec, keep ? { blockSize, keep } : { blockSize }));
  }

  function decode(bytesB64) {
    return toB64(ct.codecs.encode(ct.codecs.decode(fromB64(bytesB64)), "fp32"));
  }

  // Runs worker.js as the page would: init, then each assign in turn; resolves with all its messages.
  function workerCompute(backends, assigns) {
    return new Promise((resolve, reject) => {
      const worker = new Worker("/static/frontend/worker.js");
      const log = [];
      let next = 0;
      const finish = (err) => { clearTimeout(timer); worker.terminate(); err ? reject(err) : resolve(log); };
      const timer = setTimeout(() => finish(new Error("worker timeout")), 300000);
      worker.onerror = (e) => finish(new Error(e.message));
      worker.onmessage = (e) => {
        const msg = e.data;
        if (msg.type === "started") return; // progress only: the page uses it for its duty-cycle clock
        if (msg.bytes) msg.bytes = toB64(new Uint8Array(msg.bytes));
        if (msg.sent) msg.sent.bytes = toB64(new Uint8Array(msg.sent.bytes));
        log.push(msg);
        if (msg.type === "init_failed") return finish(new Error(msg.error));
        if (next === assigns.length) return finish();
        // A stage unit's payloads from the peer ring (base64 here) go along with it, as the page sends them.
        const { payloads, ...assign } = assigns[next++];
        const given = Object.fromEntries(Object.entries(payloads || {}).map(([k, v]) => [k, fromB64(v).buffer]));
        worker.postMessage({ cmd: "compute", assign, payloads: given });
      };
      worker.postMessage({ cmd: "init", backends });
    });
  }

  self.harness = { useBackend, gradients, sliceGradients, localSteps, trainSteps, encode, decode, workerCompute };
})();
