// Activations and activation gradients on the wire (pipeline mode): the browser's twin of
// engine/activations.py, which states the codecs and their error budgets (docs/pipeline.md "Compressed
// activations"). One tensor per blob, named after its kind, in safetensors bytes that are the Python
// encoder's byte for byte: fp32; fp16 after scaling by 2**exponent (metadata) so that the largest magnitude
// lands in [2**14, 2**15); blockwise int8 (codecs.js's). decode() is for hostile bytes from peers: the caller
// states the shape it expects, and any other shape, dtype, kind, codec, metadata, a header over MAX_HEADER
// or a non-finite value throws. Classic script: attaches to self.crowdtrain.activations; needs codecs.js.
(function (ns) {
  "use strict";

  const CODECS = ["fp32", "fp16", "int8"];
  const KINDS = ["activation", "gradient"];
  const DEFAULT_BLOCK = 256;
  const MAX_BLOCK = 1 << 20; // engine/codecs.py's MAX_BLOCK_SIZE
  const MAX_HEADER = 4096;
  const HALF_TOP = 14;
  const MIN_EXPONENT = HALF_TOP - 126, MAX_EXPONENT = 127;
  const COMPRESSED_LIMIT = 2 ** 127; // fp16 and int8 refuse magnitudes from here (see activations.py)
  const STORED = { fp32: "F32", fp16: "F16", int8: "I8" };
  const ITEM_BYTES = { F32: 4, F16: 2, I8: 1 };
  const SCALE_SUFFIX = ":scale";
  const META_KEYS = ["block_size", "codec", "exponent"];

  const fail = (msg) => { throw new Error(`activations: ${msg}`); };
  const prod = (xs) => xs.reduce((a, b) => a * b, 1);
  const isSize = (v) => Number.isSafeInteger(v) && v >= 0;

  function checkChoice(what, value, choices) {
    if (!choices.includes(value)) fail(`unknown ${what} ${JSON.stringify(String(value).slice(0, 20))}`);
  }

  function checkShape(shape) {
    if (!Array.isArray(shape) || shape.length > 16 || !shape.every(isSize)) fail("a shape is at most 16 sizes");
  }

  // ---- encode ---------------------------------------------------------------------------------------
  const f32 = new Float32Array(1);
  const u32 = new Uint32Array(f32.buffer);

  // floor(log2(m)) of a positive float32, read off its bits (Math.log2 can miss by one near powers of two).
  function floorLog2(m) {
    f32[0] = m;
    const biased = (u32[0] >>> 23) & 0xff;
    return biased > 0 ? biased - 127 : 31 - Math.clz32(u32[0] & 0x7fffff) - 149;
  }

  function largest(data) {
    let top = 0;
    for (let i = 0; i < data.length; i++) top = Math.max(top, Math.abs(data[i]));
    return top;
  }

  // The power of two fp16 scales by: the largest magnitude into [2**14, 2**15), within the bounds.
  function halfExponent(data) {
    const top = largest(data);
    return top === 0 ? 0 : Math.max(MIN_EXPONENT, Math.min(MAX_EXPONENT, HALF_TOP - floorLog2(top)));
  }

  function finiteFloats(data, shape) {
    const values = data instanceof Float32Array ? data : Float32Array.from(data);
    if (values.length !== prod(shape)) fail(`${values.length} values for shape [${shape}]`);
    for (let i = 0; i < values.length; i++) {
      if (!Number.isFinite(values[i])) fail("cannot send non-finite values (a diverged unit)");
    }
    return values;
  }

  // data (Float32Array, the tensor's values in C order) -> Uint8Array, as engine.activations.encode.
  function encode(data, shape, { codec = "fp16", kind = "activation", blockSize = DEFAULT_BLOCK } = {}) {
    checkChoice("codec", codec, CODECS);
    checkChoice("kind", kind, KINDS);
    checkShape(shape);
    if (!Number.isInteger(blockSize) || blockSize < 1 || blockSize > MAX_BLOCK) fail(`block size must be in 1..${MAX_BLOCK}`);
    const values = finiteFloats(data, shape);
    if (codec !== "fp32" && largest(values) >= COMPRESSED_LIMIT) fail(`magnitudes of 2**127 or more cannot be sent as ${codec}`);
    const meta = { block_size: String(blockSize), codec }; // sorted keys, as the Python encoder writes them
    const entries = [];
    if (codec === "fp32") entries.push({ name: kind, dtype: "F32", shape, data: values });
    else if (codec === "fp16") {
      const exponent = halfExponent(values), factor = 2 ** exponent; // a power of two: exact in float32
      meta.exponent = String(exponent);
      entries.push({ name: kind, dtype: "F16", shape, data: values.map((v) => v * factor) });
    } else {
      const { q, scales } = ns.codecs.quantizeInt8(values, blockSize);
      entries.push({ name: kind, dtype: "I8", shape, data: q });
      entries.push({ name: kind + SCALE_SUFFIX, dtype: "F32", shape: [scales.length], data: scales });
    }
    return ns.codecs.serialize(entries, meta);
  }

  // ---- decode ---------------------------------------------------------------------------------------
  function asBytes(buf) {
    if (buf instanceof Uint8Array) return buf;
    if (ArrayBuffer.isView(buf)) return new Uint8Array(buf.buffer, buf.byteOffset, buf.byteLength);
    if (buf instanceof ArrayBuffer) return new Uint8Array(buf);
    return fail("expected bytes");
  }

  function readHeader(bytes) {
    if (bytes.byteLength < 8) fail("not a safetensors file (too short)");
    const view = new DataView(bytes.buffer, bytes.byteOffset, 8);
    const size = view.getUint32(0, true) + view.getUint32(4, true) * 2 ** 32;
    if (size > MAX_HEADER) fail(`a header of ${size} bytes (at most ${MAX_HEADER})`);
    if (size > bytes.byteLength - 8) fail("not a safetensors file (bad header length)");
    let header;
    try {
      header = JSON.parse(new TextDecoder("utf-8", { fatal: true }).decode(bytes.subarray(8, 8 + size)));
    } catch (err) {
      fail(`bad header (${String(err.message).slice(0, 100)})`);
    }
    if (!header || typeof header !== "object" || Array.isArray(header)) fail("the header is not an object");
    return { header, buffer: bytes.byteLength - 8 - size };
  }

  function checkMeta(meta, expected) {
    if (!meta || typeof meta !== "object" || Array.isArray(meta)) fail("no metadata");
    const keys = Object.keys(meta);
    if (!keys.every((k) => META_KEYS.includes(k) && typeof meta[k] === "string")) fail(`unexpected metadata ${keys.slice(0, 5)}`);
    const codec = meta.codec;
    if (!CODECS.includes(codec) || (expected && codec !== expected)) fail(`codec ${JSON.stringify(codec)}, expected ${expected || CODECS}`);
    const block = meta.block_size;
    if (!/^[0-9]{1,9}$/.test(block || "") || +block < 1 || +block > MAX_BLOCK) fail(`bad block_size ${JSON.stringify(block)}`);
    if ((codec === "fp16") !== ("exponent" in meta)) fail("an fp16 blob, and only one, carries its exponent");
    return { codec, blockSize: +block, exponent: codec === "fp16" ? exponentOf(meta.exponent) : 0 };
  }

  function exponentOf(raw) {
    if (!/^-?[0-9]{1,3}$/.test(raw)) fail(`bad fp16 exponent ${JSON.stringify(raw.slice(0, 20))}`);
    const value = +raw;
    if (value < MIN_EXPONENT || value > MAX_EXPONENT) fail(`fp16 exponent ${value} outside ${MIN_EXPONENT}..${MAX_EXPONENT}`);
    return value;
  }

  // The entries the codec needs, each exactly {dtype, shape, data_offsets} of the expected dtype and shape.
  function checkEntries(header, kind, shape, { codec, blockSize }, buffer) {
    const wanted = { [kind]: [STORED[codec], shape] };
    if (codec === "int8") wanted[kind + SCALE_SUFFIX] = ["F32", [Math.ceil(prod(shape) / blockSize)]];
    const names = Object.keys(header).filter((k) => k !== "__metadata__");
    if (names.length !== Object.keys(wanted).length || !names.every((n) => n in wanted)) {
      fail(`expected ${Object.keys(wanted)}, got ${names.slice(0, 5).map((n) => n.slice(0, 40))}`);
    }
    const spans = names.map((name) => checkEntry(name, header[name], ...wanted[name], buffer));
    spans.sort((a, b) => a[0] - b[0]);
    let end = 0;
    for (const [begin, stop] of spans) {
      if (begin !== end) fail("tensor data overlaps or leaves a gap");
      end = stop;
    }
    if (end !== buffer) fail("the tensors' data does not end the file");
  }

  function checkEntry(name, info, dtype, shape, buffer) {
    if (!info || typeof info !== "object" || Object.keys(info).sort().join() !== "data_offsets,dtype,shape") {
      fail(`${name}: a header entry needs exactly dtype, shape and data_offsets`);
    }
    if (info.dtype !== dtype) fail(`${name} is stored as ${String(info.dtype).slice(0, 8)}, not ${dtype}`);
    const got = info.shape;
    if (!Array.isArray(got) || got.length !== shape.length || !got.every((d, i) => d === shape[i])) {
      fail(`${name} has shape ${JSON.stringify(got).slice(0, 60)}, expected [${shape}]`);
    }
    const offsets = info.data_offsets;
    if (!Array.isArray(offsets) || offsets.length !== 2 || !offsets.every(isSize)) fail(`${name}: bad data_offsets`);
    const [begin, end] = offsets;
    if (begin > end || end > buffer || end - begin !== prod(shape) * ITEM_BYTES[dtype]) fail(`${name}: bad data_offsets`);
    return offsets;
  }

  // bytes -> {shape, data: Float32Array, codec}; `shape` is the one the caller expects; options.codec, if
  // given, the only codec accepted.
  function decode(buf, shape, { kind = "activation", codec = null } = {}) {
    checkChoice("kind", kind, KINDS);
    checkShape(shape);
    const bytes = asBytes(buf);
    const { header, buffer } = readHeader(bytes);
    const meta = checkMeta(header.__metadata__, codec);
    checkEntries(header, kind, shape, meta, buffer);
    const tensors = ns.codecs.parse(bytes).tensors; // checked above: now only copied out and widened
    let data = tensors[kind].data;
    if (meta.codec === "int8") data = dequantize(data, tensors[kind + SCALE_SUFFIX].data, meta.blockSize);
    else if (meta.codec === "fp16") data = scaleBy(data, 2 ** -meta.exponent);
    for (let i = 0; i < data.length; i++) if (!Number.isFinite(data[i])) fail(`the ${kind} holds non-finite values`);
    return { shape: shape.slice(), data, codec: meta.codec };
  }

  function dequantize(q, scales, blockSize) {
    for (let b = 0; b < scales.length; b++) if (!Number.isFinite(scales[b])) fail("non-finite int8 scales");
    const out = new Float32Array(q.length);
    for (let i = 0; i < q.length; i++) out[i] = q[i] * scales[Math.floor(i / blockSize)];
    return out;
  }

  function scaleBy(data, factor) {
    for (let i = 0; i < data.length; i++) data[i] *= factor; // exact, or float32's rounding of a subnormal
    return data;
  }

  // The blob's content address (sha256, hex), as engine.activations.digest.
  async function digest(bytes) {
    const hash = new Uint8Array(await crypto.subtle.digest("SHA-256", asBytes(bytes)));
    return Array.from(hash, (b) => b.toString(16).padStart(2, "0")).join("");
  }

  ns.activations = { encode, decode, digest, halfExponent, CODECS, KINDS, DEFAULT_BLOCK, MAX_HEADER };
})((self.crowdtrain = self.crowdtrain || {}));
