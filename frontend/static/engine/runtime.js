// Interpreter of crowdtrain.graph (docs/graph-format.md) over TensorFlow.js.
// Values have PyTorch's layout (NCHW); TF.js convs are NHWC, so conv outputs stay NHWC through
// layout-agnostic ops and are transposed back only where needed (see "channels-last execution").
// Every node's attrs are complete (graph.js fills in engine/spec.json's defaults), so kernels read them
// as they are. Classic script: attaches to self.crowdtrain.runtime; needs the global `tf`.
(function (ns) {
  "use strict";

  const FLOAT32_LOWEST = -3.4028234663852886e38; // max-pool padding that never wins a window

  // ---- small helpers ---------------------------------------------------------------------------
  const axis = (d, rank) => (d < 0 ? d + rank : d);
  const prod = (xs) => xs.reduce((a, b) => a * b, 1);
  const even = (d) => d % 2 === 0;

  function pair(v, fallback) {
    if (v === undefined || v === null || (Array.isArray(v) && v.length === 0)) v = fallback;
    return Array.isArray(v) ? (v.length === 1 ? [v[0], v[0]] : v.slice(0, 2)) : [v, v];
  }

  // A permutation that moves only axes of size 1 leaves the data in order: a reshape, no transpose kernel
  // (a one-channel image going NHWC, a pooled [N, 1, 1, C] going NCHW).
  function permute(x, perm) {
    const kept = perm.filter((d) => x.shape[d] !== 1);
    if (kept.every((d, i) => i === 0 || d > kept[i - 1])) return x.reshape(perm.map((d) => x.shape[d]));
    return tf.transpose(x, perm);
  }

  // Channels last at any rank from 3: NCHW <-> NHWC, and NCL <-> NLC (a conv1d's [N, C, 1, L] viewed 3-D).
  const range = (a, b) => Array.from({ length: b - a }, (_, i) => a + i);
  const toNHWC = (x) => permute(x, [0, ...range(2, x.rank), 1]);
  const toNCHW = (x) => permute(x, [0, x.rank - 1, ...range(1, x.rank - 1)]);

  // ---- convolution and pooling ------------------------------------------------------------------
  // TF.js has no gradient for dilated conv2d, so dilate the kernel itself (zeros between taps);
  // the interleave is built from differentiable ops so the weight gradient is exact.
  function dilateFirstAxis(f, d) {
    if (d === 1) return f;
    const k = f.shape[0];
    const zeros = tf.zeros([k, d - 1, ...f.shape.slice(1)]);
    const spread = tf.concat([tf.expandDims(f, 1), zeros], 1).reshape([k * d, ...f.shape.slice(1)]);
    return tf.slice(spread, 0, (k - 1) * d + 1);
  }

  function dilateKernel(f, dh, dw) {
    const rows = dilateFirstAxis(f, dh);
    if (dw === 1) return rows;
    const perm = [1, 0, 2, 3];
    return tf.transpose(dilateFirstAxis(tf.transpose(rows, perm), dw), perm);
  }

  // TF.js conv2d has no `groups`: run one convolution per group. tf.conv2d on every backend, cpu included:
  // its cpu kernel rounds each product into the float32 output (3.7e-6 off float64 over 9,216 products, as
  // WebGL; tests/browser/test_ops.py), which a float64-summing path would cut at 14% of ResNet-18's cpu speed,
  // for ReLU flips that float32 PyTorch makes too (docs/corpus.md, "Float32 coin tosses").
  function groupedConv(xh, f, groups, strides, pad) {
    if (groups === 1) return tf.conv2d(xh, f, strides, pad);
    const xs = tf.split(xh, groups, 3);
    const fs = tf.split(f, groups, 3);
    return tf.concat(xs.map((x, i) => tf.conv2d(x, fs[i], strides, pad)), 3);
  }

  // Zero padding goes to the conv kernel itself (explicit padding): a separate tf.pad would cost a
  // copy forward and a slice backward. The bias is added while NHWC, where it is a plain last-axis
  // add. (tf.fused.conv2d would fold the bias in, but is slower under gradients in tfjs 4.22.)
  // x is NHWC, w is the graph's OIHW; returns NHWC.
  function convNHWC([x, w, b], a) {
    const [ph, pw] = pair(a.padding);
    const [dh, dw] = pair(a.dilation);
    const groups = a.groups, strides = pair(a.stride);
    const pad = [[0, 0], [ph, ph], [pw, pw], [0, 0]];
    const f = dilateKernel(tf.transpose(w, [2, 3, 1, 0]), dh, dw); // OIHW -> HWIO
    const y = groupedConv(x, f, groups, strides, pad);
    return b ? tf.add(y, b) : y;
  }

  const conv2d = ([x, w, b], a) => toNCHW(convNHWC([toNHWC(x), w, b], a));

  // torch's conv_transpose2d (weight [in, out, kh, kw]) is the input gradient of a conv2d with the same
  // stride and padding: tf.conv2dTranspose, whose forward and gradients match torch's with explicit
  // padding (padding > kh - 1 included). output_padding only adds rows and columns at the bottom and right
  // that the forward conv would not read, so it only enters the output shape. x is NHWC; returns NHWC.
  function convTransposeNHWC([x, w, b], a) {
    const [s, p, extra] = [pair(a.stride), pair(a.padding), pair(a.output_padding)];
    const size = (i) => (x.shape[i + 1] - 1) * s[i] - 2 * p[i] + w.shape[i + 2] + extra[i];
    const pad = [[0, 0], [p[0], p[0]], [p[1], p[1]], [0, 0]];
    const f = tf.transpose(w, [2, 3, 1, 0]); // [in, out, kh, kw] -> [kh, kw, out, in]
    const y = tf.conv2dTranspose(x, f, [x.shape[0], size(0), size(1), w.shape[1]], s, pad);
    return b ? tf.add(y, b) : y;
  }

  const convTranspose2d = ([x, w, b], a) => toNCHW(convTransposeNHWC([toNHWC(x), w, b], a));

  // x is NHWC.
  function poolNHWC(kind) {
    return ([x], a) => {
      const k = pair(a.kernel_size);
      const s = pair(a.stride, k); // torch: stride defaults to kernel_size
      const [ph, pw] = pair(a.padding);
      // avg: torch counts the zero padding (count_include_pad=True); max: padding never wins.
      if (ph || pw) x = tf.pad(x, [[0, 0], [ph, ph], [pw, pw], [0, 0]], kind === "max" ? FLOAT32_LOWEST : 0);
      return kind === "max" ? tf.maxPool(x, k, s, "valid") : tf.avgPool(x, k, s, "valid");
    };
  }

  // Pooling windows never mix channels, so NCHW [N, C, H, W] is pooled as NHWC [N*C, H, W, 1]: a
  // free reshape instead of a transpose on each side (forward and backward).
  function pool2d(kind) {
    const pool = poolNHWC(kind);
    return ([x], a) => {
      const [n, c, h, w] = x.shape;
      const y = pool([x.reshape([n * c, h, w, 1])], a);
      return y.reshape([n, c, y.shape[1], y.shape[2]]);
    };
  }

  // Row i of the [out, in] matrix averages torch's adaptive bin [floor(i*in/out), ceil((i+1)*in/out)).
  function adaptiveMatrix(inSize, outSize) {
    const m = new Float32Array(outSize * inSize);
    for (let i = 0; i < outSize; i++) {
      const lo = Math.floor((i * inSize) / outSize), hi = Math.ceil(((i + 1) * inSize) / outSize);
      for (let j = lo; j < hi; j++) m[i * inSize + j] = 1 / (hi - lo);
    }
    return tf.tensor2d(m, [outSize, inSize]);
  }

  // Bins are rectangles, so the pooling separates: average the columns, then the rows.
  function adaptiveAvgPool2d([x], a) {
    const [, , h, w] = x.shape;
    const [oh, ow] = pair(a.output_size).map((v, i) => (v === null ? [h, w][i] : v));
    if (oh === 1 && ow === 1) return tf.mean(x, [2, 3], true);
    return separable2d(x, adaptiveMatrix(h, oh), adaptiveMatrix(w, ow));
  }

  // x [N, C, H, W] times an [out, in] matrix along H (rows) and W (cols), each null to leave that axis be:
  // rows @ x[n, c] @ cols^T as two plain 2-D products, whose gradients are products too.
  function separable2d(x, rows, cols) {
    const [n, c, h, w] = x.shape;
    const y = cols ? tf.matMul(x.reshape([-1, w]), cols, false, true).reshape([n, c, h, cols.shape[0]]) : x;
    if (!rows) return y;
    const ow = y.shape[3];
    const t = tf.matMul(tf.transpose(y, [0, 1, 3, 2]).reshape([-1, h]), rows, false, true);
    return tf.transpose(t.reshape([n, c, ow, rows.shape[0]]), [0, 1, 3, 2]);
  }

  // ---- interpolation ------------------------------------------------------------------------------
  // tf.image.resizeNearestNeighbor / resizeBilinear compute torch's forward (nearest: alignCorners and
  // halfPixelCenters false; bilinear: halfPixelCenters unless align_corners), but their TF.js 4.22
  // gradients are wrong (nearest: scattered to the wrong pixels; bilinear: ignores halfPixelCenters and
  // breaks on non-square images). So interpolation is a matrix per axis, its taps computed in float32
  // exactly as torch's CPU kernels compute them (aten/src/ATen/native/UpSample.h).
  const f32 = Math.fround;

  // nearest: source floor(i * in/out) (not half-pixel).
  const nearestTaps = (i, inSize, outSize) => [[Math.min(Math.floor(f32(i * f32(inSize / outSize))), inSize - 1), 1]];

  // bilinear: source i * (in-1)/(out-1) with align_corners, else (i + 0.5) * in/out - 0.5 clamped at 0.
  function linearTaps(i, inSize, outSize, alignCorners) {
    let src = 0;
    if (alignCorners) src = outSize > 1 ? f32(f32((inSize - 1) / (outSize - 1)) * i) : 0;
    else src = Math.max(0, f32(f32(f32(inSize / outSize) * (i + 0.5)) - 0.5));
    const i0 = Math.min(Math.floor(src), inSize - 1);
    const l1 = Math.min(Math.max(f32(src - i0), 0), 1);
    return [[i0, f32(1 - l1)], [Math.min(i0 + 1, inSize - 1), l1]];
  }

  // [out, in]: row i holds output i's source weights; null where the size does not change (identity).
  function resampleMatrix(inSize, outSize, a) {
    if (inSize === outSize) return null;
    const m = new Float32Array(outSize * inSize);
    for (let i = 0; i < outSize; i++) {
      const taps = a.mode === "nearest" ? nearestTaps(i, inSize, outSize) : linearTaps(i, inSize, outSize, a.align_corners);
      for (const [j, weight] of taps) m[i * inSize + j] += weight;
    }
    return tf.tensor2d(m, [outSize, inSize]);
  }

  function interpolate([x], a) {
    const [, , h, w] = x.shape;
    const [oh, ow] = pair(a.size);
    return separable2d(x, resampleMatrix(h, oh, a), resampleMatrix(w, ow, a));
  }

  // ---- normalization ------------------------------------------------------------------------------
  // Channels on axis `channel`: 1 in the graph's layout, 3 for NHWC.
  function batchNormAt([x, w, b, runMean, runVar], a, ctx, channel) {
    const eps = a.eps, momentum = a.momentum;
    const axes = x.shape.map((_, i) => i).filter((i) => i !== channel);
    const shape = x.shape.map((d, i) => (i === channel ? d : 1));
    let mean = runMean, variance = runVar;
    if (ctx.training || !runMean) {
      ({ mean, variance } = tf.moments(x, axes));
      if (ctx.training && runMean) {
        const n = x.size / x.shape[channel];
        // torch stores the unbiased batch variance in running_var, but normalizes with the biased one.
        ctx.update(ctx.node.inputs[3], tf.add(tf.mul(runMean, 1 - momentum), tf.mul(mean, momentum)));
        ctx.update(ctx.node.inputs[4],
          tf.add(tf.mul(runVar, 1 - momentum), tf.mul(variance, (momentum * n) / Math.max(n - 1, 1))));
      }
    }
    // y = x * scale + shift with per-channel scale = w / sqrt(var + eps), shift = b - mean * scale: the
    // form torch's own kernel uses, and two full-size ops (and their gradients) instead of four.
    // (tf.batchNorm would be one kernel, but its gradient assumes channels last.)
    const inv = tf.rsqrt(tf.add(variance, eps));
    const scale = w ? tf.mul(inv, w) : inv;
    const shift = b ? tf.sub(b, tf.mul(mean, scale)) : tf.neg(tf.mul(mean, scale));
    return tf.add(tf.mul(x, scale.reshape(shape)), shift.reshape(shape));
  }

  const batchNorm = (args, a, ctx) => batchNormAt(args, a, ctx, 1);

  // torch's group norm: statistics over each sample's groups of channels (biased variance, like tf.moments),
  // then a per-channel affine. Reads [N, C, ...] in the graph's layout.
  function groupNorm([x, w, b], a) {
    const grouped = x.reshape([x.shape[0], a.num_groups, -1]);
    const { mean, variance } = tf.moments(grouped, 2, true);
    let y = tf.mul(tf.sub(grouped, mean), tf.rsqrt(tf.add(variance, a.eps))).reshape(x.shape);
    const perChannel = [x.shape[1], ...Array(x.rank - 2).fill(1)];
    if (w) y = tf.mul(y, w.reshape(perChannel));
    if (b) y = tf.add(y, b.reshape(perChannel));
    return y;
  }

  function layerNorm([x, w, b], a) {
    const count = a.normalized_shape.length;
    const axes = x.shape.map((_, i) => i).slice(x.rank - count);
    const { mean, variance } = tf.moments(x, axes, true);
    let y = tf.mul(tf.sub(x, mean), tf.rsqrt(tf.add(variance, a.eps)));
    if (w) y = tf.mul(y, w);
    if (b) y = tf.add(y, b);
    return y;
  }

  // ---- shape ops ----------------------------------------------------------------------------------
  function flatten([x], a) {
    const start = axis(a.start_dim, x.rank), end = axis(a.end_dim, x.rank);
    const s = x.shape;
    return x.reshape([...s.slice(0, start), prod(s.slice(start, end + 1)), ...s.slice(end + 1)]);
  }

  function transpose([x], a) {
    const perm = x.shape.map((_, i) => i);
    const d0 = axis(a.dim0, x.rank), d1 = axis(a.dim1, x.rank);
    [perm[d0], perm[d1]] = [perm[d1], perm[d0]];
    return permute(x, perm);
  }

  function split([x], a) {
    const d = axis(a.dim, x.rank);
    const begin = x.shape.map((_, i) => (i === d ? a.start : 0));
    const size = x.shape.map((s, i) => (i === d ? a.length : -1));
    return tf.slice(x, begin, size);
  }

  // torch.matmul semantics: 1-D operands are promoted and squeezed; batch dims broadcast. Broadcasting
  // is made explicit (broadcastTo) so the gradient sums over broadcast dims correctly.
  function matmul([a, b]) {
    if (a.rank === 1 && b.rank === 1) return tf.sum(tf.mul(a, b));
    if (a.rank === 1) return tf.squeeze(matmul([tf.expandDims(a, 0), b]), [-2]);
    if (b.rank === 1) return tf.squeeze(matmul([a, tf.expandDims(b, 1)]), [-1]);
    if (b.rank === 2) { // the common x @ W: one big 2-D product
      const y = tf.matMul(a.reshape([-1, a.shape[a.rank - 1]]), b);
      return y.reshape([...a.shape.slice(0, -1), b.shape[1]]);
    }
    const batch = broadcastShape(a.shape.slice(0, -2), b.shape.slice(0, -2));
    const a2 = batchTo(a, batch), b2 = batchTo(b, batch);
    return tf.matMul(a2, b2);
  }

  function broadcastShape(s1, s2) {
    const n = Math.max(s1.length, s2.length);
    const p1 = Array(n - s1.length).fill(1).concat(s1), p2 = Array(n - s2.length).fill(1).concat(s2);
    return p1.map((d, i) => Math.max(d, p2[i]));
  }

  function batchTo(t, batch) {
    const target = [...batch, ...t.shape.slice(-2)];
    return target.every((d, i) => d === t.shape[i]) && t.rank === target.length ? t : tf.broadcastTo(t, target);
  }

  // ---- activations, attention ----------------------------------------------------------------------
  function logSoftmax(x, dim) {
    return tf.sub(x, tf.logSumExp(x, axis(dim, x.rank), true));
  }

  function softmax(x, dim) {
    return axis(dim, x.rank) === x.rank - 1 ? tf.softmax(x) : tf.exp(logSoftmax(x, dim));
  }

  function gelu([x], a) {
    if (a.approximate === "tanh") {
      const inner = tf.mul(tf.add(x, tf.mul(tf.pow(x, 3), 0.044715)), Math.sqrt(2 / Math.PI));
      return tf.mul(tf.mul(x, 0.5), tf.add(tf.tanh(inner), 1));
    }
    return tf.mul(tf.mul(x, 0.5), tf.add(tf.erf(tf.mul(x, Math.SQRT1_2)), 1));
  }

  // torch's formulas: relu6(x + 3) / 6 and x * relu6(x + 3) / 6; their gradients follow from relu6's.
  const hardsigmoid = ([x]) => tf.div(tf.relu6(tf.add(x, 3)), 6);
  const hardswish = ([x]) => tf.div(tf.mul(x, tf.relu6(tf.add(x, 3))), 6);

  // tf.elu has alpha 1. Otherwise relu(x) + alpha * (exp(min(x, 0)) - 1): each term is zero on the other's
  // side, exp never overflows, and the gradient at 0 is alpha as torch's (tf.where would need one for its
  // condition, which TF.js lacks).
  function elu([x], a) {
    if (a.alpha === 1) return tf.elu(x);
    return tf.add(tf.relu(x), tf.mul(tf.sub(tf.exp(tf.minimum(x, 0)), 1), a.alpha));
  }

  // Empty dims reduce over every dim, as torch.sum(x, []) and torch.mean(x, []) do.
  const reduce = (fn) => ([x], a) =>
    fn(x, a.dims.length ? a.dims.map((d) => axis(d, x.rank)) : null, a.keepdim);

  // torch's dropout (noise null) and dropout2d (one draw per sample and channel: noise [N, C, 1, ...], or
  // [N, 1, 1, C] channels last). tf.dropout refuses p = 1, where torch zeroes everything. ctx.seed (run's
  // seed and the node's name) makes the masks reproducible: TF.js draws them on the CPU with seedrandom's
  // alea, so a seed gives the same masks on every backend (but not torch's: docs/pipeline.md).
  function dropoutWith(x, p, ctx, noise) {
    if (!ctx.training || p === 0) return x;
    return p === 1 ? tf.mul(x, 0) : tf.dropout(x, p, noise, ctx.seed);
  }

  const dropout2dAt = ([x], a, ctx, channel) =>
    dropoutWith(x, a.p, ctx, x.shape.map((d, i) => (i === 0 || i === channel ? d : 1)));

  function causalMask(l, s) {
    const m = new Float32Array(l * s);
    for (let i = 0; i < l; i++) for (let j = i + 1; j < s; j++) m[i * s + j] = -1e9; // exp() underflows to 0
    return tf.tensor2d(m, [l, s]);
  }

  // q @ k^T over the last two dims. With the same batch dims (self-attention), matMul's transposeB reads k
  // as it is: no transpose kernel forward, nor its gradient backward.
  function matmulTransposed(q, k) {
    const sameBatch = q.rank === k.rank && q.rank >= 2 && q.shape.slice(0, -2).every((d, i) => d === k.shape[i]);
    return sameBatch ? tf.matMul(q, k, false, true) : matmul([q, tf.transpose(k, transposeLast(k.rank))]);
  }

  function attention([q, k, v], a) {
    const e = q.shape[q.rank - 1], l = q.shape[q.rank - 2], s = k.shape[k.rank - 2];
    let scores = tf.mul(matmulTransposed(q, k), 1 / Math.sqrt(e));
    if (a.is_causal) scores = tf.add(scores, causalMask(l, s));
    return matmul([tf.softmax(scores), v]);
  }

  function transposeLast(rank) {
    const perm = [...Array(rank).keys()];
    [perm[rank - 1], perm[rank - 2]] = [perm[rank - 2], perm[rank - 1]];
    return perm;
  }

  // Identity forward; backward passes the gradient only where `keep` (broadcast against x) is 1. Made per
  // call: `tf` does not exist yet when this script loads in Node (tests/js).
  function maskGradient(x, keep) {
    return tf.customGrad((t, k, save) => {
      save([k]); // kept by TF.js for the backward pass, which runs after the forward's tensors are gone
      return { value: tf.clone(t), gradFunc: (dy, [saved]) => [tf.mul(dy, saved), tf.zerosLike(saved)] };
    })(x, keep);
  }

  // x @ w^T. On WebGL an odd out_features (a classifier's 65-letter vocabulary, 5 classes) is padded to even
  // with a zero row of w, and the product sliced back: the backward product dy @ w then sums an even
  // dimension, all real lanes, so the step may run packed ("packed textures" below); the slice's gradient
  // pads dy with real zeros. The sums are those of the unpadded product: its padding lane held 0 * 0 too.
  // Not in a step known to run unpacked (a step that pools, say): there the padding would only cost kernels.
  function linearProduct(x, w) {
    const n = w.shape[0];
    if (even(n) || tf.getBackend() !== "webgl" || knownUnpacked) return tf.matMul(x, w, false, true);
    const y = tf.matMul(x, tf.pad(w, [[0, 1], [0, 0]]), false, true);
    return tf.slice(y, [0, 0], [-1, n]);
  }

  // With padding_idx, that row is looked up as usual but never receives a gradient (torch's padding_idx).
  function embedding([ids, w], a) {
    const flatIds = ids.reshape([-1]).toInt();
    let rows = tf.gather(w, flatIds);
    if (a.padding_idx !== null && a.padding_idx !== undefined) {
      const keep = tf.notEqual(flatIds, axis(a.padding_idx, w.shape[0])).toFloat().expandDims(1);
      rows = maskGradient(rows, keep);
    }
    return rows.reshape([...ids.shape, w.shape[1]]);
  }

  // ---- op table: one kernel per op of engine/spec.json (tests/js/shared_facts.test.mjs) ---------------
  const OPS = {
    linear: ([x, w, b]) => { // plain matMul + add: tf.fused.matMul is slower under gradients (tfjs 4.22)
      // A 2-D x skips the reshapes: each would be a tape node (and a saved copy) for nothing.
      let y = linearProduct(x.rank === 2 ? x : x.reshape([-1, w.shape[1]]), w);
      if (b) y = tf.add(y, b);
      return x.rank === 2 ? y : y.reshape([...x.shape.slice(0, -1), w.shape[0]]);
    },
    conv2d,
    batch_norm: batchNorm,
    layer_norm: layerNorm,
    embedding,
    relu: ([x]) => tf.relu(x),
    tanh: ([x]) => tf.tanh(x),
    sigmoid: ([x]) => tf.sigmoid(x),
    gelu,
    softmax: ([x], a) => softmax(x, a.dim),
    log_softmax: ([x], a) => logSoftmax(x, a.dim),
    dropout: ([x], a, ctx) => dropoutWith(x, a.p, ctx, null),
    max_pool2d: pool2d("max"),
    avg_pool2d: pool2d("avg"),
    adaptive_avg_pool2d: adaptiveAvgPool2d,
    flatten,
    reshape: ([x], a) => x.reshape(a.shape),
    permute: ([x], a) => permute(x, a.dims.map((d) => axis(d, x.rank))),
    transpose,
    add: ([p, q]) => tf.add(p, q),
    sub: ([p, q]) => tf.sub(p, q),
    mul: ([p, q]) => tf.mul(p, q),
    div: ([p, q]) => tf.div(p, q),
    scale: ([x], a) => tf.mul(x, a.factor),
    matmul,
    concat: (xs, a) => tf.concat(xs, axis(a.dim, xs[0].rank)),
    split,
    scaled_dot_product_attention: attention,
    arange_embedding: ([x, w]) => tf.slice(w, [0, 0], [x.shape[1], -1]),
    interpolate,
    conv_transpose2d: convTranspose2d,
    silu: ([x]) => tf.mul(x, tf.sigmoid(x)),
    hardswish,
    hardsigmoid,
    leaky_relu: ([x], a) => tf.leakyRelu(x, a.negative_slope), // its gradient is torch's, slope at 0
    elu,
    group_norm: groupNorm,
    reduce_mean: reduce((x, axes, keep) => tf.mean(x, axes, keep)), // `tf` is read per call (see maskGradient)
    reduce_sum: reduce((x, axes, keep) => tf.sum(x, axes, keep)),
    add_scalar: ([x], a) => tf.add(x, a.value),
    dropout2d: (args, a, ctx) => dropout2dAt(args, a, ctx, 1),
    // -1 is the batch size, read off `like` (the graph input); broadcastTo's gradient sums what it repeats.
    expand: ([x, like], a) => tf.broadcastTo(x, a.shape.map((s) => (s === -1 ? like.shape[0] : s))),
    // Stochastic depth: one draw per sample (dim 0 in either layout), so it runs channels last too.
    drop_path: ([x], a, ctx) => dropoutWith(x, a.p, ctx, x.shape.map((d, i) => (i === 0 ? d : 1))),
  };

  // Class dim is last: logits [N,C] with targets [N], or [N,T,C] with [N,T]; mean over all positions.
  // torch's F.cross_entropy, mean reduction (aten/src/ATen/native/LossNLL.cpp): positions whose target is
  // ignore_index count nowhere; the rest count by their target's class weight (1 without weights), and both
  // the picked and the label-smoothing terms are divided by the sum of those counts. So the loss is
  // -sum(q * log_softmax(z)) / total, q [N, C] holding each position's weight on each class.
  function targetWeights(target, weight, c, a) {
    const ids = target.reshape([-1]).toInt();
    // All zeros for an out-of-range ignore_index such as -100. Cast, not oneHot's dtype argument: TF.js 4.22's
    // WASM kernel ignores it and hands back int32 bits read as float32 (a loss of 2e-44; test_worker.py).
    const oneHot = tf.oneHot(ids, c).toFloat();
    // The usual case, in two kernels: an ignore_index that is no class id is exactly the rows oneHot zeroes
    // (other labels outside [0, C) would count nowhere too, where torch raises: datasets refuse them).
    const plain = !weight && a.label_smoothing === 0 && (a.ignore_index < 0 || a.ignore_index >= c);
    // No row kept: q is all 0, and a total of 1 makes the loss 0 (nothing scored, see below).
    if (plain) return { q: oneHot, total: tf.maximum(tf.sum(oneHot), 1) };
    const kept = tf.notEqual(ids, tf.scalar(a.ignore_index, "int32")).toFloat();
    const counts = weight ? tf.mul(kept, tf.sum(tf.mul(oneHot, weight), 1)) : kept;
    let q = tf.mul(oneHot, tf.mul(counts, 1 - a.label_smoothing).expandDims(1));
    if (a.label_smoothing > 0) {
      const spread = tf.mul(kept.expandDims(1), a.label_smoothing / c);
      q = tf.add(q, weight ? tf.mul(spread, weight) : spread);
    }
    // Nothing scored (every target ignored, or of a class weighted 0): torch's 0/0 is NaN, and an honest
    // volunteer's NaN would be judged invalid. The sum over nothing instead, as engine/ops.py's run_loss:
    // q = 0 over a total of 1 gives loss 0 and zero gradients (docs/graph-format.md).
    const total = tf.sum(counts);
    const scored = tf.greater(total, 0);
    return { q: tf.mul(q, scored.toFloat()), total: tf.where(scored, total, tf.onesLike(total)) };
  }

  // -sum(q * log_softmax(z)) / total as one op whose gradient is written out: torch's log_softmax backward
  // fed with nll's -q * dy / total, i.e. dz = (softmax(z) * sum(q, 1) - q) * dy / total. Autodiff of the
  // composite would run about three times the kernels (the max, the broadcasts and every sum have gradients,
  // and the targets' side is differentiated too), the larger part of a small model's step (benchmarks/engine).
  // q and total go through save(): f's own tensors are gone by the time the gradient runs. (A custom
  // gradient once broke parity on WebGL; the cause was packed textures, see "packed textures".)
  function weightedNll(z, q, total) {
    return tf.customGrad((logits, save) => {
      const shifted = tf.sub(logits, tf.max(logits, 1, true));
      const logProbs = tf.sub(shifted, tf.log(tf.sum(tf.exp(shifted), 1, true))); // torch's order of operations
      save([logProbs, q, total]);
      const value = tf.div(tf.sum(tf.mul(logProbs, q)), tf.neg(total));
      const gradFunc = (dy, [lp, weights, count]) =>
        tf.mul(tf.sub(tf.mul(tf.exp(lp), tf.sum(weights, 1, true)), weights), tf.div(dy, count));
      return { value, gradFunc };
    })(z);
  }

  function crossEntropy([logits, target, weight], a) {
    const c = logits.shape[logits.rank - 1];
    const { q, total } = targetWeights(target, weight, c, a);
    return weightedNll(logits.reshape([-1, c]), q, total);
  }

  // torch's l1 gradient is sign(d), 0 at d = 0; tf.abs's is -1 there, so |d| is written d * sign(d).
  function l1([pred, target]) {
    const d = tf.sub(pred, target);
    return tf.mean(tf.mul(d, tf.sign(d)));
  }

  const LOSSES = {
    cross_entropy: crossEntropy,
    mse: ([pred, target]) => tf.mean(tf.squaredDifference(pred, target)),
    l1,
  };

  // ---- model: params as trainable variables, buffers as non-trainable ones -----------------------
  function tensorFor(spec, weights, kind) {
    const w = weights[spec.name];
    if (!w) throw new Error(`weights: missing ${kind} ${spec.name}`);
    if (w.shape.length !== spec.shape.length || w.shape.some((d, i) => d !== spec.shape[i])) {
      throw new Error(`weights: ${spec.name} has shape [${w.shape}], graph says [${spec.shape}]`);
    }
    return tf.tensor(w.data, spec.shape, "float32");
  }

  function makeVariables(specs, weights, kind, trainable) {
    const vars = {};
    for (const spec of specs) {
      const init = tensorFor(spec, weights, kind);
      vars[spec.name] = tf.variable(init, trainable); // auto names: tf.variable names are global
      init.dispose();
    }
    return vars;
  }

  function assignAll(vars, specs, weights, kind) {
    for (const spec of specs) {
      const value = tensorFor(spec, weights, kind);
      vars[spec.name].assign(value);
      value.dispose();
    }
  }

  // ---- packed textures (WebGL) ---------------------------------------------------------------------
  // TF.js 4.22's WebGL backend stores values as "packed" 2x2 texels, an odd-sized axis ending in padding
  // lanes. Its packed elementwise ops do not keep those lanes 0 (sigmoid writes 0.5, exp 1, a broadcast
  // subtraction -m), and a few kernels sum a texel's lanes along one dimension, the padding lanes too when
  // that dimension is odd: once an SGD step carried such lanes into the weights, torch parity broke from the
  // second local step (tests/browser/test_local_steps.py, hand:odd: 0.8%). Every other WebGL kernel computes
  // a real lane from real lanes only: elementwise ops lane by lane (broadcasts included), slice, transpose,
  // pad, concat, reshape and gather by coordinates, reductions and pooling unpacked. So a step whose lane
  // sums all run over even dimensions never reads a padding lane, whatever the lanes hold, and may run the
  // packed elementwise kernels (4 values per texel, no pack/unpack around matmuls and convolutions: fewer,
  // cheaper kernels, benchmarks/engine). Other steps run them unpacked (no padding lanes to spoil); the
  // remaining packed kernels write zeros there. The page-wide default is unpacked (guardPackedTextures);
  // packedSteps below decides per step (and keeps steps that pool unpacked, for speed: POOLS).
  const SAFE_WEBGL_FLAGS = { WEBGL_PACK_BINARY_OPERATIONS: false, WEBGL_PACK_UNARY_OPERATIONS: false };

  function guardPackedTextures() {
    if (tf.getBackend() !== "webgl") return;
    for (const [flag, value] of Object.entries(SAFE_WEBGL_FLAGS)) tf.env().set(flag, value);
  }

  // f() with WebGL's elementwise kernels packed or not, the flags restored afterwards.
  function withElementwise(packed, f) {
    const flags = Object.keys(SAFE_WEBGL_FLAGS);
    const saved = flags.map((flag) => tf.env().getBool(flag));
    if (tf.getBackend() !== "webgl" || saved.every((v) => v === packed)) return f();
    flags.forEach((flag) => tf.env().set(flag, packed));
    try {
      return f();
    } finally {
      flags.forEach((flag, i) => tf.env().set(flag, saved[i]));
    }
  }

  // f() with WebGL's packed elementwise kernels, for work that cannot spoil a padding lane: inputs with clean
  // lanes (what matmuls, convolutions, sums and uploads leave) and no broadcast but of scalars, f(0, 0) = 0.
  // optim.js updates weights so: a weight then stays in the packed layout its matmul reads, instead of
  // being unpacked for the update and packed again for the next forward, whole, every step.
  const withPackedElementwise = (f) => withElementwise(true, f);

  // The WebGL kernels that sum packed lanes (TF.js 4.22, tfjs-backend-webgl/src): whether the sum is safe.
  // - BatchMatMul (mulmat_packed_gpu) sums the shared dimension. A step's backward runs its own products
  //   (dy @ w^T sums the output width, x^T @ dy the rows), which dispatch as BatchMatMul too.
  // - Conv2D: a 1x1 stride-1 unpadded convolution is a product summing C_in (conv2dByMatMul); any other is
  //   im2col x reshaped filter, summing kh*kw*C_in. There both operands' padding lanes on that dimension are
  //   exact zeros whatever the inputs hold: Im2ColPackedProgram writes 0 outside its shape, and when kh*kw
  //   and C_in are odd the filter's reshape to [kh*kw*C_in, C_out] is not free (isReshapeFree), so
  //   ReshapePackedProgram (or PackProgram, for an unpacked filter) writes it, zeros in the padding too.
  //   (WEBGL_EXP_CONV's packed convolution would be another matter; it is off by default.)
  // - Conv2DBackpropInput (conv_backprop_packed_gpu: input gradients, conv_transpose2d) sums dy's channels.
  const LANE_SUMS = {
    BatchMatMul: ({ a }, { transposeA }) => even(a.shape[a.rank - (transposeA ? 2 : 1)]),
    _FusedMatMul: ({ a }, { transposeA }) => even(a.shape[a.rank - (transposeA ? 2 : 1)]),
    Conv2D: ({ filter }) => {
      const [kh, kw, cin] = filter.shape;
      return even(kh * kw * cin) || (kh * kw > 1 && !tf.env().getBool("WEBGL_EXP_CONV"));
    },
    Conv2DBackpropInput: ({ filter }) => even(filter.shape[3]),
  };
  // Kernels that also sum lanes (depthwise and fused convolutions, LRN, argmax): the interpreter runs none,
  // so they simply count as unsafe.
  const OTHER_LANE_SUMS = new Set([
    "FusedConv2D", "DepthwiseConv2dNative", "FusedDepthwiseConv2D", "DepthwiseConv2dNativeBackpropInput",
    "DepthwiseConv2dNativeBackpropFilter", "LRN", "LRNGrad", "ArgMax", "ArgMin",
  ]);

  // Pooling has only unpacked WebGL kernels: in a packed step its inputs are unpacked and its gradients
  // packed again, whole activations each time. A CNN with max pools ran 8% slower packed than unpacked
  // (benchmarks/engine, both in one page), nanoGPT 18% faster, an MLP and a pooled 1-D CNN alike: steps
  // that pool stay unpacked.
  const POOLS = new Set(["MaxPool", "AvgPool"]);

  // Runs f (unpacked) and notes whether every kernel it dispatches, gradients included (every op goes
  // through the engine's runKernel), sums lanes only where that is safe, and whether none pools:
  // {result, safe}, safe meaning both.
  function auditLaneSums(f) {
    const engine = tf.engine(), runKernel = engine.runKernel;
    let safe = true;
    engine.runKernel = function (name, inputs, attrs) {
      const check = LANE_SUMS[name];
      if (check ? !check(inputs, attrs || {}) : OTHER_LANE_SUMS.has(name) || POOLS.has(name)) safe = false;
      return runKernel.apply(this, arguments);
    };
    try {
      const result = withElementwise(false, f);
      return { result, safe };
    } finally {
      engine.runKernel = runKernel;
    }
  }

  // Per model: the verdict for each kind of step (key: what is computed and every shape fed; the graph fixes
  // the rest, so the same key runs the same kernels on the same shapes), whether a step ever ran packed, and
  // how many steps ran each way (tests read them through packingStats).
  const PACKING = new WeakMap();
  function packingOf(model) {
    if (!PACKING.has(model)) PACKING.set(model, { verdicts: new Map(), dirty: false, packed: 0, unpacked: 0 });
    return PACKING.get(model);
  }

  const shapesKey = (tensors) =>
    Object.keys(tensors).sort().map((n) => `${n}:${tensors[n].dtype}[${tensors[n].shape}]`).join(" ");

  // f(), one step of `model`, with packed elementwise kernels where its kind of step was found safe. The
  // first step of a kind runs unpacked and is audited. A packed step may leave anything in the padding lanes
  // of the weights, and the optimizer's state carries them on (optim.js updates packed), so once a model
  // has run packed, an unpacked step first rewrites its params and buffers with clean lanes (scrub).
  function packedSteps(model, key, f) {
    if (tf.getBackend() !== "webgl") return f();
    const state = packingOf(model);
    const verdict = state.verdicts.get(key);
    if (verdict) {
      state.dirty = true;
      state.packed++;
      return withElementwise(true, f);
    }
    if (state.dirty) scrub(model);
    state.unpacked++;
    if (verdict === false) return unpackedStep(f);
    const { result, safe } = auditLaneSums(f);
    state.verdicts.set(key, safe);
    return result;
  }

  // Whether the step running is one packedSteps knows to run unpacked (linearProduct reads it).
  let knownUnpacked = false;
  function unpackedStep(f) {
    const outer = knownUnpacked;
    knownUnpacked = true;
    try {
      return withElementwise(false, f);
    } finally {
      knownUnpacked = outer;
    }
  }

  // x * 1 is exact, and unpacked: the copy has no padding lanes (a matmul packs it anew, zeros in them).
  function scrub(model) {
    withElementwise(false, () => {
      for (const v of [...Object.values(model.params), ...Object.values(model.buffers)]) {
        const clean = tf.tidy(() => tf.mul(v, 1));
        v.assign(clean);
        clean.dispose();
      }
    });
  }

  // {packed, unpacked}: how many steps of `model` ran each way.
  function packingStats(model) {
    const { packed, unpacked } = packingOf(model);
    return { packed, unpacked };
  }

  // weights: decoded safetensors {name: {shape, data}} (codecs.decode). Set the backend first.
  function createModel(graph, weights) {
    guardPackedTextures();
    const params = makeVariables(graph.params, weights, "param", true);
    const buffers = makeVariables(graph.buffers || [], weights, "buffer", false);
    return {
      graph, params, buffers,
      setWeights(next) {
        assignAll(params, graph.params, next, "param");
        assignAll(buffers, graph.buffers || [], next, "buffer");
      },
      dispose() { for (const v of [...Object.values(params), ...Object.values(buffers)]) v.dispose(); },
    };
  }

  // ---- channels-last execution ----------------------------------------------------------------------
  // TF.js convolutions and pools are NHWC. Instead of transposing around every conv, a value a conv
  // makes stays NHWC while it flows through ops that do not care about layout (below); it is transposed
  // to the graph's NCHW only when an op needs that, once however many nodes read it. Semantics are the
  // graph's exactly: only where the data sits in memory changes.
  const UNARY = new Set([
    "relu", "tanh", "sigmoid", "gelu", "dropout", "scale", "silu", "hardswish", "hardsigmoid", "leaky_relu", "elu",
    "add_scalar", "drop_path",
  ]);
  const BINARY = new Set(["add", "sub", "mul", "div"]);
  const NHWC_POOLS = { max_pool2d: poolNHWC("max"), avg_pool2d: poolNHWC("avg") };
  const isGlobalPool = (a) => { const [h, w] = pair(a.output_size); return h === 1 && w === 1; };

  // The graph's shape for a channels-last value [N, ...spatial, C].
  const graphShape = (t) => [t.shape[0], t.shape[t.rank - 1], ...t.shape.slice(1, -1)];

  // A reshape that keeps N and C and only adds or drops spatial axes of size 1 (how a conv1d is lowered to
  // conv2d and back: [N, C, L] <-> [N, C, 1, L]) moves no data in channels-last form either: [N, L, C] <->
  // [N, 1, L, C], a free reshape where the graph's layout would cost a transpose each way. Else null.
  function channelsLastReshape(shape, xcl) {
    const from = graphShape(xcl);
    const known = prod(shape.filter((d) => d !== -1));
    const to = shape.map((d) => (d === -1 ? xcl.size / known : d));
    const spatial = (s) => s.slice(2).filter((d) => d !== 1).join(",");
    const keeps = to.length >= 3 && to[0] === from[0] && to[1] === from[1] && spatial(to) === spatial(from);
    return keeps ? ([x]) => x.reshape([to[0], ...to.slice(2), to[1]]) : null;
  }

  // reduce_mean / reduce_sum over spatial axes only (global average pooling written x.mean(-1) or
  // x.mean((2, 3))), read channels last: the result stays so ([N, C] reads the same either way).
  function spatialReduce(node, xcl) {
    const { dims, keepdim } = node.attrs;
    const axes = dims.map((d) => axis(d, xcl.rank));
    if (!axes.length || axes.some((d) => d < 2)) return null;
    const fn = node.op === "reduce_mean" ? tf.mean : tf.sum;
    return ([x]) => fn(x, axes.map((d) => d - 1), keepdim);
  }

  // The NHWC implementation of `node` given which values have an NHWC form (`nhwc`), else null.
  // Which inputs it reads NHWC: the first, and for binary ops both (same shapes: no broadcasting).
  function nhwcKernel(node, nhwc) {
    const [first, second] = node.inputs;
    if (node.op === "conv2d") return convNHWC; // converts its input if need be: it has to anyway
    if (node.op === "conv_transpose2d") return convTransposeNHWC;
    if (first === null || !nhwc.has(first)) return null;
    if (UNARY.has(node.op)) return OPS[node.op];
    if (node.op === "batch_norm") return (args, a, ctx) => batchNormAt(args, a, ctx, args[0].rank - 1);
    if (node.op === "dropout2d") return (args, a, ctx) => dropout2dAt(args, a, ctx, args[0].rank - 1);
    if (node.op === "reshape") return channelsLastReshape(node.attrs.shape, nhwc.get(first));
    if (node.op === "reduce_mean" || node.op === "reduce_sum") return spatialReduce(node, nhwc.get(first));
    if (NHWC_POOLS[node.op]) return NHWC_POOLS[node.op];
    if (node.op === "adaptive_avg_pool2d" && isGlobalPool(node.attrs || {})) return ([x]) => tf.mean(x, [1, 2], true);
    const sameShape = (p, q) => p.rank === q.rank && p.shape.every((d, i) => d === q.shape[i]);
    if (BINARY.has(node.op) && nhwc.has(second) && sameShape(nhwc.get(first), nhwc.get(second))) return OPS[node.op];
    return null;
  }

  // feeds: {name: tf.Tensor} for graph inputs and (optionally) targets. Returns {output, loss, updates}
  // where updates are new buffer values the caller applies (see applyUpdates) once gradients are done.
  // seed (optional): dropout masks drawn from it, so that a pipeline stage's backward unit recomputes
  // its forward unit's masks; without one they are random.
  function run(model, feeds, training, seed) {
    const env = new Map([...Object.entries(model.params), ...Object.entries(model.buffers), ...Object.entries(feeds)]);
    const nhwc = new Map(); // name -> the same value, channels last
    const get = (name) => {
      if (!env.has(name) && nhwc.has(name)) env.set(name, toNCHW(nhwc.get(name)));
      return env.get(name);
    };
    const getNHWC = (name) => {
      if (!nhwc.has(name)) nhwc.set(name, toNHWC(get(name)));
      return nhwc.get(name);
    };
    const updates = [];
    for (const node of model.graph.nodes) {
      const ctx = { training, node, update: (name, value) => updates.push([name, value]),
        seed: seed === undefined || seed === null ? undefined : `${seed}:${node.name}` };
      const kernel = nhwcKernel(node, nhwc);
      const channelsLast = (i) => kernel && (i === 0 || BINARY.has(node.op));
      const args = node.inputs.map((name, i) => (name === null ? null : channelsLast(i) ? getNHWC(name) : get(name)));
      const y = (kernel || OPS[node.op])(args, node.attrs || {}, ctx);
      (kernel && y.rank >= 3 ? nhwc : env).set(node.name, y); // [N, C] reads the same either way
    }
    const lossSpec = model.graph.loss;
    const lossInputs = lossSpec ? lossSpec.inputs.filter((name) => name !== null) : [];
    const haveTargets = lossSpec && lossInputs.every((name) => env.has(name) || nhwc.has(name));
    const loss = haveTargets ? LOSSES[lossSpec.op](lossInputs.map(get), lossSpec.attrs || {}) : null;
    return { output: get(model.graph.output), loss, updates };
  }

  function applyUpdates(model, updates) {
    for (const [name, value] of updates) {
      model.buffers[name].assign(value); // the variable now shares value's data; disposing value is safe
      value.dispose();
    }
  }

  // Forward pass (and loss when targets are fed). Returned tensors belong to the caller. With
  // update: false the model's buffers stay as they are and the new values come back as `buffers`
  // ({name: tf.Tensor}): a pipeline forward unit reports them and leaves the cached model unchanged.
  function forward(model, feeds, { training = false, seed, update = true } = {}) {
    let updates = [];
    const result = packedSteps(model, `forward ${training} ${shapesKey(feeds)}`, () => tf.tidy(() => {
      const r = run(model, feeds, training, seed);
      updates = r.updates;
      updates.forEach(([, t]) => tf.keep(t));
      return r.loss ? { output: r.output, loss: r.loss } : { output: r.output };
    }));
    if (update) applyUpdates(model, updates);
    else result.buffers = lastUpdates(updates);
    return result;
  }

  // {name: the last value given}; earlier values of the same buffer are disposed.
  function lastUpdates(updates) {
    const out = {};
    for (const [name, value] of updates) {
      if (out[name]) out[name].dispose();
      out[name] = value;
    }
    return out;
  }

  // Gradient of the mean loss w.r.t. every param: {loss: scalar tf.Tensor, grads: {name: tf.Tensor}}.
  // Params the loss does not reach get zeros, like torch's grads after zero_grad.
  function gradients(model, feeds, { training = true } = {}) {
    const names = Object.keys(model.params);
    const vars = names.map((n) => model.params[n]);
    let updates = [];
    const { value, grads } = packedSteps(model, `gradients ${training} ${shapesKey(feeds)}`, () => tf.variableGrads(() => {
      const r = run(model, feeds, training);
      if (!r.loss) throw new Error("gradients need the graph's loss and its targets");
      updates = r.updates.map(([name, t]) => [name, tf.keep(t)]); // f runs inside a tidy
      return r.loss;
    }, vars));
    applyUpdates(model, updates);
    const named = {};
    names.forEach((n, i) => { named[n] = grads[vars[i].name] || tf.zerosLike(vars[i]); });
    return { loss: value, grads: named };
  }

  // The vector-Jacobian product of a pipeline stage's backward unit (pipeline.js): backpropagates `dy`, the
  // gradient of the output (or with fromLoss, of the loss: a scalar, the micro-batch's loss scale), to every
  // param and to the feeds named in `wrt`. Returns {value: the output (or the unscaled loss), grads: {param},
  // inputGrads: {feed}, buffers: {name: new value}}, zeros where nothing flows. The buffer updates of the
  // recomputed forward (batch-norm statistics) are returned, not applied, as forward's update: false does:
  // a backward unit reports them and leaves the cached model unchanged.
  // tf.variableGrads takes no dy, so this is the engine's own gradients(), which variableGrads wraps.
  function backpropagate(model, feeds, dy, { fromLoss = false, wrt = [], training = true, seed } = {}) {
    const names = Object.keys(model.params);
    const xs = [...names.map((n) => model.params[n]), ...wrt.map((n) => feeds[n])];
    let updates = [];
    const f = () => {
      const r = run(model, feeds, training, seed);
      updates = r.updates.map(([name, t]) => [name, tf.keep(t)]); // f runs inside a tidy
      const y = fromLoss ? r.loss : r.output;
      if (!y) throw new Error("backpropagate: the loss needs the graph's targets");
      if (y.rank !== dy.rank || y.shape.some((d, i) => d !== dy.shape[i])) {
        throw new Error(`backpropagate: dy has shape [${dy.shape}], the ${fromLoss ? "loss" : "output"} [${y.shape}]`);
      }
      return y;
    };
    const key = `backpropagate ${training} ${fromLoss} [${wrt}] [${dy.shape}] ${shapesKey(feeds)}`;
    let result;
    try {
      result = packedSteps(model, key, () => (xs.length ? tf.engine().gradients(f, xs, dy, true) : { value: tf.tidy(f), grads: [] }));
    } catch (err) {
      tf.dispose(updates.map(([, t]) => t));
      throw err;
    }
    const { value, grads } = result;
    const gradOf = (i) => grads[i] || tf.zerosLike(xs[i]);
    const named = {}, inputGrads = {};
    names.forEach((n, i) => { named[n] = gradOf(i); });
    wrt.forEach((n, i) => { inputGrads[n] = gradOf(names.length + i); });
    return { value, grads: named, inputGrads, buffers: lastUpdates(updates) };
  }

  ns.runtime = {
    createModel, forward, gradients, backpropagate, withPackedElementwise, packingStats, OPS, LOSSES,
    SAFE_WEBGL_FLAGS,
  };
})((self.crowdtrain = self.crowdtrain || {}));
