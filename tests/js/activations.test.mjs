// activations.js against engine/activations.py without a browser: tests/js/fixtures/activations.json holds
// the Python encoder's blobs for a set of tensors (tests/engine/test_activations.py keeps it current), which
// the browser's encoder must reproduce byte for byte and decode bit for bit, and hostile blobs it must refuse.
// Run with `node --test tests/js/`.
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { test } from "node:test";
import vm from "node:vm";

const ROOT = new URL("../../", import.meta.url);
const read = (path) => readFileSync(new URL(path, ROOT), "utf8");
const FIXTURE = JSON.parse(read("tests/js/fixtures/activations.json"));

function load(files) {
  const context = vm.createContext({ crypto: globalThis.crypto, TextEncoder, TextDecoder });
  context.self = context;
  for (const file of files) vm.runInContext(read(file), context, { filename: file });
  return context.crowdtrain;
}

const { activations } = load(["frontend/static/engine/codecs.js", "frontend/static/engine/activations.js"]);
const bytes = (b64) => new Uint8Array(Buffer.from(b64, "base64"));
const floats = (b64) => { const raw = bytes(b64); return new Float32Array(raw.buffer, raw.byteOffset, raw.length / 4); };
const same = (a, b) => Buffer.compare(Buffer.from(a.buffer, a.byteOffset, a.byteLength), Buffer.from(b.buffer, b.byteOffset, b.byteLength)) === 0;

test("the fixture covers every codec and kind", () => {
  const seen = new Set(FIXTURE.cases.map((c) => `${c.codec}/${c.kind}`));
  for (const codec of activations.CODECS) for (const kind of activations.KINDS) assert.ok(seen.has(`${codec}/${kind}`), `${codec}/${kind}`);
  assert.ok(FIXTURE.hostile.length >= 20);
});

test("activations.js encodes the Python bytes", () => {
  for (const c of FIXTURE.cases) {
    const blob = activations.encode(floats(c.values), c.shape, { codec: c.codec, kind: c.kind, blockSize: c.block });
    assert.ok(same(blob, bytes(c.blob)), `${c.name} ${c.codec} ${c.block}`);
  }
});

test("activations.js decodes the Python blobs bit for bit", () => {
  for (const c of FIXTURE.cases) {
    const d = activations.decode(bytes(c.blob), c.shape, { kind: c.kind, codec: c.codec });
    assert.equal(d.codec, c.codec);
    assert.ok(same(d.data, floats(c.decoded)), `${c.name} ${c.codec} ${c.block}`);
  }
});

test("fp16 scales the largest magnitude as Python does", () => {
  for (const c of FIXTURE.cases) assert.equal(activations.halfExponent(floats(c.values)), c.exponent, c.name);
});

test("activations.js refuses every hostile blob", () => {
  for (const h of FIXTURE.hostile) {
    assert.throws(() => activations.decode(bytes(h.blob), h.shape, { kind: h.kind }), /activations:/, h.name);
  }
});

test("activations.js refuses to send what Python refuses", () => {
  const refuse = (data, shape, options, pattern) => assert.throws(() => activations.encode(data, shape, options), pattern);
  refuse([1, NaN], [2], {}, /non-finite/);
  refuse([1, Infinity], [2], { codec: "fp32" }, /non-finite/);
  refuse([2 ** 127], [1], { codec: "int8" }, /2\*\*127/);
  refuse([1, 2, 3], [2], {}, /3 values for shape/);
  refuse([1], [1], { codec: "fp8" }, /unknown codec/);
  refuse([1], [1], { kind: "weights" }, /unknown kind/);
  refuse([1], [1], { codec: "int8", blockSize: 0 }, /block size/);
});

test("digest is the blob's sha256", async () => {
  const blob = bytes(FIXTURE.cases[0].blob);
  const { createHash } = await import("node:crypto");
  assert.equal(await activations.digest(blob), createHash("sha256").update(blob).digest("hex"));
});
