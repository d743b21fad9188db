// Playback worklet (context at 24 kHz): a jitter buffer per response with fades, and per-response
// played-sample counters reported back so the page can send playback.ack (protocol §7.2).
const PREBUFFER_S = 0.12; // jitter buffer: wait for this much audio before (re)starting
const FADE_S = 0.008;      // fade in at start / after an underrun, fade out at the end and on clear
const PROGRESS_S = 0.1;

class PlayerProcessor extends AudioWorkletProcessor {
  constructor() {
    super();
    this.queue = [];             // {rid, data: Float32Array, off}
    this.ended = new Set();      // responses whose audio is complete (no more chunks coming)
    this.played = new Map();     // rid -> samples played
    this.finished = new Set();   // responses whose final position was reported
    this.state = 'idle';         // idle | buffering | playing
    this.gain = 0;
    this.fadeLen = Math.round(FADE_S * sampleRate);
    this.prebuffer = Math.round(PREBUFFER_S * sampleRate);
    this.clearing = null;        // {rid, left}
    this.underruns = 0;
    this.sinceProgress = 0;
    this.port.onmessage = (e) => this.onMessage(e.data);
  }

  onMessage(m) {
    if (m.type === 'chunk') {
      this.queue.push({ rid: m.rid, data: new Float32Array(m.pcm), off: 0 });
      if (!this.played.has(m.rid)) this.played.set(m.rid, 0);
    } else if (m.type === 'end') {
      this.ended.add(m.rid);
      if (!this.queue.some((c) => c.rid === m.rid)) this.report('drained', m.rid);
    } else if (m.type === 'clear') {
      if (this.queue.some((c) => c.rid === m.rid) && this.state === 'playing' && this.queue[0].rid === m.rid) {
        this.clearing = { rid: m.rid, left: this.fadeLen };
      } else {
        this.drop(m.rid);
      }
    }
  }

  drop(rid) {
    this.queue = this.queue.filter((c) => c.rid !== rid);
    this.ended.add(rid);
    this.clearing = null;
    this.report('cleared', rid);
    if (!this.queue.length) this.state = 'idle';
  }

  report(type, rid) {
    if (this.finished.has(rid)) return; // one final report (drained or cleared) per response
    this.finished.add(rid);
    const ms = Math.round(((this.played.get(rid) || 0) / sampleRate) * 1000);
    this.port.postMessage({ type, rid, played_ms: ms, underruns: this.underruns });
  }

  buffered() {
    let n = 0;
    for (const c of this.queue) n += c.data.length - c.off;
    return n;
  }

  process(inputs, outputs) {
    const out = outputs[0][0];
    out.fill(0);
    if (this.state !== 'playing' && this.queue.length) {
      const head = this.queue[0].rid;
      if (this.buffered() >= this.prebuffer || this.ended.has(head)) { this.state = 'playing'; this.gain = 0; }
      else this.state = 'buffering';
    }
    for (let i = 0; i < out.length && this.state === 'playing'; i++) {
      const c = this.queue[0];
      if (!c) { this.state = 'idle'; break; }
      let target = 1;
      if (this.clearing) target = Math.max(0, --this.clearing.left) / this.fadeLen;
      if (this.ended.has(c.rid) && c.data.length - c.off < this.fadeLen) { // only near a chunk's end
        const rest = this.queue.reduce((a, q) => a + (q.rid === c.rid ? q.data.length - q.off : 0), 0);
        if (rest < this.fadeLen) target = Math.min(target, rest / this.fadeLen);
      }
      this.gain = this.gain < target ? Math.min(target, this.gain + 1 / this.fadeLen) : target;
      out[i] = c.data[c.off++] * this.gain;
      this.played.set(c.rid, this.played.get(c.rid) + 1);
      if (this.clearing && this.clearing.left <= 0) { this.drop(c.rid); break; }
      if (c.off >= c.data.length) {
        this.queue.shift();
        const next = this.queue[0];
        if (this.ended.has(c.rid) && (!next || next.rid !== c.rid)) this.report('drained', c.rid);
        if (!next) {
          if (!this.ended.has(c.rid)) { this.underruns++; this.state = 'buffering'; this.gain = 0; }
          else this.state = 'idle';
        }
      }
    }
    this.sinceProgress += out.length;
    if (this.sinceProgress >= PROGRESS_S * sampleRate) {
      this.sinceProgress = 0;
      this.port.postMessage({ type: 'progress', state: this.state, buffered_ms: Math.round(this.buffered() / sampleRate * 1000),
        rid: this.queue.length ? this.queue[0].rid : null, underruns: this.underruns });
    }
    return true;
  }
}

registerProcessor('player-processor', PlayerProcessor);
