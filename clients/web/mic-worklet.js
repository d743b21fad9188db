// Capture worklet: mono input at the context rate -> low-pass -> 16 kHz PCM16 -> one message per 200 ms.
// No VAD and no commits here (protocol §8.6 U-2): the model decides when to speak.
const OUT_RATE = 16000;
const CHUNK_SAMPLES = 3200; // 200 ms at 16 kHz
const CUTOFF_HZ = 7000;     // below the 8 kHz Nyquist of the output rate

class MicProcessor extends AudioWorkletProcessor {
  constructor() {
    super();
    this.step = sampleRate / OUT_RATE; // input samples per output sample
    this.t = 0;                         // next output position, in input samples from this block's start
    this.last = 0;                      // previous block's last filtered sample
    this.out = new Int16Array(CHUNK_SAMPLES);
    this.n = 0;
    this.sumSq = 0;
    this.muted = false;
    this.lp = this.step > 1 ? biquadLowpass(CUTOFF_HZ / sampleRate) : null;
    this.z1 = 0; this.z2 = 0;
    this.port.onmessage = (e) => { if (e.data.type === 'mute') this.muted = e.data.muted; };
  }

  filter(x) {
    if (!this.lp) return x;
    const y = new Float32Array(x.length);
    const { b0, b1, b2, a1, a2 } = this.lp;
    for (let i = 0; i < x.length; i++) { // transposed direct form II
      const v = b0 * x[i] + this.z1;
      this.z1 = b1 * x[i] - a1 * v + this.z2;
      this.z2 = b2 * x[i] - a2 * v;
      y[i] = v;
    }
    return y;
  }

  process(inputs) {
    const ch = inputs[0] && inputs[0][0];
    if (!ch) return true;
    const y = this.filter(ch);
    while (this.t < y.length) {
      const i = Math.floor(this.t);
      const frac = this.t - i;
      const a = i === 0 ? this.last : y[i - 1];
      const s = a + (y[i] - a) * frac;
      const v = this.muted ? 0 : Math.max(-1, Math.min(1, s));
      this.out[this.n++] = v < 0 ? v * 0x8000 : v * 0x7fff;
      this.sumSq += v * v;
      if (this.n === CHUNK_SAMPLES) this.flush();
      this.t += this.step;
    }
    this.t -= y.length;
    this.last = y[y.length - 1];
    return true;
  }

  flush() {
    const pcm = this.out;
    const rms = Math.sqrt(this.sumSq / CHUNK_SAMPLES);
    this.port.postMessage({ type: 'chunk', pcm: pcm.buffer, rms, muted: this.muted }, [pcm.buffer]);
    this.out = new Int16Array(CHUNK_SAMPLES);
    this.n = 0;
    this.sumSq = 0;
  }
}

// RBJ cookbook low-pass (Q = 1/sqrt(2)); f = cutoff / sampleRate.
function biquadLowpass(f) {
  const w = 2 * Math.PI * f, alpha = Math.sin(w) / Math.SQRT2, cos = Math.cos(w), a0 = 1 + alpha;
  return { b0: (1 - cos) / 2 / a0, b1: (1 - cos) / a0, b2: (1 - cos) / 2 / a0, a1: -2 * cos / a0, a2: (1 - alpha) / a0 };
}

registerProcessor('mic-processor', MicProcessor);
