// The page's side of the wire protocol: opener, seq tracking with event_ack (§6.3 J-2), heartbeat, and
// the client timing names of §10.2 that a commit-less browser can measure.
export const INPUT_RATE = 16000;
const ACK_EVERY_MS = 1000;
const HEARTBEAT_MS = 10000;

export class DuplexSession extends EventTarget {
  constructor(url) {
    super();
    this.url = url;
    this.highestSeq = 0;
    this.ackedSeq = 0;
    this.sessionId = null;
    this.rtt = null;
    this.timers = [];
  }

  open() {
    return new Promise((resolve, reject) => {
      const ws = new WebSocket(this.url);
      this.ws = ws;
      ws.onopen = () => this.send({
        type: 'session.update',
        session: {
          type: 'realtime', output_modalities: ['audio'],
          audio: { input: { format: { type: 'audio/pcm', rate: INPUT_RATE }, turn_detection: null },
                   output: { format: { type: 'audio/pcm', rate: 24000 } } },
          playback_commit_policy: 'ack_only', // this client acks what it played (§7.3)
        },
      });
      ws.onmessage = (m) => {
        const ev = JSON.parse(m.data);
        if (ev.type === 'session.created') { this.sessionId = ev.session.id; this.startTimers(); resolve(ev); }
        if (ev.type === 'error' && !this.sessionId) reject(new Error(errorText(ev)));
        if (typeof ev.server_event_seq === 'number') {
          if (ev.server_event_seq <= this.highestSeq) return; // replay duplicate (§6.3 J-6)
          this.highestSeq = ev.server_event_seq;
        }
        if (ev.type === 'session.heartbeat_ack' && this.pingAt) this.rtt = performance.now() - this.pingAt;
        this.dispatchEvent(new CustomEvent('server', { detail: ev }));
      };
      ws.onclose = (e) => { this.stopTimers(); this.dispatchEvent(new CustomEvent('closed', { detail: e })); if (!this.sessionId) reject(new Error(`closed ${e.code} ${e.reason}`)); };
      ws.onerror = () => {};
    });
  }

  startTimers() {
    this.timers.push(setInterval(() => {
      if (this.highestSeq > this.ackedSeq) { this.send({ type: 'session.event_ack', server_event_seq: this.highestSeq }); this.ackedSeq = this.highestSeq; }
    }, ACK_EVERY_MS));
    this.timers.push(setInterval(() => { this.pingAt = performance.now(); this.send({ type: 'session.heartbeat' }); }, HEARTBEAT_MS));
  }

  stopTimers() { this.timers.forEach(clearInterval); this.timers = []; }

  send(frame) {
    if (this.ws && this.ws.readyState === WebSocket.OPEN) {
      this.ws.send(JSON.stringify(frame));
      this.dispatchEvent(new CustomEvent('sent', { detail: frame }));
      return true;
    }
    return false;
  }

  close() {
    this.send({ type: 'session.close', reason: 'user_stop' });
    this.stopTimers();
  }
}

export function errorText(ev) {
  return typeof ev.error === 'string' ? `${ev.code}: ${ev.error}` : `${ev.error.code}: ${ev.error.message}`;
}

export function b64FromBytes(bytes) {
  let s = '';
  for (let i = 0; i < bytes.length; i += 0x8000) s += String.fromCharCode.apply(null, bytes.subarray(i, i + 0x8000));
  return btoa(s);
}

export function pcm16FromB64(b64) {
  const bin = atob(b64);
  const out = new Float32Array(bin.length >> 1);
  for (let i = 0; i < out.length; i++) {
    let v = bin.charCodeAt(2 * i) | (bin.charCodeAt(2 * i + 1) << 8);
    if (v >= 0x8000) v -= 0x10000;
    out[i] = v / 0x8000;
  }
  return out;
}

// Per-response client timings (§10.2), on performance.now().
export class Timings {
  constructor() { this.r = new Map(); }
  created(rid) { this.r.set(rid, { created: performance.now(), recv: [], dur: [] }); }
  audio(rid, durMs) { const x = this.r.get(rid); if (x) { x.recv.push(performance.now()); x.dur.push(durMs); } }
  summary(rid) {
    const x = this.r.get(rid);
    if (!x || !x.recv.length) return null;
    const gaps = x.recv.slice(1).map((t, i) => t - x.recv[i]);
    let end = null, maxUnder = 0, totalUnder = 0;
    x.recv.forEach((t, i) => { if (end !== null) { const g = Math.max(0, t - end); maxUnder = Math.max(maxUnder, g); totalUnder += g; } end = Math.max(t, end ?? t) + x.dur[i]; });
    return { response_created_to_first_audio_ms: x.recv[0] - x.created, max_chunk_gap_ms: gaps.length ? Math.max(...gaps) : 0,
             max_underrun_ms: maxUnder, total_underrun_ms: totalUnder, chunks: x.recv.length };
  }
}
