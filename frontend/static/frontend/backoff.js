// How long the Contribute page waits before reconnecting: exponential back-off with "full jitter" (each wait
// uniform in [0, min(cap, base * 2^attempt))). When a server restarts, thousands of volunteers lose their
// socket at the same instant; fixed steps (or +-25% around them) bring them back in synchronised waves that
// daphne's 5 s handshake limit turned away (72% of 2,000 failed, issue 15); full jitter spreads them out.
// Classic script: attaches to self.crowdtrain.backoff; load it before contribute.js.
(function () {
  "use strict";

  const BASE_MS = 1000;
  const CAP_MS = 60000;
  // A server busy admitting others closes at once with 4503 (config/admission.py); coming back within the
  // same second only costs it another handshake, so such a retry waits at least this long.
  const RETRY_LATER_MS = 5000;

  // `attempt` counts the failures since the last open socket (0 for the first retry); `random` in [0, 1).
  function reconnectDelay(attempt, random = Math.random, baseMs = BASE_MS, capMs = CAP_MS) {
    const ceiling = Math.min(capMs, baseMs * 2 ** Math.min(Math.max(attempt, 0), 30));
    return Math.floor(random() * ceiling);
  }

  function retryLaterDelay(attempt, random = Math.random) {
    return RETRY_LATER_MS + reconnectDelay(attempt, random);
  }

  (self.crowdtrain = self.crowdtrain || {}).backoff = Object.freeze({
    BASE_MS, CAP_MS, RETRY_LATER_MS, reconnectDelay, retryLaterDelay,
  });
})();
