// Safetensors parse/serialize and the tensor codecs of docs/protocol.md (fp32, fp16, blockwise int8 and int4,
// sparse top-k), bit-identical to engine/codecs.py and engine/lowbit.py.
// Classic script: attaches to self.crowdtrain.codecs (works in pages and in Web Workers).
(function (ns) {
  "use strict";

  const DTYPE_BYTES = { F32: 4, F16: 2, I8: 1, U8: 1, I16: 2, I32: 4, I64: 8 };
  const SCALE_SUFFIX = ":scale";
  const INDEX_SUFFIX = ":index";
  const SHAPE_PREFIX = "shape:"; // metadata: an int4 or topk tensor's dense shape, "d0,d1,..."
  const DEFAULT_BLOCK = 256;
  const DEFAULT_BLOCKS = { int8: 256, int4: 256, topk: 4096 }; // engine.codecs.DEFAULT_BLOCK_SIZES
  const TOPK_DENSITY = 64; // topk keeps blockSize / 64 values a block unless told
  const INT4_LEVEL = 7, NIBBLE_ZERO = 8;

  // ---- float16 <-> float32 -------------------------------------------------------------
  const f32 = new Float32Array(1);
  const u32 = new Uint32Array(f32.buffer);

  // Round-to-nearest-even, like numpy/torch .half(); handles subnormals, inf and NaN.
  function toHalf(value) {
    f32[0] = value;
    const x = u32[0];
    const sign = (x >>> 16) & 0x8000;
    const exp = (x >>> 23) & 0xff;
    let mant = x & 0x7fffff;
    if (exp === 0xff) return sign | 0x7c00 | (mant ? 0x200 : 0);
    const e = exp - 112; // rebias 127 -> 15
    if (e >= 0x1f) return sign | 0x7c00;
    if (e <= 0) {
      if (e < -10) return sign; // below half the smallest subnormal
      mant |= 0x800000;
      return sign | roundShift(mant, 14 - e);
    }
    // A carry out of the mantissa correctly bumps the exponent (up to inf).
    return sign | ((e << 10) + roundShift(mant, 13));
  }

  function roundShift(mant, shift) {
    const kept = mant >>> shift;
    const rest = mant & ((1 << shift) - 1);
    const half = 1 << (shift - 1);
    return rest > half || (rest === half && (kept & 1)) ? kept + 1 : kept;
  }

  function halfToFloat(h) {
    const sign = h & 0x8000 ? -1 : 1;
    const exp = (h >>> 10) & 0x1f;
    const mant = h & 0x3ff;
    if (exp === 0) return sign * mant * 2 ** -24;
    if (exp === 0x1f) return mant ? NaN : sign * Infinity;
    return sign * (1 + mant / 1024) * 2 ** (exp - 15);
  }

  let halfTable = null; // 65536 entries, built on first use (256 KB)
  function halfsToFloats(halfs) {
    if (!halfTable) {
      halfTable = new Float32Array(65536);
      for (let h = 0; h < 65536; h++) halfTable[h] = halfToFloat(h);
    }
    const out = new Float32Array(halfs.length);
    for (let i = 0; i < halfs.length; i++) out[i] = halfTable[halfs[i]];
    return out;
  }

  function floatsToHalfs(floats) {
    const out = new Uint16Array(floats.length);
    for (let i = 0; i < floats.length; i++) out[i] = toHalf(floats[i]);
    return out;
  }

  // ---- safetensors container ------------------------------------------------------------
  function asBytes(buf) {
    if (buf instanceof Uint8Array) return buf;
    if (ArrayBuffer.isView(buf)) return new Uint8Array(buf.buffer, buf.byteOffset, buf.byteLength);
    return new Uint8Array(buf);
  }

  function readHeader(bytes) {
    if (bytes.byteLength < 8) throw new Error("safetensors: file shorter than its length prefix");
    const view = new DataView(bytes.buffer, bytes.byteOffset, 8);
    const len = view.getUint32(0, true) + view.getUint32(4, true) * 2 ** 32;
    if (8 + len > bytes.byteLength) throw new Error("safetensors: header longer than file");
    const header = JSON.parse(new TextDecoder().decode(bytes.subarray(8, 8 + len)));
    return { header, dataStart: 8 + len };
  }

  // Copies the raw bytes so typed arrays are aligned and independent of the (maybe huge) file.
  function rawTensor(bytes, dataStart, name, info) {
    const width = DTYPE_BYTES[info.dtype];
    if (!width) throw new Error(`safetensors: unsupported dtype ${info.dtype} for ${name}`);
    const [begin, end] = info.data_offsets;
    const count = info.shape.reduce((a, b) => a * b, 1);
    if (end - begin !== count * width || dataStart + end > bytes.byteLength) {
      throw new Error(`safetensors: bad data_offsets for ${name}`);
    }
    return bytes.slice(dataStart + begin, dataStart + end).buffer;
  }

  function typedData(dtype, buffer) {
    switch (dtype) {
      case "F32": return new Float32Array(buffer);
      case "F16": return halfsToFloats(new Uint16Array(buffer));
      case "I8": return new Int8Array(buffer);
      case "U8": return new Uint8Array(buffer);
      case "I16": return new Int16Array(buffer);
      case "I32": return new Int32Array(buffer);
      case "I64": return lowWords(new Int32Array(buffer)); // ids and labels fit in int32
      default: throw new Error(`unsupported dtype ${dtype}`);
    }
  }

  function lowWords(pairs) {
    const out = new Int32Array(pairs.length / 2);
    for (let i = 0; i < out.length; i++) out[i] = pairs[2 * i];
    return out;
  }

  // -> {metadata, tensors: {name: {dtype (as stored), shape, data}}}; F16 is widened to Float32Array,
  // I64 narrowed to Int32Array.
  function parse(buf) {
    const bytes = asBytes(buf);
    const { header, dataStart } = readHeader(bytes);
    const tensors = {};
    for (const [name, info] of Object.entries(header)) {
      if (name === "__metadata__") continue;
      const data = typedData(info.dtype, rawTensor(bytes, dataStart, name, info));
      tensors[name] = { dtype: info.dtype, shape: info.shape.slice(), data };
    }
    return { metadata: header.__metadata__ || {}, tensors };
  }

  function storedBytes(t) {
    if (t.dtype === "F16") return new Uint8Array(floatsToHalfs(t.data).buffer);
    return new Uint8Array(t.data.buffer, t.data.byteOffset, t.data.byteLength);
  }

  // entries: [{name, dtype, shape, data}] with data already in the stored type (F16 given as floats).
  function serialize(entries, metadata) {
    // Widest dtypes first keeps every tensor aligned to its element size, as safetensors does.
    const sorted = entries.slice().sort((a, b) =>
      DTYPE_BYTES[b.dtype] - DTYPE_BYTES[a.dtype] || (a.name < b.name ? -1 : a.name > b.name ? 1 : 0));
    const header = {};
    // Sorted keys, as the Python encoder writes them: the same tensors give the same bytes.
    if (metadata) header.__metadata__ = Object.fromEntries(Object.entries(metadata).sort(([a], [b]) => (a < b ? -1 : a > b ? 1 : 0)));
    const chunks = [];
    let offset = 0;
    for (const t of sorted) {
      const raw = storedBytes(t);
      header[t.name] = { dtype: t.dtype, shape: t.shape, data_offsets: [offset, offset + raw.byteLength] };
      chunks.push(raw);
      offset += raw.byteLength;
    }
    let json = new TextEncoder().encode(JSON.stringify(header));
    const padded = Math.ceil(json.byteLength / 8) * 8; // spaces keep the data section 8-aligned
    const out = new Uint8Array(8 + padded + offset);
    new DataView(out.buffer).setUint32(0, padded, true);
    out.fill(0x20, 8, 8 + padded);
    out.set(json, 8);
    let pos = 8 + padded;
    for (const raw of chunks) { out.set(raw, pos); pos += raw.byteLength; }
    return out;
  }

  // ---- codecs -------------------------------------------------------------------------------
  function roundHalfEven(v) {
    const r = Math.round(v);
    return r - v === 0.5 && r % 2 !== 0 ? r - 1 : r;
  }

  // Blockwise symmetric int8: scale = max|x| / level (127; int4: 7) per block of the flattened tensor.
  function quantizeInt8(data, blockSize, level = 127) {
    const blocks = Math.ceil(data.length / blockSize);
    const q = new Int8Array(data.length);
    const scales = new Float32Array(blocks);
    for (let b = 0; b < blocks; b++) {
      const lo = b * blockSize, hi = Math.min(lo + blockSize, data.length);
      let amax = 0;
      for (let i = lo; i < hi; i++) amax = Math.max(amax, Math.abs(data[i]));
      const scale = Math.fround(amax / level);
      scales[b] = scale;
      if (scale === 0) continue; // all-zero block: q stays 0
      for (let i = lo; i < hi; i++) {
        const v = roundHalfEven(Math.fround(data[i] / scale));
        q[i] = Math.max(-level, Math.min(level, v));
      }
    }
    return { q, scales };
  }

  function dequantizeInt8(q, scales, blockSize) {
    const out = new Float32Array(q.length);
    for (let i = 0; i < q.length; i++) out[i] = q[i] * scales[Math.floor(i / blockSize)];
    return out;
  }

  // int4: codes -7..7 stored as code + 8, two a byte, the first of a pair in the low nibble.
  function packNibbles(q) {
    const out = new Uint8Array(Math.ceil(q.length / 2));
    for (let i = 0; i < out.length; i++) {
      const hi = 2 * i + 1 < q.length ? q[2 * i + 1] + NIBBLE_ZERO : NIBBLE_ZERO;
      out[i] = (q[2 * i] + NIBBLE_ZERO) | (hi << 4);
    }
    return out;
  }

  function unpackInt4(packed, scales, blockSize, count) {
    const out = new Float32Array(count);
    for (let i = 0; i < count; i++) {
      const code = ((packed[i >> 1] >> ((i & 1) * 4)) & 15) - NIBBLE_ZERO;
      out[i] = code * scales[Math.floor(i / blockSize)];
    }
    return out;
  }

  // topk: per block, the `keep` largest magnitudes (ties to the lower index; a partial last block keeps
  // min(keep, its length)), their offsets within the block increasing, as engine/lowbit.py chooses them.
  function topkSelect(data, blockSize, keep) {
    const offsets = [], values = [];
    for (let lo = 0; lo < data.length; lo += blockSize) {
      const hi = Math.min(lo + blockSize, data.length);
      const order = Array.from({ length: hi - lo }, (_, i) => i);
      order.sort((a, b) => Math.abs(data[lo + b]) - Math.abs(data[lo + a]) || a - b);
      const kept = order.slice(0, keep).sort((a, b) => a - b);
      for (const i of kept) { offsets.push(i); values.push(data[lo + i]); }
    }
    return { offsets: Int16Array.from(offsets), values: Float32Array.from(values) };
  }

  function untopk(values, offsets, scales, blockSize, keep, count) {
    const kept = dequantizeInt8(values, scales, keep);
    const out = new Float32Array(count);
    for (let j = 0; j < kept.length; j++) out[Math.floor(j / keep) * blockSize + offsets[j]] = kept[j];
    return out;
  }

  function encodeOne(t, codec, blockSize, keep) {
    if (codec === "fp32") return [{ name: t.name, dtype: "F32", shape: t.shape, data: Float32Array.from(t.data) }];
    if (codec === "fp16") return [{ name: t.name, dtype: "F16", shape: t.shape, data: t.data }];
    const scaled = (scales) => [{ name: t.name + SCALE_SUFFIX, dtype: "F32", shape: [scales.length], data: scales }];
    if (codec === "int8") {
      const { q, scales } = quantizeInt8(t.data, blockSize);
      return [{ name: t.name, dtype: "I8", shape: t.shape, data: q }, ...scaled(scales)];
    }
    if (codec === "int4") {
      const { q, scales } = quantizeInt8(t.data, blockSize, INT4_LEVEL);
      const packed = packNibbles(q);
      return [{ name: t.name, dtype: "U8", shape: [packed.length], data: packed }, ...scaled(scales)];
    }
    if (codec === "topk") {
      const { offsets, values } = topkSelect(t.data, blockSize, keep);
      const { q, scales } = quantizeInt8(values, keep);
      return [{ name: t.name, dtype: "I8", shape: [q.length], data: q },
        { name: t.name + INDEX_SUFFIX, dtype: "I16", shape: [offsets.length], data: offsets }, ...scaled(scales)];
    }
    throw new Error(`unknown codec ${codec}`);
  }

  function tensorList(tensors) {
    return Array.isArray(tensors) ? tensors : Object.entries(tensors).map(([name, t]) => ({ name, ...t }));
  }

  // tensors: {name: {shape, data: Float32Array}} or [{name, shape, data}] -> safetensors bytes.
  // options: {blockSize, keep (topk: values kept per block)}.
  function encode(tensors, codec = "fp32", options = {}) {
    const blockSize = options.blockSize || DEFAULT_BLOCK;
    const keep = options.keep || defaultKeep(blockSize);
    const metadata = { codec, block_size: String(blockSize) };
    if (codec === "int4" && blockSize % 2) throw new Error("int4 needs an even block size");
    if (codec === "topk") {
      if (blockSize > 32768 || keep > blockSize) throw new Error("topk needs blockSize <= 32768 and keep <= blockSize");
      metadata.keep = String(keep);
    }
    const entries = [];
    for (const t of tensorList(tensors)) {
      entries.push(...encodeOne(t, codec, blockSize, keep));
      if (codec === "int4" || codec === "topk") metadata[SHAPE_PREFIX + t.name] = t.shape.join(",");
    }
    return serialize(entries, metadata);
  }

  function defaultKeep(blockSize) {
    return Math.max(1, Math.floor(blockSize / TOPK_DENSITY));
  }

  // Each int4/topk tensor's dense shape, from the metadata (decoded from trusted bytes: the server's).
  function lowbitShapes(metadata) {
    const shapes = {};
    for (const [key, value] of Object.entries(metadata)) {
      if (key.startsWith(SHAPE_PREFIX)) shapes[key.slice(SHAPE_PREFIX.length)] = value ? value.split(",").map(Number) : [];
    }
    return shapes;
  }

  function decodeLowbit(name, shape, tensors, metadata, blockSize) {
    const count = shape.reduce((a, b) => a * b, 1);
    const scales = tensors[name + SCALE_SUFFIX].data;
    if (metadata.codec === "int4") return unpackInt4(tensors[name].data, scales, blockSize, count);
    const keep = parseInt(metadata.keep, 10);
    return untopk(tensors[name].data, tensors[name + INDEX_SUFFIX].data, scales, blockSize, keep, count);
  }

  // safetensors bytes (any codec) -> {name: {shape, data}}: float tensors as Float32Array
  // (int8 dequantized with its `name:scale`), integer tensors (labels, ids) as Int32Array.
  function decode(buf) {
    const { metadata, tensors } = parse(buf);
    const blockSize = parseInt(metadata.block_size || DEFAULT_BLOCK, 10);
    const shapes = lowbitShapes(metadata);
    const parts = new Set(Object.keys(shapes).flatMap((name) => [name + SCALE_SUFFIX, name + INDEX_SUFFIX]));
    const out = {};
    for (const [name, t] of Object.entries(tensors)) {
      if (parts.has(name)) continue;
      if (shapes[name]) {
        out[name] = { shape: shapes[name], data: decodeLowbit(name, shapes[name], tensors, metadata, blockSize) };
        continue;
      }
      if (name.endsWith(SCALE_SUFFIX) && tensors[name.slice(0, -SCALE_SUFFIX.length)]) continue;
      const scale = tensors[name + SCALE_SUFFIX];
      const data = t.dtype === "I8" && scale ? dequantizeInt8(t.data, scale.data, blockSize) : t.data;
      out[name] = { shape: t.shape, data };
    }
    return out;
  }

  // Mirrors engine.codecs.apply_delta: held + the decoded delta, tensor by tensor. Each sum is rounded to
  // float32 as it is stored, as torch's float32 add rounds it: the server's weights, bit for bit.
  function applyDelta(held, buf) {
    const delta = decode(buf);
    const names = Object.keys(held);
    if (names.length !== Object.keys(delta).length || names.some((name) => !delta[name])) {
      throw new Error("the delta's tensors are not the weights'");
    }
    const out = {};
    for (const name of names) {
      const base = held[name].data, step = delta[name].data;
      if (step.length !== base.length) throw new Error(`the delta of ${name} has ${step.length} values`);
      const data = new base.constructor(base.length);
      for (let i = 0; i < base.length; i++) data[i] = base[i] + step[i];
      out[name] = { shape: held[name].shape, data };
    }
    return out;
  }

  // ---- error feedback -------------------------------------------------------------------------
  // Mirrors engine.codecs.ErrorFeedback: what quantisation drops from one update is added to the next,
  // so the sum of what is sent tracks the sum of the true updates (the residual stays bounded by half a
  // quantisation step instead of biasing training). Arithmetic is float32 throughout, like torch's.
  class ErrorFeedback {
    constructor(codec = "int8", options = {}) {
      this.codec = codec;
      this.options = { blockSize: DEFAULT_BLOCKS[codec] || DEFAULT_BLOCK, ...options }; // {blockSize, keep}
      this.residual = {}; // name -> Float32Array
    }

    // update: {name: {shape, data}} or [{name, shape, data}] -> safetensors bytes in this.codec.
    compress(update) {
      const corrected = tensorList(update).map((t) =>
        ({ name: t.name, shape: t.shape, data: plus(t.data, this.residual[t.name]) }));
      const bytes = encode(corrected, this.codec, this.options);
      const sent = decode(bytes);
      // Like the Python twin, only names in this update keep a residual.
      this.residual = {};
      for (const t of corrected) this.residual[t.name] = minus(t.data, sent[t.name].data);
      return bytes;
    }
  }

  function plus(data, residual) {
    const out = Float32Array.from(data);
    if (residual && residual.length !== out.length) throw new Error("error feedback: tensor changed size");
    if (residual) for (let i = 0; i < out.length; i++) out[i] += residual[i];
    return out;
  }

  function minus(a, b) {
    const out = new Float32Array(a.length);
    for (let i = 0; i < out.length; i++) out[i] = a[i] - b[i];
    return out;
  }

  ns.codecs = {
    parse, serialize, encode, decode, applyDelta, toHalf, halfToFloat, quantizeInt8, packNibbles, topkSelect, ErrorFeedback,
    DEFAULT_BLOCK, DEFAULT_BLOCKS,
  };
})((self.crowdtrain = self.crowdtrain || {}));
