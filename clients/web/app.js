// Browser demo: continuous 16 kHz mic upload, 24 kHz playback with a jitter buffer, playback.ack after
// each response drains, mute, optional 1 fps camera frames riding the appends, live transcript and figures.
import { DuplexSession, Timings, b64FromBytes, errorText, pcm16FromB64 } from './session.js';

const OUT_RATE = 24000;
const FIRST_UNIT_MS = 1030; // unit boundaries on the model clock: 1030 + 1000 k (§9.4 V-3)
const UNIT_MS = 1000;
const FRAME_EDGE = 448;     // the gateway normalises frames to this longest side (§9.4 V-4)
const JPEG_QUALITY = 0.7;
const LOG_LIMIT = 200;
const SPEECH_RMS = 0.02;    // level-meter threshold that labels speech_end for latency only (never commits)

const $ = (id) => document.getElementById(id);
const demo = window.__duplexDemo = { state: 'idle', acks: [], audioChunks: 0, appends: 0, framesSent: 0, responses: {}, errors: [] };
let session = null, micCtx = null, playCtx = null, micNode = null, player = null, stream = null;
let playerState = 'idle';
let lastSpeechAt = null, speechAtCreated = new Map();
let sentMs = 0, nextBoundary = FIRST_UNIT_MS, frameB64 = null, frameTimer = null, muted = false;
const timings = new Timings();
const active = new Set(); // responses not yet done

function setState(s) {
  demo.state = s;
  $('interrupt').disabled = s !== 'speaking';
  $('state').textContent = s;
  $('state').className = `pill ${s}`;
}

// Speaking while a response is open or its audio is still playing; listening otherwise.
function refreshState() {
  if (!session) return;
  setState(active.size || playerState !== 'idle' ? 'speaking' : 'listening');
}

function log(dir, ev) {
  const skip = { 'input_audio_buffer.append': 1, 'session.event_ack': 1 };
  if (dir === 'send' && skip[ev.type]) return;
  const li = document.createElement('li');
  const extra = ev.response_id || (ev.response && ev.response.id) || ev.code || (ev.error && (ev.error.code || ev.error)) || '';
  li.innerHTML = `<span class="dir ${dir}">${dir === 'send' ? '→' : '←'}</span><span class="type"></span><span class="extra"></span>`;
  li.querySelector('.type').textContent = ev.type;
  li.querySelector('.extra').textContent = typeof extra === 'string' ? extra : '';
  const list = $('log');
  list.prepend(li);
  while (list.children.length > LOG_LIMIT) list.lastChild.remove();
}

function transcriptLine(rid) {
  let el = document.getElementById(`t-${rid}`);
  if (!el) {
    el = document.createElement('div');
    el.id = `t-${rid}`;
    el.className = 'turn assistant live';
    el.innerHTML = '<span class="who">Assistant</span><span class="text"></span><span class="status"></span>';
    $('transcript').append(el);
    $('transcript').scrollTop = $('transcript').scrollHeight;
  }
  return el;
}

function figure(name, value, unit = 'ms') {
  const el = $(`fig-${name}`);
  if (el && value !== null && value !== undefined) el.textContent = `${Math.round(value)} ${unit}`;
}

function onServer(ev) {
  log('recv', ev);
  const rid = ev.response_id || (ev.response && ev.response.id);
  switch (ev.type) {
    case 'response.created':
      document.querySelector('.hint')?.remove();
      active.add(rid); timings.created(rid); speechAtCreated.set(rid, lastSpeechAt); demo.responses[rid] = { transcript: '', audio_ms: 0 };
      transcriptLine(rid); refreshState(); break;
    case 'response.output_audio.delta': {
      const pcm = pcm16FromB64(ev.delta);
      const rate = ev.sample_rate_hz || OUT_RATE;
      const durMs = pcm.length / rate * 1000;
      timings.audio(rid, durMs); demo.audioChunks++; demo.responses[rid].audio_ms += durMs;
      player.port.postMessage({ type: 'chunk', rid, pcm: pcm.buffer }, [pcm.buffer]);
      const t = timings.summary(rid);
      if (t && t.chunks === 1) {
        figure('first', t.response_created_to_first_audio_ms);
        // speech_end_to_first_audio_ms (§10.2, optional): from the last loud append before this response
        const speechAt = speechAtCreated.get(rid);
        if (speechAt !== null && speechAt !== undefined) { demo.speechEndToFirstAudioMs = performance.now() - speechAt; figure('speech', demo.speechEndToFirstAudioMs); }
      }
      break;
    }
    case 'response.output_audio_transcript.delta':
    case 'response.output_text.delta':
      transcriptLine(rid).querySelector('.text').textContent += ev.delta;
      demo.responses[rid].transcript += ev.delta; break;
    case 'response.output_audio.done': player.port.postMessage({ type: 'end', rid }); break;
    case 'response.done': {
      active.delete(rid);
      if (demo.responses[rid] && demo.responses[rid].audio_ms > 0) player.port.postMessage({ type: 'end', rid });
      const line = transcriptLine(rid); line.classList.remove('live');
      const reason = ev.response.duplex && ev.response.duplex.reason;
      line.querySelector('.status').textContent = ev.response.status === 'completed' ? '' : `${ev.response.status} · ${reason}`;
      const sm = ev.response.duplex && ev.response.duplex.stage_metrics;
      if (sm && sm['0']) { figure('ttft', sm['0'].ttft_ms); figure('tpot', sm['0'].tpot_ms); }
      const t = timings.summary(rid);
      if (t) { figure('gap', t.max_chunk_gap_ms); figure('underrun', t.max_underrun_ms); }
      refreshState();
      break;
    }
    case 'input_audio_buffer.speech_started': {
      document.querySelector('.hint')?.remove();
      const el = document.createElement('div');
      el.className = 'turn user'; el.innerHTML = '<span class="who">You</span><span class="text"></span>';
      el.querySelector('.text').textContent = `speech at ${(ev.audio_start_ms / 1000).toFixed(1)} s`;
      $('transcript').append(el); $('transcript').scrollTop = $('transcript').scrollHeight;
      break;
    }
    case 'output_audio_buffer.cleared': player.port.postMessage({ type: 'clear', rid }); break;
    case 'playback.acknowledged': figure('played', ev.played_ms); break;
    case 'error': demo.errors.push(errorText(ev)); $('error').textContent = errorText(ev); break;
    case 'session.closed': case 'session.expired': stop(false); break;
  }
}

function onPlayer(m) {
  if (m.type === 'drained' || m.type === 'cleared') {
    const frame = { type: 'playback.ack', response_id: m.rid, played_ms: m.played_ms, truncate: m.type === 'cleared' };
    if (session && session.send(frame)) demo.acks.push(frame);
  } else if (m.type === 'progress') {
    $('fig-buffer').textContent = `${m.buffered_ms} ms`;
    $('fig-underruns').textContent = `${m.underruns}`;
    playerState = m.state;
    refreshState();
    if (session && session.rtt !== null) figure('rtt', session.rtt);
  }
}

function onMicChunk(m) {
  $('meter').style.width = `${Math.min(100, m.rms * 400)}%`;
  if (muted || !session) return; // muted: no appends at all (§8.6 U-2: append while unmuted)
  const bytes = new Uint8Array(m.pcm);
  const frame = { type: 'input_audio_buffer.append', audio: b64FromBytes(bytes), sample_rate_hz: 16000 };
  const endMs = sentMs + bytes.length / 2 / 16;
  if (endMs >= nextBoundary) { // this append closes a unit: attach the current camera frame (§9.4 V-3)
    if (frameB64) { frame.video_frames = [frameB64]; demo.framesSent++; }
    nextBoundary += UNIT_MS;
  }
  sentMs = endMs;
  if (session.send(frame)) {
    demo.appends++;
    if (m.rms > SPEECH_RMS) lastSpeechAt = performance.now();
  }
}

function grabFrame(video, canvas) {
  if (!video.videoWidth) return;
  const scale = FRAME_EDGE / Math.max(video.videoWidth, video.videoHeight);
  canvas.width = Math.round(video.videoWidth * Math.min(1, scale));
  canvas.height = Math.round(video.videoHeight * Math.min(1, scale));
  canvas.getContext('2d').drawImage(video, 0, 0, canvas.width, canvas.height);
  frameB64 = canvas.toDataURL('image/jpeg', JPEG_QUALITY).split(',')[1]; // bare base64: no data: prefix (V-1)
}

async function start() {
  $('start').disabled = true; $('error').textContent = '';
  setState('connecting');
  try {
    const wantCamera = $('camera').checked;
    stream = await navigator.mediaDevices.getUserMedia({ audio: { echoCancellation: true, noiseSuppression: true, channelCount: 1 }, video: wantCamera });
    micCtx = new AudioContext();
    playCtx = new AudioContext({ sampleRate: OUT_RATE });
    await micCtx.audioWorklet.addModule('mic-worklet.js');
    await playCtx.audioWorklet.addModule('player-worklet.js');
    micNode = new AudioWorkletNode(micCtx, 'mic-processor');
    player = new AudioWorkletNode(playCtx, 'player-processor', { outputChannelCount: [1] });
    player.connect(playCtx.destination);
    player.port.onmessage = (e) => onPlayer(e.data);
    const url = `${location.protocol === 'https:' ? 'wss' : 'ws'}://${location.host}/v1/realtime?autostart=0`;
    session = new DuplexSession(url);
    session.addEventListener('server', (e) => onServer(e.detail));
    session.addEventListener('sent', (e) => log('send', e.detail));
    session.addEventListener('closed', () => stop(false));
    const created = await session.open();
    demo.sessionId = created.session.id;
    $('session').textContent = created.session.id;
    micCtx.createMediaStreamSource(stream).connect(micNode);
    micNode.port.onmessage = (e) => onMicChunk(e.data);
    if (wantCamera && stream.getVideoTracks().length) {
      const video = $('preview'); video.srcObject = stream; video.hidden = false; await video.play();
      frameTimer = setInterval(() => grabFrame(video, $('frame')), UNIT_MS);
    }
    refreshState();
    $('stop').disabled = false; $('mute').disabled = false;
  } catch (err) {
    $('error').textContent = String(err.message || err); demo.errors.push(String(err));
    stop(true);
  }
}

function stop(sendClose = true) {
  const closing = session;
  session = null;
  if (sendClose && closing) closing.close();
  active.clear(); playerState = 'idle';
  if (player) player.port.onmessage = null;
  clearInterval(frameTimer); frameTimer = null;
  if (stream) stream.getTracks().forEach((t) => t.stop());
  if (micCtx) micCtx.close();
  if (playCtx) setTimeout(() => playCtx && playCtx.close(), 300);
  micCtx = playCtx = stream = null; sentMs = 0; nextBoundary = FIRST_UNIT_MS;
  $('preview').hidden = true;
  $('start').disabled = false; $('stop').disabled = true; $('mute').disabled = true;
  setState('idle');
}

function interrupt() {
  // A generating response is cancelled with barge_in (§8.4); audio that is only still playing is
  // dropped with output_audio_buffer.clear. Either way the server answers output_audio_buffer.cleared,
  // the player stops and playback.ack{truncate:true} reports what was heard.
  session && session.send(active.size ? { type: 'barge_in', source: 'button' } : { type: 'output_audio_buffer.clear' });
}

function toggleMute() {
  muted = !muted;
  micNode && micNode.port.postMessage({ type: 'mute', muted });
  $('mute').textContent = muted ? 'Unmute' : 'Mute';
  $('mute').classList.toggle('on', muted);
}

$('start').addEventListener('click', start);
$('stop').addEventListener('click', () => stop(true));
$('mute').addEventListener('click', toggleMute);
$('interrupt').addEventListener('click', interrupt);
