// Pipeline mode's peer ring (docs/pipeline.md "Peer ring"): activations and gradients go from one stage's
// volunteer straight to the next one's over a WebRTC data channel, signalled through the volunteer
// WebSocket (`signal` messages, docs/protocol.md), and through the server (`relay`) when the channel does
// not open in time. The sender reports each payload's SHA-256 to the server, so spot checks stay possible.
// Peers are hostile: a length header over maxBytes closes the link, and whatever arrives is only bytes.
// Classic script: attaches to self.crowdtrain.ring.
(function (ns) {
  "use strict";

  const CHUNK = 64 * 1024; // under every browser's SCTP message limit (Chromium's is 256 KiB)
  const HEADER = 8; // a payload's first chunk starts with its length, a little-endian float64
  const HIGH_WATER = 4 * 1024 * 1024; // Chromium closes a channel whose send buffer passes 16 MiB
  const LOW_WATER = 1024 * 1024;
  const DEFAULTS = { iceServers: [], openTimeoutMs: 5000, maxBytes: 256 * 1024 * 1024 };
  const KINDS = ["offer", "answer", "candidate"];

  async function digest(bytes) {
    const hash = new Uint8Array(await crypto.subtle.digest("SHA-256", bytes));
    return Array.from(hash, (b) => b.toString(16).padStart(2, "0")).join("");
  }

  const asBytes = (data) => (data instanceof Uint8Array ? data : new Uint8Array(data));

  // One ordered, reliable link to one peer. `signal` is {send(msg), onmessage}: PeerLink sets onmessage
  // and sends {kind, data} with data a string. `relay(bytes)` sends a payload through the server instead.
  class PeerLink {
    constructor({ signal, initiator, relay, ...options }) {
      this.options = { ...DEFAULTS, ...options };
      this.signal = signal;
      this.initiator = initiator;
      this.relay = relay;
      this.stats = { sent: 0, received: 0, relayed: 0, signalBytes: 0 };
      this.via = "pending"; // then "peer" or "relay"
      this.onpayload = null; // (Uint8Array, hex digest) => void
      this.pending = []; // remote candidates that came before the remote description
      this.incoming = null;
      this.early = []; // signals that came before open(): an offer may beat the answerer's own open()
      signal.onmessage = (msg) => this._onSignal(msg).catch((e) => this._fail(e));
    }

    // Resolves "peer" once the channel is open, or "relay" when it is not open within openTimeoutMs.
    open() {
      if (!this.opening) this.opening = this._open();
      return this.opening;
    }

    async _open() {
      this.pc = new RTCPeerConnection({ iceServers: this.options.iceServers });
      this.pc.onicecandidate = (e) => e.candidate && this._signal("candidate", JSON.stringify(e.candidate));
      const opened = new Promise((resolve) => (this._opened = resolve));
      if (this.initiator) this._adopt(this.pc.createDataChannel("crowdtrain", { ordered: true }));
      else this.pc.ondatachannel = (e) => this._adopt(e.channel);
      if (this.initiator) await this._offer();
      for (const msg of this.early.splice(0)) await this._onSignal(msg);
      const timeout = new Promise((resolve) => (this.timer = setTimeout(resolve, this.options.openTimeoutMs, false)));
      const open = await Promise.race([opened, timeout]);
      clearTimeout(this.timer);
      this.via = open ? "peer" : "relay";
      if (!open) this._closePeer();
      return this.via;
    }

    _adopt(channel) {
      channel.binaryType = "arraybuffer";
      channel.bufferedAmountLowThreshold = LOW_WATER;
      channel.onopen = () => this._opened && this._opened(true);
      channel.onclose = () => this.drained && this.drained(); // a send waiting for the buffer gives up
      channel.onmessage = (e) => this._onChunk(asBytes(e.data)).catch((err) => this._fail(err));
      this.channel = channel;
      if (channel.readyState === "open") this._opened(true);
    }

    async _offer() {
      await this.pc.setLocalDescription(await this.pc.createOffer());
      this._signal("offer", this.pc.localDescription.sdp);
    }

    _signal(kind, data) {
      const msg = { kind, data };
      this.stats.signalBytes += JSON.stringify(msg).length;
      this.signal.send(msg);
    }

    async _onSignal(msg) {
      if (!msg || !KINDS.includes(msg.kind) || typeof msg.data !== "string") return;
      if (!this.pc) return void this.early.push(msg);
      if (msg.kind === "candidate") return this._candidate(JSON.parse(msg.data));
      if ((msg.kind === "offer") === this.initiator || this.pc.remoteDescription) return; // not ours to take
      await this.pc.setRemoteDescription({ type: msg.kind, sdp: msg.data });
      if (msg.kind === "offer") {
        await this.pc.setLocalDescription(await this.pc.createAnswer());
        this._signal("answer", this.pc.localDescription.sdp);
      }
      for (const c of this.pending.splice(0)) await this.pc.addIceCandidate(c);
    }

    async _candidate(candidate) {
      if (this.pc.remoteDescription) await this.pc.addIceCandidate(candidate);
      else this.pending.push(candidate);
    }

    // Sends one payload whole, by the peer or the relay; resolves its digest, to report to the server.
    async send(data) {
      const bytes = asBytes(data);
      const hex = await digest(bytes);
      if ((await this.open()) === "peer" && (await this._sendPeer(bytes))) return hex;
      this.stats.relayed += bytes.length;
      await this.relay(bytes);
      return hex;
    }

    // False when the channel closed (the peer left or gave up): that payload and the next go by the relay.
    async _sendPeer(bytes) {
      try {
        await this._sendChunks(bytes);
      } catch (error) {
        this.via = "relay";
        this._closePeer();
        return false;
      }
      this.stats.sent += bytes.length;
      return true;
    }

    async _sendChunks(bytes) {
      const first = new Uint8Array(HEADER + Math.min(bytes.length, CHUNK - HEADER));
      new DataView(first.buffer).setFloat64(0, bytes.length, true);
      first.set(bytes.subarray(0, first.length - HEADER), HEADER);
      await this._write(first);
      for (let at = first.length - HEADER; at < bytes.length; at += CHUNK) {
        await this._write(bytes.subarray(at, at + CHUNK));
      }
    }

    async _write(chunk) {
      if (this.via !== "peer") throw new Error("ring: the link is closed");
      if (this.channel.bufferedAmount > HIGH_WATER) {
        await new Promise((resolve) => (this.drained = this.channel.onbufferedamountlow = resolve));
      }
      if (this.channel.readyState !== "open") throw new Error("ring: the peer closed the link");
      this.channel.send(chunk);
    }

    async _onChunk(chunk) {
      if (!this.incoming) return this._start(chunk);
      const { bytes } = this.incoming;
      if (this.incoming.at + chunk.length > bytes.length) throw new Error("ring: a payload overran its length");
      bytes.set(chunk, this.incoming.at);
      this.incoming.at += chunk.length;
      if (this.incoming.at === bytes.length) await this._finish();
    }

    async _start(chunk) {
      if (chunk.length < HEADER) throw new Error("ring: a payload without its length");
      const length = new DataView(chunk.buffer, chunk.byteOffset, HEADER).getFloat64(0, true);
      if (!Number.isSafeInteger(length) || length < 0 || length > this.options.maxBytes) {
        throw new Error("ring: a payload length out of bounds");
      }
      this.incoming = { bytes: new Uint8Array(length), at: 0 };
      await this._onChunk(chunk.subarray(HEADER)); // finishes a payload that fits this chunk
    }

    async _finish() {
      const { bytes } = this.incoming;
      this.incoming = null;
      this.stats.received += bytes.length;
      if (this.onpayload) this.onpayload(bytes, await digest(bytes));
    }

    // A payload that came through the server (the sender's `relay`): delivered like one from the peer.
    async deliverRelayed(data) {
      const bytes = asBytes(data);
      this.stats.received += bytes.length;
      if (this.onpayload) this.onpayload(bytes, await digest(bytes));
    }

    _fail(error) {
      this.error = String(error && error.message ? error.message : error);
      this.close();
    }

    _closePeer() {
      if (this.via === "peer") this.via = "relay";
      if (this.channel) this.channel.close();
      if (this.pc) this.pc.close();
    }

    close() {
      clearTimeout(this.timer);
      this.incoming = null;
      this._closePeer();
    }
  }

  // The volunteer WebSocket as a PeerLink's signalling channel for one (peer, link): wraps {kind, data} in
  // the protocol's `signal` message; the page hands the server's `signal` messages to route().
  class SocketSignals {
    constructor(sendJson) {
      this.sendJson = sendJson;
      this.channels = new Map();
    }

    channel(peer, link) {
      const key = `${peer}/${link}`;
      const channel = {
        send: (msg) => this.sendJson({ type: "signal", to: peer, link, kind: msg.kind, data: msg.data }),
        onmessage: null,
        close: () => this.channels.delete(key),
      };
      this.channels.set(key, channel);
      return channel;
    }

    // Only links this page opened itself hear signals: anyone else's offer is dropped unanswered.
    route(msg) {
      const channel = this.channels.get(`${msg.from}/${msg.link}`);
      if (channel && channel.onmessage) channel.onmessage({ kind: msg.kind, data: msg.data });
      return Boolean(channel);
    }
  }

  // ---- stage payloads over the ring (pipeline mode's lifecycle: projects/ring.py) ---------------------
  // A producer keeps each payload it sent by the ring, by digest, and answers its consumers' requests over
  // one link per peer; a consumer opens that link (the server lets only adjacent stages' devices signal each
  // other), asks for a digest, and takes only bytes whose SHA-256 is that digest and whose size is within
  // the bound. Anything else, or no channel, and it asks the server to relay (`fetch`) and reads its unit's
  // URL once the producer has uploaded the bytes there (`upload` -> `relay`).
  const WANT = "want:", NONE = "none:";
  const TEXT = new TextEncoder();
  const REQUEST_BYTES = WANT.length + 64;
  const PULL_TIMEOUT_MS = 20000;
  const RELAY_POLL_MS = 1000;
  const RELAY_TIMEOUT_MS = 120000;
  const KEEP_BYTES = 256 * 1024 * 1024; // payloads a producer keeps for its consumers (least recent first out)
  const MAX_LINKS = 16; // each way

  const hexOf = (bytes, prefix) => {
    if (bytes.length !== REQUEST_BYTES) return null;
    const text = String.fromCharCode(...bytes);
    return text.startsWith(prefix) && /^[0-9a-f]{64}$/.test(text.slice(prefix.length)) ? text.slice(prefix.length) : null;
  };

  // Bytes an encoded activation or gradient of `shape` may take at most in any codec (int8 with one scale
  // per element is the largest: 5 bytes an element), with its header.
  function payloadBound(shape) {
    return 5 * shape.reduce((a, b) => a * b, 1) + 8 + 4096;
  }

  class PayloadRing {
    // sendJson(msg) -> bool, sendBinary(bytes): the volunteer WebSocket. options: PeerLink's (iceServers...).
    constructor({ sendJson, sendBinary, fetchImpl, ...options }) {
      this.sendJson = sendJson;
      this.sendBinary = sendBinary;
      this.fetch = fetchImpl || ((url) => fetch(url, { credentials: "same-origin", cache: "no-store" }));
      this.options = options;
      // Signals are what the ring costs the server: counted both ways, as their JSON.
      this.signals = new SocketSignals((msg) => {
        this.stats.signalBytes += JSON.stringify(msg).length;
        return sendJson(msg);
      });
      this.kept = new Map(); // digest -> Uint8Array
      this.keptBytes = 0;
      this.outgoing = new Map(); // peer -> {link, pending: Map digest -> {resolve, reject, bound}}
      this.incoming = [];
      this.stats = {
        pulledPeer: 0, pulledRelay: 0, servedPeer: 0, servedRelay: 0, signalBytes: 0, fetches: 0, rejected: 0,
      };
    }

    static usable() {
      return typeof RTCPeerConnection !== "undefined" && !!(self.crypto && crypto.subtle);
    }

    // ---- producer
    keep(hex, bytes) {
      if (this.kept.has(hex)) return;
      this.kept.set(hex, bytes);
      this.keptBytes += bytes.length;
      for (const [old, b] of this.kept) {
        if (this.keptBytes <= KEEP_BYTES) break;
        this.kept.delete(old);
        this.keptBytes -= b.length;
      }
    }

    // The server's `upload`: relay what it asks for, or say it is gone.
    onUpload(msg) {
      const bytes = this.kept.get(msg.digest);
      if (!bytes) {
        this.sendJson({ type: "relay", digest: msg.digest, missing: true });
        return;
      }
      if (this.sendJson({ type: "relay", digest: msg.digest })) {
        this.sendBinary(bytes);
        this.stats.servedRelay += bytes.length;
      }
    }

    // A `signal` from the server: for a link this page opened, or an offer from a consumer of its payloads.
    onSignal(msg) {
      this.stats.signalBytes += JSON.stringify(msg).length;
      if (this.signals.route(msg)) return;
      if (msg.kind !== "offer") return;
      const channel = this.signals.channel(msg.from, msg.link);
      const relay = () => Promise.reject(new Error("ring: the link closed"));
      // A consumer sends only requests: nothing larger is taken from it.
      const link = new PeerLink({ signal: channel, initiator: false, relay, ...this.options, maxBytes: REQUEST_BYTES });
      link.onpayload = (bytes) => this._answer(link, bytes);
      this.incoming.push({ link, channel });
      while (this.incoming.length > MAX_LINKS) {
        const old = this.incoming.shift();
        old.link.close();
        old.channel.close();
      }
      channel.onmessage({ kind: msg.kind, data: msg.data });
      link.open().catch(() => {});
    }

    _answer(link, bytes) {
      const hex = hexOf(bytes, WANT);
      if (!hex) return; // not a request: a consumer sends nothing else
      const payload = this.kept.get(hex);
      const reply = payload || TEXT.encode(NONE + hex);
      link.send(reply).then(() => { if (payload) this.stats.servedPeer += payload.length; }).catch(() => {});
    }

    // ---- consumer
    // The payload `source` ({digest, peer}) that unit `workUnit` reads as `what` ("input" | "output_grad"),
    // of `shape`: from the peer, else relayed to `url`. `alive()` false stops waiting (the unit was cancelled).
    async pull({ source, url, workUnit, what, shape, alive = () => true }) {
      const bound = payloadBound(shape);
      const own = this.kept.get(source.digest); // this page made it (it moved to the next stage since)
      if (own) return own.slice();
      if (source.peer !== null && source.peer !== undefined && PayloadRing.usable()) {
        try {
          const bytes = await this._fromPeer(source.peer, source.digest, bound);
          this.stats.pulledPeer += bytes.length;
          return bytes;
        } catch (err) {
          this.stats.rejected += /mismatch|bound/.test(String(err && err.message)) ? 1 : 0;
        }
      }
      return this._fromRelay({ digest: source.digest, url, workUnit, what, bound, alive });
    }

    async _fromPeer(peer, hex, bound) {
      const out = await this._linkTo(peer);
      if ((await out.link.open()) !== "peer") throw new Error("ring: no channel to the peer");
      const answer = new Promise((resolve, reject) => {
        out.pending.set(hex, { resolve, reject, bound });
        setTimeout(() => reject(new Error("ring: the peer did not answer")), PULL_TIMEOUT_MS);
      });
      // What a peer may make this page allocate: the largest payload asked for.
      out.link.options.maxBytes = Math.max(REQUEST_BYTES, ...[...out.pending.values()].map((w) => w.bound));
      try {
        await out.link.send(TEXT.encode(WANT + hex));
        return await answer;
      } finally {
        out.pending.delete(hex);
      }
    }

    async _linkTo(peer) {
      const known = this.outgoing.get(peer);
      if (known && known.link.via !== "relay") return known;
      if (known) this._drop(peer);
      const id = `r${Array.from(crypto.getRandomValues(new Uint8Array(6)), (b) => b.toString(16).padStart(2, "0")).join("")}`;
      const channel = this.signals.channel(peer, id);
      const relay = () => Promise.reject(new Error("ring: the link closed"));
      const link = new PeerLink({ signal: channel, initiator: true, relay, ...this.options, maxBytes: REQUEST_BYTES });
      const out = { link, channel, pending: new Map() };
      link.onpayload = (bytes, hex) => this._received(out, bytes, hex);
      this.outgoing.set(peer, out);
      while (this.outgoing.size > MAX_LINKS) this._drop(this.outgoing.keys().next().value);
      return out;
    }

    _received(out, bytes, hex) {
      const none = hexOf(bytes, NONE);
      if (none && out.pending.has(none)) return out.pending.get(none).reject(new Error("ring: the peer no longer has it"));
      const wanted = out.pending.get(hex);
      if (!wanted) return void this.stats.rejected++; // unrequested, or bytes that are not what was asked for
      if (bytes.length > wanted.bound) return wanted.reject(new Error("ring: a payload over its bound"));
      wanted.resolve(bytes);
    }

    _drop(peer) {
      const out = this.outgoing.get(peer);
      this.outgoing.delete(peer);
      if (!out) return;
      out.link.close();
      out.channel.close();
      for (const wanted of out.pending.values()) wanted.reject(new Error("ring: the link closed"));
    }

    async _fromRelay({ digest: hex, url, workUnit, what, bound, alive }) {
      this.stats.fetches++;
      this.sendJson({ type: "fetch", work_unit: workUnit, what });
      const deadline = performance.now() + RELAY_TIMEOUT_MS;
      while (alive() && performance.now() < deadline) {
        const response = await this.fetch(url).catch(() => null);
        if (response && response.ok) {
          const bytes = new Uint8Array(await response.arrayBuffer());
          if (bytes.length > bound || (await digest(bytes)) !== hex) throw new Error("ring: the relayed payload is not the one named");
          this.stats.pulledRelay += bytes.length;
          return bytes;
        }
        await new Promise((resolve) => setTimeout(resolve, RELAY_POLL_MS));
      }
      throw new Error(alive() ? "ring: the payload did not come" : "ring: cancelled");
    }

    close() {
      for (const peer of [...this.outgoing.keys()]) this._drop(peer);
      for (const { link, channel } of this.incoming.splice(0)) { link.close(); channel.close(); }
    }
  }

  ns.ring = { PeerLink, SocketSignals, PayloadRing, payloadBound, digest, CHUNK };
})((self.crowdtrain = self.crowdtrain || {}));
