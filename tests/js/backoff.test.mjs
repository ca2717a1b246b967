// backoff.js, the Contribute page's reconnect delays: full jitter (uniform below an exponential ceiling),
// capped, and what contribute.js actually uses. Run with `node --test tests/js/`.
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { test } from "node:test";
import vm from "node:vm";

const ROOT = new URL("../../", import.meta.url);
const read = (path) => readFileSync(new URL(path, ROOT), "utf8");

function load() {
  const context = vm.createContext({ Math });
  context.self = context;
  vm.runInContext(read("frontend/static/frontend/backoff.js"), context, { filename: "backoff.js" });
  return context.crowdtrain.backoff;
}

const { BASE_MS, CAP_MS, RETRY_LATER_MS, reconnectDelay, retryLaterDelay } = load();

test("the ceiling doubles from the base up to the cap", () => {
  const ceilings = [0, 1, 2, 3, 4, 5, 6, 7, 50].map((n) => reconnectDelay(n, () => 1 - 1e-12) + 1);
  assert.deepEqual(ceilings, [1000, 2000, 4000, 8000, 16000, 32000, 60000, 60000, 60000]);
  assert.equal(BASE_MS, 1000);
  assert.equal(CAP_MS, 60000);
});

test("full jitter: any delay from zero to the ceiling, proportional to the random draw", () => {
  assert.equal(reconnectDelay(3, () => 0), 0);
  assert.equal(reconnectDelay(3, () => 0.5), 4000);
  assert.equal(reconnectDelay(-1, () => 0.5), 500); // never below the first step's ceiling
  assert.equal(reconnectDelay(2, () => 0.5, 100, 300), 150); // base and cap may be given
});

test("a storm spreads out: 10,000 clients' first retries fill the first second evenly", () => {
  const buckets = new Array(10).fill(0);
  for (let i = 0; i < 10000; i++) buckets[Math.floor(reconnectDelay(0) / 100)]++;
  for (const count of buckets) assert.ok(count > 800 && count < 1200, `${buckets}`);
});

test("told to come back later (4503), a client waits the floor, then full jitter above it", () => {
  assert.equal(RETRY_LATER_MS, 5000);
  assert.equal(retryLaterDelay(0, () => 0), 5000);
  assert.equal(retryLaterDelay(3, () => 0.5), 9000);
  const page = read("frontend/static/frontend/contribute.js");
  assert.match(page, /code === RETRY_LATER \? retryLaterDelay\(/);
});

test("contribute.js takes its delays from backoff.js, and the page loads it first", () => {
  const page = read("frontend/static/frontend/contribute.js");
  assert.match(page, /self\.crowdtrain\.backoff/);
  assert.doesNotMatch(page, /BACKOFF_MS/);
  const template = read("frontend/templates/frontend/contribute.html");
  assert.ok(template.indexOf("frontend/backoff.js") > 0);
  assert.ok(template.indexOf("frontend/backoff.js") < template.indexOf("frontend/contribute.js"));
});
