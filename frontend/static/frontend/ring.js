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

  ns.ring = { PeerLink, SocketSignals, digest, CHUNK };
})((self.crowdtrain = self.crowdtrain || {}));
