// Test-only glue for the peer ring (tests/browser/test_ring.py): one PeerLink per page, its signals and
// relayed payloads carried by the test (Playwright bindings toPeer / relayToPeer). Attaches self.ringHarness.
"use strict";
(function () {
  const { PeerLink } = self.crowdtrain.ring;
  const received = [];

  const { fromB64, toB64 } = self.harnessB64;

  const signal = { send: (msg) => self.toPeer(msg), onmessage: null };
  let link = null;
  let opening = null;

  // Not awaited by the test: the answerer's open() resolves only once the initiator's offer has come.
  function start(initiator, openTimeoutMs) {
    const relay = (bytes) => self.relayToPeer(toB64(bytes));
    link = new PeerLink({ signal, initiator, relay, openTimeoutMs });
    link.onpayload = (bytes, digest) => received.push({ length: bytes.length, digest });
    opening = link.open();
  }

  async function send(b64) {
    return link.send(fromB64(b64));
  }

  function waitReceived(count) {
    return new Promise((resolve) => {
      const poll = () => (received.length >= count ? resolve(received.slice()) : setTimeout(poll, 20));
      poll();
    });
  }

  self.ringHarness = {
    start,
    opened: () => opening,
    send,
    waitReceived,
    fromPeer: (msg) => signal.onmessage && signal.onmessage(msg),
    relayed: (b64) => link.deliverRelayed(fromB64(b64)),
    raw: (b64) => link.channel.send(fromB64(b64)), // bytes straight onto the channel, as a hostile peer's
    stats: () => ({ ...link.stats, via: link.via, error: link.error || null }),
  };
})();
