// Gradient of the mean loss over a slice of samples, computed in mini-batches and combined weighted
// by batch size, so the result equals one big batch (up to float rounding; batch_norm excepted).
// Classic script: attaches to self.crowdtrain.train; needs tf, crowdtrain.runtime, crowdtrain.codecs.
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

  // Adds w * g into acc (kept tensors), disposing what it replaces.
  function accumulate(acc, grads, w) {
    for (const [name, g] of Object.entries(grads)) {
      const next = tf.keep(acc[name] ? tf.add(acc[name], tf.mul(g, w)) : tf.mul(g, w));
      if (acc[name]) acc[name].dispose();
      acc[name] = next;
    }
  }

  // model: runtime model; x, y: {shape, data} with n = x.shape[0] samples (the whole slice).
  // Returns {grads: {name: tf.Tensor}, loss: tf.Scalar, samples}; the caller disposes the tensors.
  function sliceGradientTensors(model, x, y, batchSize, { training = true } = {}) {
    const n = x.shape[0];
    if (n === 0) throw new Error("empty slice");
    const input = model.graph.inputs[0], target = model.graph.targets[0];
    const acc = {};
    let loss = null;
    for (let start = 0; start < n; start += batchSize) {
      const count = Math.min(batchSize, n - start);
      tf.tidy(() => {
        const feeds = { [input.name]: rows(x, start, count, input.dtype), [target.name]: rows(y, start, count, target.dtype) };
        const r = ns.runtime.gradients(model, feeds, { training });
        accumulate(acc, r.grads, count / n);
        const next = tf.keep(loss ? tf.add(loss, tf.mul(r.loss, count / n)) : tf.mul(r.loss, count / n));
        if (loss) loss.dispose();
        loss = next;
      });
    }
    return { grads: acc, loss, samples: n };
  }

  // -> {grads: safetensors bytes (Uint8Array, one tensor per param, in `codec`), loss, samples}
  async function sliceGradients(model, x, y, { batchSize = 64, codec = "fp32", training = true } = {}) {
    const r = sliceGradientTensors(model, x, y, batchSize, { training });
    try {
      const tensors = [];
      for (const spec of model.graph.params) {
        tensors.push({ name: spec.name, shape: spec.shape, data: await r.grads[spec.name].data() });
      }
      const loss = (await r.loss.data())[0];
      return { grads: ns.codecs.encode(tensors, codec), loss, samples: r.samples };
    } finally {
      Object.values(r.grads).forEach((t) => t.dispose());
      r.loss.dispose();
    }
  }

  ns.train = { sliceGradients, sliceGradientTensors };
})((self.crowdtrain = self.crowdtrain || {}));
