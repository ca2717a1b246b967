// The browser engine, the volunteer page and the test/benchmark pages are classic scripts (loaded with
// <script> or importScripts) that share the `crowdtrain` namespace and TF.js's `tf` global; tests/js/ is
// Node ES modules. frontend/static/engine/spec.js is generated from engine/spec.json (python -m engine.spec).
import js from "@eslint/js";
import globals from "globals";

const shared = { tf: "readonly", Chart: "readonly", crowdtrain: "writable" };

export default [
  { ignores: ["node_modules/", "frontend/vendor/", "var/", "test-artifacts/", ".venv/", "frontend/static/engine/spec.js"] },
  js.configs.recommended,
  {
    files: ["frontend/static/**/*.js", "tests/browser/**/*.js", "benchmarks/**/*.js"],
    languageOptions: {
      sourceType: "script",
      globals: { ...globals.browser, ...globals.worker, ...shared },
    },
  },
  {
    files: ["tests/js/**/*.mjs", "eslint.config.mjs"],
    languageOptions: { sourceType: "module", globals: { ...globals.node } },
  },
  {
    // `const { bytes, ...rest } = item` drops a field on purpose.
    rules: { "no-unused-vars": ["error", { args: "none", caughtErrors: "none", ignoreRestSiblings: true }] },
  },
];
