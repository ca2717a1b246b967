// Test-only: bytes to and from base64, how the harness pages pass binary data through Playwright's JSON.
// Loaded before harness.js, pipeline.js and ring.js. Attaches self.harnessB64.
"use strict";
(function () {
  function fromB64(s) {
    const bin = atob(s);
    const out = new Uint8Array(bin.length);
    for (let i = 0; i < bin.length; i++) out[i] = bin.charCodeAt(i);
    return out;
  }

  function toB64(bytes) {
    let bin = "";
    for (let i = 0; i < bytes.length; i += 0x8000) bin += String.fromCharCode.apply(null, bytes.subarray(i, i + 0x8000));
    return btoa(bin);
  }

  self.harnessB64 = { fromB64, toB64 };
})();
