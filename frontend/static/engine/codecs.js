// Safetensors parse/serialize and the tensor codecs of docs/protocol.md (fp32, fp16, blockwise int8).
// Classic script: attaches to self.crowdtrain.codecs (works in pages and in Web Workers).
(function (ns) {
  "use strict";

  const DTYPE_BYTES = { F32: 4, F16: 2, I8: 1, I32: 4, I64: 8 };
  const SCALE_SUFFIX = ":scale";
  const DEFAULT_BLOCK = 256;

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
    if (metadata) header.__metadata__ = metadata;
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

  // Blockwise symmetric int8: scale = max|x| / 127 per block of the flattened tensor.
  function quantizeInt8(data, blockSize) {
    const blocks = Math.ceil(data.length / blockSize);
    const q = new Int8Array(data.length);
    const scales = new Float32Array(blocks);
    for (let b = 0; b < blocks; b++) {
      const lo = b * blockSize, hi = Math.min(lo + blockSize, data.length);
      let amax = 0;
      for (let i = lo; i < hi; i++) amax = Math.max(amax, Math.abs(data[i]));
      const scale = Math.fround(amax / 127);
      scales[b] = scale;
      if (scale === 0) continue; // all-zero block: q stays 0
      for (let i = lo; i < hi; i++) {
        const v = roundHalfEven(Math.fround(data[i] / scale));
        q[i] = Math.max(-127, Math.min(127, v));
      }
    }
    return { q, scales };
  }

  function dequantizeInt8(q, scales, blockSize) {
    const out = new Float32Array(q.length);
    for (let i = 0; i < q.length; i++) out[i] = q[i] * scales[Math.floor(i / blockSize)];
    return out;
  }

  function tensorList(tensors) {
    return Array.isArray(tensors) ? tensors : Object.entries(tensors).map(([name, t]) => ({ name, ...t }));
  }

  // tensors: {name: {shape, data: Float32Array}} or [{name, shape, data}] -> safetensors bytes.
  function encode(tensors, codec = "fp32", options = {}) {
    const blockSize = options.blockSize || DEFAULT_BLOCK;
    const metadata = { codec, block_size: String(blockSize) };
    const entries = [];
    for (const t of tensorList(tensors)) {
      if (codec === "fp32") entries.push({ name: t.name, dtype: "F32", shape: t.shape, data: Float32Array.from(t.data) });
      else if (codec === "fp16") entries.push({ name: t.name, dtype: "F16", shape: t.shape, data: t.data });
      else if (codec === "int8") {
        const { q, scales } = quantizeInt8(t.data, blockSize);
        entries.push({ name: t.name, dtype: "I8", shape: t.shape, data: q });
        entries.push({ name: t.name + SCALE_SUFFIX, dtype: "F32", shape: [scales.length], data: scales });
      } else throw new Error(`unknown codec ${codec}`);
    }
    return serialize(entries, metadata);
  }

  // safetensors bytes (any codec) -> {name: {shape, data}}: float tensors as Float32Array
  // (int8 dequantized with its `name:scale`), integer tensors (labels, ids) as Int32Array.
  function decode(buf) {
    const { metadata, tensors } = parse(buf);
    const blockSize = parseInt(metadata.block_size || DEFAULT_BLOCK, 10);
    const out = {};
    for (const [name, t] of Object.entries(tensors)) {
      if (name.endsWith(SCALE_SUFFIX) && tensors[name.slice(0, -SCALE_SUFFIX.length)]) continue;
      const scale = tensors[name + SCALE_SUFFIX];
      const data = t.dtype === "I8" && scale ? dequantizeInt8(t.data, scale.data, blockSize) : t.data;
      out[name] = { shape: t.shape, data };
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
      this.options = options; // {blockSize}
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

  ns.codecs = { parse, serialize, encode, decode, toHalf, halfToFloat, quantizeInt8, ErrorFeedback, DEFAULT_BLOCK };
})((self.crowdtrain = self.crowdtrain || {}));
