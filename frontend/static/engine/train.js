// What a volunteer computes for a work unit (docs/protocol.md "Tasks"), over a slice of samples:
// - sliceGradients: the gradient of the mean loss, in mini-batches combined weighted by batch size, so
//   the result equals one big batch (up to float rounding; batch_norm excepted);
// - localSteps: one pass of torch.optim.SGD over the slice; the result is weights_before - weights_after.
// Both return the update already encoded (safetensors bytes in the work unit's codec).
// Classic script: attaches to self.crowdtrain.train; needs tf, crowdtrain.runtime/optim/codecs.
(function (ns) {
  "use strict";

  const sampleSize = (shape) => shape.slice(1).reduce((a, b) => a * b, 1);

  // A batch of rows [start, start+count) of a decoded tensor {shape, data}, typed as the graph spec says.
  function rows(t, start, count, dtype) {
    const per = sampleSize(t.shape);
    const data = t.data.subarray(start * per, (start + count) * per);
    const tfDtype = dtype === "int64" ? "int32" : "float32";
    const typed = tfDtype === "int32" && !(data instanceof Int32Array) ? Int32Array.from(data) : data;
    return tf.tensor(typed, [count, ...t.shape.slice(1)], tfDtype);
  }

  // The mini-batches of the slice in order, as {feeds, count}; the caller runs each inside a tidy.
  function* batches(model, x, y, batchSize) {
    const n = x.shape[0];
    if (n === 0) throw new Error("empty slice");
    const input = model.graph.inputs[0], target = model.graph.targets[0];
    for (let start = 0; start < n; start += batchSize) {
      const count = Math.min(batchSize, n - start);
      yield { start, count, feeds: () => ({
        [input.name]: rows(x, start, count, input.dtype), [target.name]: rows(y, start, count, target.dtype),
      }) };
    }
  }

  // Replaces a kept tensor by a new kept one, disposing the old (keeps tensor counts flat per batch).
  function swap(old, next) {
    const kept = tf.keep(next);
    if (old) old.dispose();
    return kept;
  }

  // Adds w * g into acc (kept tensors), disposing what it replaces.
  function accumulate(acc, grads, w) {
    for (const [name, g] of Object.entries(grads)) {
      acc[name] = swap(acc[name], acc[name] ? tf.add(acc[name], tf.mul(g, w)) : tf.mul(g, w));
    }
  }

  // model: runtime model; x, y: {shape, data} with n = x.shape[0] samples (the whole slice).
  // Returns {grads: {name: tf.Tensor}, loss: tf.Scalar, samples}; the caller disposes the tensors.
  function sliceGradientTensors(model, x, y, batchSize, { training = true } = {}) {
    const n = x.shape[0];
    const acc = {};
    let loss = null;
    for (const batch of batches(model, x, y, batchSize)) {
      tf.tidy(() => {
        const r = ns.runtime.gradients(model, batch.feeds(), { training });
        accumulate(acc, r.grads, batch.count / n);
        const part = tf.mul(r.loss, batch.count / n);
        loss = swap(loss, loss ? tf.add(loss, part) : part);
      });
    }
    return { grads: acc, loss, samples: n };
  }

  // Kept copies of variables; a copy keeps the old values when the variable is assigned anew.
  function snapshot(vars) {
    const out = {};
    for (const [name, v] of Object.entries(vars)) out[name] = tf.keep(tf.clone(v));
    return out;
  }

  function restore(vars, saved) {
    for (const [name, t] of Object.entries(saved)) {
      vars[name].assign(t);
      t.dispose(); // the variable now shares the data
    }
  }

  // engine.runtime.local_steps in TF.js: the same batches in the same order, each followed by an SGD
  // step with torch's update rule and fresh momentum, so the server's spot checks can recompute it.
  // The model is left as it was found (params and buffers): the worker reuses it for the next unit.
  // Returns {delta: {param: tf.Tensor}, buffers: {buffer: tf.Tensor}, loss: tf.Scalar, samples}.
  function localStepTensors(model, x, y, { batchSize, lr, momentum = 0 }) {
    if (!(lr > 0) || !(momentum >= 0)) throw new Error(`bad local optimizer settings lr=${lr} momentum=${momentum}`);
    const n = x.shape[0];
    const before = snapshot(model.params), beforeBuffers = snapshot(model.buffers);
    const optimizer = new ns.optim.SGD(model.params, { lr, momentum });
    let total = null;
    try {
      for (const batch of batches(model, x, y, batchSize)) {
        tf.tidy(() => {
          const r = ns.runtime.gradients(model, batch.feeds(), { training: true });
          optimizer.step(r.grads);
          const part = tf.mul(r.loss, batch.count); // local_steps weighs each batch's mean by its size
          total = swap(total, total ? tf.add(total, part) : part);
        });
      }
      return tf.tidy(() => {
        const delta = {};
        for (const [name, p] of Object.entries(model.params)) delta[name] = tf.sub(before[name], p);
        const buffers = {};
        for (const [name, b] of Object.entries(model.buffers)) buffers[name] = tf.clone(b);
        return { delta, buffers, loss: tf.div(total, n), samples: n };
      });
    } finally {
      optimizer.dispose();
      if (total) total.dispose();
      restore(model.params, before);
      restore(model.buffers, beforeBuffers);
    }
  }

  async function download(named, specs) {
    const out = {};
    for (const spec of specs) out[spec.name] = { shape: spec.shape, data: await named[spec.name].data() };
    return out;
  }

  // Concatenates two encodings of the same codec into one safetensors file.
  function merge(first, second) {
    const a = ns.codecs.parse(first), b = ns.codecs.parse(second);
    const entries = [a, b].flatMap((p) => Object.entries(p.tensors).map(([name, t]) => ({ name, ...t })));
    return ns.codecs.serialize(entries, { ...b.metadata, ...a.metadata }); // int4's shape: entries of both
  }

  // params: {name: {shape, data}} (gradients or deltas); buffers: new running statistics.
  // With a feedback (an ErrorFeedback kept per project) the params carry the previous units' quantisation
  // error forward. Buffers are absolute values, not updates, so they never get a residual.
  function encodeUpdate(params, buffers, codec, feedback) {
    const update = feedback ? feedback.compress(params) : ns.codecs.encode(params, codec);
    // Running statistics are state, not steps a later update could complete: never sparsified.
    const buffersCodec = codec === "topk" ? "fp32" : codec;
    return Object.keys(buffers).length ? merge(update, ns.codecs.encode(buffers, buffersCodec)) : update;
  }

  // -> {grads: safetensors bytes (Uint8Array, one tensor per param, in `codec`), loss, samples}
  async function sliceGradients(model, x, y, { batchSize = 64, codec = "fp32", feedback = null, training = true } = {}) {
    const r = sliceGradientTensors(model, x, y, batchSize, { training });
    try {
      const grads = await download(r.grads, model.graph.params);
      const loss = (await r.loss.data())[0];
      return { grads: encodeUpdate(grads, {}, codec, feedback), loss, samples: r.samples };
    } finally {
      tf.dispose([...Object.values(r.grads), r.loss]);
    }
  }

  // -> {delta: safetensors bytes (one tensor per param, weights_before - weights_after, plus each
  //     buffer's new value), loss (mean training loss over the slice), samples}
  async function localSteps(model, x, y, { batchSize = 64, lr, momentum = 0, codec = "fp32", feedback = null } = {}) {
    const r = localStepTensors(model, x, y, { batchSize, lr, momentum });
    try {
      const delta = await download(r.delta, model.graph.params);
      const buffers = await download(r.buffers, model.graph.buffers || []);
      const loss = (await r.loss.data())[0];
      return { delta: encodeUpdate(delta, buffers, codec, feedback), loss, samples: r.samples };
    } finally {
      tf.dispose([...Object.values(r.delta), ...Object.values(r.buffers), r.loss]);
    }
  }

  ns.train = { sliceGradients, sliceGradientTensors, localSteps, localStepTensors, encodeUpdate };
})((self.crowdtrain = self.crowdtrain || {}));
