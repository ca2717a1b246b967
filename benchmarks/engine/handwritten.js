// Hand-written TF.js versions of the mlp, cnn and resnet18 presets and of the corpus's timeseries_cnn and
// nanogpt (tests/engine/corpus.py): what a TF.js developer would write for the same architecture (channels-last
// layout, [in, out] dense kernels, tf.batchNorm), loaded with the
// preset's own weights converted once. This is the yardstick the graph interpreter is measured
// against, so it must stay an honest implementation.
// Classic script: attaches to self.handwritten; needs the global `tf`.
(function (ns) {
  "use strict";

  // ---- weight conversion (once, at load) ----------------------------------------------------------
  function tensorOf(weights, name) {
    const w = weights[name];
    if (!w) throw new Error(`handwritten: missing weight ${name}`);
    return tf.tensor(w.data, w.shape, "float32");
  }

  // f(t), disposing t (the torch-layout original).
  function converted(t, f) {
    const out = tf.tidy(() => f(t));
    t.dispose();
    return out;
  }

  // torch [out, in] -> dense kernel [in, out]; OIHW -> HWIO.
  const denseKernel = (t) => converted(t, (w) => tf.transpose(w));
  const convKernel = (t) => converted(t, (w) => tf.transpose(w, [2, 3, 1, 0]));
  const conv1dKernel = (t) => converted(t, (w) => tf.transpose(w, [2, 1, 0])); // OIW -> WIO

  // A torch Linear that follows a torch.flatten of [C, H, W]: reorder its input rows to NHWC's (H, W, C).
  const flattenedKernel = (t, [c, h, w]) => converted(t, (k) =>
    tf.transpose(k.reshape([k.shape[0], c, h, w]), [2, 3, 1, 0]).reshape([h * w * c, -1]));

  // Converted tensors -> tf.Variables (trainable or not), keyed by the torch name.
  function variables(specs, trainable) {
    const out = {};
    for (const [name, t] of Object.entries(specs)) {
      out[name] = tf.variable(t, trainable);
      t.dispose();
    }
    return out;
  }

  // ---- layers -------------------------------------------------------------------------------------
  // Plain ops rather than tf.fused.matMul/conv2d (which tf.layers uses): under gradients the fused
  // ops fall back or run slower in tfjs 4.22 (measured on webgl and cpu), and the yardstick should be
  // the fastest honest implementation.
  function dense(x, p, name, activation = "linear") {
    const y = tf.add(tf.matMul(x, p[`${name}.weight`]), p[`${name}.bias`]);
    return activation === "relu" ? tf.relu(y) : y;
  }

  function conv(x, p, name, stride, pad, activation = "linear") {
    const bias = p[`${name}.bias`]; // undefined for bias-free convs
    let y = tf.conv2d(x, p[`${name}.weight`], stride, pad);
    if (bias) y = tf.add(y, bias);
    return activation === "relu" ? tf.relu(y) : y;
  }

  // Training-mode batch norm over every axis but the last (channels); running stats as torch keeps them
  // (unbiased variance).
  function batchNorm(x, p, b, name, training, updates) {
    const rm = b[`${name}.running_mean`], rv = b[`${name}.running_var`];
    if (!training) return tf.batchNorm(x, rm, rv, p[`${name}.bias`], p[`${name}.weight`], 1e-5);
    const { mean, variance } = tf.moments(x, [...Array(x.rank - 1).keys()]);
    const n = x.size / x.shape[x.rank - 1];
    updates.push([rm, tf.add(tf.mul(rm, 0.9), tf.mul(mean, 0.1))]);
    updates.push([rv, tf.add(tf.mul(rv, 0.9), tf.mul(variance, (0.1 * n) / (n - 1)))]);
    return tf.batchNorm(x, mean, variance, p[`${name}.bias`], p[`${name}.weight`], 1e-5);
  }

  // ---- models: {params, buffers, forward(x, training, updates) -> logits} ---------------------------
  function mlp(weights) {
    const params = variables({
      "fc1.weight": denseKernel(tensorOf(weights, "fc1.weight")), "fc1.bias": tensorOf(weights, "fc1.bias"),
      "fc2.weight": denseKernel(tensorOf(weights, "fc2.weight")), "fc2.bias": tensorOf(weights, "fc2.bias"),
    }, true);
    // The preset flattens its 1x28x28 images first: with one channel, NHWC and NCHW flatten alike.
    const forward = (x) => dense(dense(x.reshape([x.shape[0], -1]), params, "fc1", "relu"), params, "fc2");
    return { params, buffers: {}, forward };
  }

  function cnn(weights) {
    const params = variables({
      "conv1.weight": convKernel(tensorOf(weights, "conv1.weight")), "conv1.bias": tensorOf(weights, "conv1.bias"),
      "conv2.weight": convKernel(tensorOf(weights, "conv2.weight")), "conv2.bias": tensorOf(weights, "conv2.bias"),
      "fc1.weight": flattenedKernel(tensorOf(weights, "fc1.weight"), [32, 7, 7]),
      "fc1.bias": tensorOf(weights, "fc1.bias"),
      "fc2.weight": denseKernel(tensorOf(weights, "fc2.weight")), "fc2.bias": tensorOf(weights, "fc2.bias"),
    }, true);
    function forward(x, training) {
      let h = tf.maxPool(conv(x, params, "conv1", 1, "same", "relu"), 2, 2, "valid");
      h = tf.maxPool(conv(h, params, "conv2", 1, "same", "relu"), 2, 2, "valid");
      h = dense(h.reshape([h.shape[0], -1]), params, "fc1", "relu");
      return dense(training ? tf.dropout(h, 0.25) : h, params, "fc2");
    }
    return { params, buffers: {}, forward };
  }

  // Torch names of the 8 BasicBlocks of the CIFAR ResNet-18 preset: [prefix, stride, has shortcut conv].
  const RESNET_BLOCKS = [[1, false], [1, false], [2, true], [1, false], [2, true], [1, false], [2, true], [1, false]]
    .map(([stride, shortcut], i) => [`layers.${i}`, stride, shortcut]);

  function resnet18(weights) {
    const p = {}, b = {};
    for (const [name, w] of Object.entries(weights)) {
      if (name.endsWith("running_mean") || name.endsWith("running_var")) b[name] = tensorOf(weights, name);
      else if (w.shape.length === 4) p[name] = convKernel(tensorOf(weights, name));
      else if (name === "fc.weight") p[name] = denseKernel(tensorOf(weights, name));
      else p[name] = tensorOf(weights, name);
    }
    const params = variables(p, true), buffers = variables(b, false);
    const convBn = (x, conv_, bn, stride, pad, training, updates) =>
      batchNorm(conv(x, params, conv_, stride, pad), params, buffers, bn, training, updates);

    function block(x, [prefix, stride, shortcut], training, updates) {
      let h = tf.relu(convBn(x, `${prefix}.conv1`, `${prefix}.bn1`, stride, 1, training, updates));
      h = convBn(h, `${prefix}.conv2`, `${prefix}.bn2`, 1, 1, training, updates);
      const skip = shortcut
        ? convBn(x, `${prefix}.shortcut.0`, `${prefix}.shortcut.1`, stride, 0, training, updates) : x;
      return tf.relu(tf.add(h, skip));
    }

    function forward(x, training, updates = []) {
      let h = tf.relu(convBn(x, "conv1", "bn1", 1, 1, training, updates));
      for (const spec of RESNET_BLOCKS) h = block(h, spec, training, updates);
      return dense(tf.mean(h, [1, 2]), params, "fc");
    }
    return { params, buffers, forward };
  }

  // Conv1d(3->16, k5, pad 2) BN ReLU MaxPool1d(2) Conv1d(16->32, k3, "same") BN ReLU, mean over time, Linear.
  // NLC; max pooling over time as tf.layers.maxPooling1d does it (a [1, 2] window on [N, 1, L, C]).
  function timeseries_cnn(weights) {
    const p = {}, b = {};
    for (const [name, w] of Object.entries(weights)) {
      if (name.endsWith("running_mean") || name.endsWith("running_var")) b[name] = tensorOf(weights, name);
      else if (w.shape.length === 3) p[name] = conv1dKernel(tensorOf(weights, name));
      else if (name === "classifier.weight") p[name] = denseKernel(tensorOf(weights, name));
      else if (!name.endsWith("num_batches_tracked")) p[name] = tensorOf(weights, name);
    }
    const params = variables(p, true), buffers = variables(b, false);
    function convBnRelu(x, conv_, bn, training, updates) {
      const y = tf.add(tf.conv1d(x, params[`${conv_}.weight`], 1, "same"), params[`${conv_}.bias`]);
      return tf.relu(batchNorm(y, params, buffers, bn, training, updates));
    }
    function forward(x, training, updates = []) {
      let h = convBnRelu(x, "features.0", "features.1", training, updates);
      const [n, l, c] = h.shape;
      h = tf.maxPool(h.reshape([n, 1, l, c]), [1, 2], [1, 2], "valid").reshape([n, l / 2, c]);
      h = convBnRelu(h, "features.4", "features.5", training, updates);
      return dense(tf.mean(h, 1), params, "classifier");
    }
    return { params, buffers, forward };
  }

  // nanoGPT (2 blocks, 4 heads, 64 wide, causal attention, exact GELU, lm_head tied to wte): logits of the
  // last position. Dense kernels [in, out]; the tied lm_head reads wte [vocab, C] transposed, as it must.
  function nanogpt(weights) {
    const p = {};
    for (const [name, w] of Object.entries(weights)) {
      const dense_ = w.shape.length === 2 && name.includes(".h.");
      p[name] = dense_ ? denseKernel(tensorOf(weights, name)) : tensorOf(weights, name);
    }
    const params = variables(p, true);
    const at = (prefix) => (suffix) => params[`${prefix}.${suffix}`];
    const layerNorm = (x, w) => {
      const { mean, variance } = tf.moments(x, -1, true);
      return tf.add(tf.mul(tf.mul(tf.sub(x, mean), tf.rsqrt(tf.add(variance, 1e-5))), w("weight")), w("bias"));
    };
    const linear = (x, w) => {
      const y = tf.add(tf.matMul(x.reshape([-1, x.shape[2]]), w("weight")), w("bias"));
      return y.reshape([x.shape[0], x.shape[1], -1]);
    };
    const gelu = (x) => tf.mul(tf.mul(x, 0.5), tf.add(tf.erf(tf.mul(x, Math.SQRT1_2)), 1));
    function attention(x, w, heads, mask) {
      const [b, t, c] = x.shape;
      const [q, k, v] = tf.split(linear(x, w), 3, 2).map((h) => tf.transpose(h.reshape([b, t, heads, c / heads]), [0, 2, 1, 3]));
      const scores = tf.add(tf.mul(tf.matMul(q, k, false, true), 1 / Math.sqrt(c / heads)), mask);
      const y = tf.transpose(tf.matMul(tf.softmax(scores), v), [0, 2, 1, 3]).reshape([b, t, c]);
      return y;
    }
    // The causal mask once, for the longest block (as nanoGPT registers it): -1e9 above the diagonal.
    const block = params["transformer.wpe.weight"].shape[0];
    const causal = tf.tidy(() => tf.mul(tf.sub(1, tf.linalg.bandPart(tf.ones([block, block]), -1, 0)), -1e9));
    function forward(idx) {
      const [b, t] = idx.shape;
      const mask = t === block ? causal : tf.slice(causal, [0, 0], [t, t]);
      let x = tf.add(tf.gather(params["transformer.wte.weight"], idx), tf.slice(params["transformer.wpe.weight"], 0, t));
      for (let i = 0; params[`transformer.h.${i}.ln_1.weight`]; i++) {
        const h = (name) => at(`transformer.h.${i}.${name}`);
        x = tf.add(x, linear(attention(layerNorm(x, h("ln_1")), h("attn.c_attn"), 4, mask), h("attn.c_proj")));
        x = tf.add(x, linear(gelu(linear(layerNorm(x, h("ln_2")), h("mlp.c_fc"))), h("mlp.c_proj")));
      }
      const last = tf.slice(layerNorm(x, at("transformer.ln_f")), [0, t - 1, 0], [b, 1, -1]).reshape([b, -1]);
      return tf.matMul(last, params["transformer.wte.weight"], false, true);
    }
    return { params, buffers: { causal }, forward };
  }

  // ---- one training step: forward + backward (tf.variableGrads) + SGD, running stats assigned --------
  function trainer(model, lr) {
    const optimizer = tf.train.sgd(lr);
    const trainable = Object.values(model.params);
    function step(x, oneHot) {
      let updates = [];
      const { value, grads } = tf.variableGrads(() => {
        const pending = [];
        const logits = model.forward(x, true, pending);
        updates = pending.map(([v, t]) => [v, tf.keep(t)]);
        return tf.losses.softmaxCrossEntropy(oneHot, logits);
      }, trainable);
      optimizer.applyGradients(grads);
      for (const [v, t] of updates) { v.assign(t); t.dispose(); }
      tf.dispose(Object.values(grads));
      return value;
    }
    return { step, dispose: () => optimizer.dispose() };
  }

  function dispose(model) {
    tf.dispose([...Object.values(model.params), ...Object.values(model.buffers)]);
  }

  ns.handwritten = { models: { mlp, cnn, resnet18, timeseries_cnn, nanogpt }, trainer, dispose };
})(self);
