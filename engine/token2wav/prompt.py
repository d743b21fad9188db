"""A voice pack from a client's clip (model.md §6.1): S3 prompt tokens, CAM++ embedding, 24 kHz prompt mel.

The two ONNX models sit beside the flow in `assets/token2wav/` (§6.10: `speech_tokenizer_v2_25hz.onnx`,
`campplus.onnx`) and run on the CPU through onnxruntime, as the reference runs CAM++ (T2W-0.1.2
`_prepare_prompt`; it runs the tokenizer as a torch port of the same ONNX graph). A checkpoint without
them (or a host without onnxruntime) has no `PromptModels`: its voices are only the precomputed packs.
Inputs are bound by position, as the reference does, so the files' tensor names do not matter.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.token2wav.features import flow_mel, kaldi_fbank, resample, tokenizer_mel
from engine.voice import MEL_FRAMES_PER_TOKEN, PROMPT_SAMPLE_RATE, REF_SAMPLE_RATE, VoicePack

log = logging.getLogger(__name__)

SPEECH_TOKENIZER_FILE = "speech_tokenizer_v2_25hz.onnx"
CAMPPLUS_FILE = "campplus.onnx"
MIN_CLIP_SECONDS = 0.5  # shorter than this carries no timbre (12 prompt tokens); the fbank needs 25 ms anyway
SILENCE_RMS = 1e-3  # -60 dBFS: below this the clip is silence, whose speaker embedding means nothing
MAX_TOKENIZER_SECONDS = 30.0  # the S3 tokenizer's window


class ClipError(ValueError):
    """The clip cannot make a voice prompt (too short, silent, not finite); the message says which."""

    code = "bad_audio"


@dataclass(frozen=True)
class PromptModels:
    """The S3 speech tokenizer and CAM++ sessions (CPU)."""

    tokenizer: Any  # onnxruntime.InferenceSession
    campplus: Any

    def speech_tokens(self, pcm16k: torch.Tensor) -> torch.Tensor:
        """[N] 16 kHz -> int32 [ceil(N / 640)] S3 codes (25 Hz)."""
        feats = tokenizer_mel(pcm16k)[None].numpy()  # [1, 128, T]
        names = [i.name for i in self.tokenizer.get_inputs()]
        out = self.tokenizer.run(None, {names[0]: feats, names[1]: np.array([feats.shape[2]], np.int32)})[0]
        return torch.from_numpy(np.asarray(out).reshape(-1).astype(np.int32))

    def speaker_embedding(self, pcm16k: torch.Tensor) -> torch.Tensor:
        """[N] 16 kHz -> fp32 [192] CAM++ x-vector of the mean-normalised fbank."""
        feat = kaldi_fbank(pcm16k)
        feat = feat - feat.mean(dim=0, keepdim=True)
        name = self.campplus.get_inputs()[0].name
        out = self.campplus.run(None, {name: feat[None].numpy()})[0]
        return torch.from_numpy(np.asarray(out, np.float32).reshape(-1).copy())


def load_prompt_models(asset_dir: Path) -> tuple[PromptModels | None, str]:
    """(models, "") when both ONNX files load, else (None, why not)."""
    missing = [n for n in (SPEECH_TOKENIZER_FILE, CAMPPLUS_FILE) if not (Path(asset_dir) / n).is_file()]
    if missing:
        return None, f"{asset_dir}: no {' / '.join(missing)}"
    try:
        import onnxruntime as ort  # lazy: only checkpoints that ship the ONNX models need it
    except ImportError:
        return None, "onnxruntime is not installed"
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.intra_op_num_threads = 1  # as the reference: a clip is short, the host's cores serve the stages

    def session(name: str) -> Any:
        return ort.InferenceSession(str(Path(asset_dir) / name), sess_options=opts,
                                    providers=["CPUExecutionProvider"])

    return PromptModels(session(SPEECH_TOKENIZER_FILE), session(CAMPPLUS_FILE)), ""


def check_clip(pcm16k: torch.Tensor) -> torch.Tensor:
    """fp32 [N] 16 kHz mono in [-1, 1], long and loud enough for a voice prompt; else `ClipError`."""
    wav = pcm16k.detach().reshape(-1).float().cpu()
    seconds = wav.numel() / REF_SAMPLE_RATE
    if seconds < MIN_CLIP_SECONDS:
        raise ClipError(f"ref_audio is {seconds:.2f} s; a voice prompt needs at least {MIN_CLIP_SECONDS} s")
    if seconds > MAX_TOKENIZER_SECONDS:
        raise ClipError(f"ref_audio is {seconds:.1f} s; at most {MAX_TOKENIZER_SECONDS:.0f} s")
    if not torch.isfinite(wav).all():
        raise ClipError("ref_audio has non-finite samples")
    if float(wav.pow(2).mean().sqrt()) < SILENCE_RMS:
        raise ClipError("ref_audio is silent")
    return wav


def voice_from_clip(models: PromptModels, pcm16k: torch.Tensor, *, voice_id: str = "client",
                    max_prompt_frames: int | None = None) -> VoicePack:
    """The §6.1 voice pack of a 16 kHz clip. The whole clip is `ref_audio_16k` (the LLM prefix); the
    Token2Wav prompt is cut to `max_prompt_frames` mel frames (the slot pool's cap, 10 s by default)."""
    wav = check_clip(pcm16k)
    prompt = wav
    if max_prompt_frames is not None:
        tokens_cap = max_prompt_frames // MEL_FRAMES_PER_TOKEN
        prompt = wav[: tokens_cap * REF_SAMPLE_RATE // 25]  # 25 Hz tokens: 640 samples each
    with torch.inference_mode():
        tokens = models.speech_tokens(prompt)
        if max_prompt_frames is not None:
            tokens = tokens[: max_prompt_frames // MEL_FRAMES_PER_TOKEN]
        spk = models.speaker_embedding(prompt)
        mel = flow_mel(resample(prompt, REF_SAMPLE_RATE, PROMPT_SAMPLE_RATE))  # [T, 80]
    mel = fit_frames(mel, MEL_FRAMES_PER_TOKEN * tokens.numel())
    sha = hashlib.sha256(wav.numpy().tobytes()).hexdigest()
    return VoicePack(voice_id=voice_id, prompt_tokens=tokens, spk_embedding=spk, prompt_mel=mel,
                     ref_audio_16k=wav, metadata={"source": "client clip", "source_wav_sha256": sha,
                                                  "tool": "engine.token2wav.prompt"})


def fit_frames(mel: torch.Tensor, frames: int) -> torch.Tensor:
    """[T, 80] -> [frames, 80]: cut, or padded by repeating the last frame (the reference's replicate pad)."""
    if mel.shape[0] >= frames:
        return mel[:frames].contiguous()
    return torch.cat([mel, mel[-1:].expand(frames - mel.shape[0], -1)]).contiguous()
