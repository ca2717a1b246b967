// codecs.js's int4 and topk against engine/codecs.py without a browser: tests/js/fixtures/codecs.json holds
// the Python encoder's blobs for a set of tensors and the bytes of its error feedback over a few updates
// (tests/engine/test_lowbit.py keeps it current), which the browser must reproduce byte for byte and decode
// bit for bit. Run with `node --test tests/js/`.
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { test } from "node:test";
import vm from "node:vm";

const ROOT = new URL("../../", import.meta.url);
const read = (path) => readFileSync(new URL(path, ROOT), "utf8");
const FIXTURE = JSON.parse(read("tests/js/fixtures/codecs.json"));

function load(files) {
  const context = vm.createContext({ TextEncoder, TextDecoder });
  context.self = context;
  for (const file of files) vm.runInContext(read(file), context, { filename: file });
  return context.crowdtrain;
}

const { codecs } = load(["frontend/static/engine/codecs.js"]);
const bytes = (b64) => new Uint8Array(Buffer.from(b64, "base64"));
const floats = (b64) => { const raw = bytes(b64); return new Float32Array(raw.buffer, raw.byteOffset, raw.length / 4); };
const same = (a, b) => Buffer.compare(Buffer.from(a.buffer, a.byteOffset, a.byteLength), Buffer.from(b.buffer, b.byteOffset, b.byteLength)) === 0;
const options = (c) => ({ blockSize: c.block, ...(c.keep ? { keep: c.keep } : {}) });
const tensors = () => Object.fromEntries(Object.entries(FIXTURE.tensors).map(([name, t]) => [name, { shape: t.shape, data: floats(t.values) }]));

test("the fixture covers int4 and topk, and a block that is not the default", () => {
  assert.deepStrictEqual([...new Set(FIXTURE.cases.map((c) => c.codec))].sort(), ["int4", "topk"]);
  assert.ok(FIXTURE.feedback.length >= 2);
});

test("codecs.js encodes the Python bytes", () => {
  for (const c of FIXTURE.cases) {
    const blob = codecs.encode(tensors(), c.codec, options(c));
    assert.ok(same(blob, bytes(c.blob)), `${c.codec} ${c.block} ${c.keep}`);
  }
});

test("codecs.js decodes the Python blobs bit for bit", () => {
  for (const c of FIXTURE.cases) {
    const decoded = codecs.decode(bytes(c.blob));
    for (const [name, want] of Object.entries(c.decoded)) {
      assert.deepStrictEqual([...decoded[name].shape], FIXTURE.tensors[name].shape, name);
      assert.ok(same(decoded[name].data, floats(want)), `${c.codec} ${c.block} ${name}`);
    }
  }
});

test("codecs.js's error feedback sends Python's bytes step after step", () => {
  for (const f of FIXTURE.feedback) {
    const ef = new codecs.ErrorFeedback(f.codec, options(f));
    FIXTURE.updates.forEach((update, step) => {
      const sent = ef.compress({ w: { shape: [3, 100], data: floats(update.w) } });
      assert.ok(same(sent, bytes(f.sent[step])), `${f.codec} step ${step}`);
    });
  }
});

test("codecs.js builds the weights a chain of Python's deltas gives, bit for bit", () => {
  assert.deepStrictEqual(FIXTURE.deltas.map((d) => d.codec), ["int8", "int4", "topk"]);
  for (const chain of FIXTURE.deltas) {
    let held = tensors();
    chain.steps.forEach((step, i) => {
      held = codecs.applyDelta(held, bytes(step.blob));
      for (const [name, want] of Object.entries(step.held)) {
        assert.ok(same(held[name].data, floats(want)), `${chain.codec} step ${i} ${name}`);
      }
    });
  }
  const one = tensors();
  delete one.b;
  assert.throws(() => codecs.applyDelta(one, bytes(FIXTURE.deltas[0].steps[0].blob)), /not the weights/);
});

test("codecs.js refuses the options Python refuses", () => {
  const one = { a: { shape: [3], data: new Float32Array(3) } };
  assert.throws(() => codecs.encode(one, "int4", { blockSize: 7 }), /even/);
  assert.throws(() => codecs.encode(one, "topk", { blockSize: 8, keep: 9 }), /keep/);
  assert.throws(() => codecs.encode(one, "int2"), /unknown codec/);
});

test("the default blocks are Python's", () => {
  assert.deepStrictEqual({ ...codecs.DEFAULT_BLOCKS }, { int8: 256, int4: 256, topk: 4096 });
  assert.equal(new codecs.ErrorFeedback("topk").options.blockSize, 4096);
});
