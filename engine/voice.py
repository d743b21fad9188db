"""Voice packs: the per-voice Token2Wav prompt plus the reference clip (model.md §6.1, §8.6, §9.4).

A pack is `voices/<id>.safetensors` with four tensors and string metadata. Loading validates every
tensor and raises `VoicePackError` naming the bad one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

FORMAT_VERSION = "1"
META_KEY = "voice_pack"
SPK_EMBED_DIM = 192  # CAM++ x-vector size (model.md C10)
MEL_BINS = 80
MEL_FRAMES_PER_TOKEN = 2  # 25 Hz S3 tokens -> 50 Hz mel
REF_SAMPLE_RATE = 16_000
PROMPT_SAMPLE_RATE = 24_000
# Tiny random pack (§9.4): 8 prompt codes, 1 s of reference audio.
RANDOM_PROMPT_TOKENS = 8
RANDOM_REF_SECONDS = 1.0
RANDOM_REF_STD = 0.1
RANDOM_VOICE_SEED = 1

_TENSORS = ("prompt_tokens", "spk_embedding", "prompt_mel", "ref_audio_16k")


class VoicePackError(ValueError):
    """A voice pack file is unreadable or one of its tensors is bad; the message names it."""


@dataclass(frozen=True)
class VoicePack:
    """One voice: S3 prompt tokens, CAM++ embedding, 24 kHz prompt mel and the 16 kHz clip."""

    voice_id: str
    prompt_tokens: torch.Tensor  # int32 [P_tok]
    spk_embedding: torch.Tensor  # fp32 [192]
    prompt_mel: torch.Tensor  # fp32 [2 * P_tok, 80]
    ref_audio_16k: torch.Tensor  # fp32 [N]
    metadata: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        validate_tensors(self.tensors(), self.voice_id)

    @property
    def num_prompt_tokens(self) -> int:
        return int(self.prompt_tokens.shape[0])

    def tensors(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in _TENSORS}

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        meta = {"format_version": FORMAT_VERSION, "voice_id": self.voice_id,
                "ref_sample_rate": str(REF_SAMPLE_RATE), "prompt_sample_rate": str(PROMPT_SAMPLE_RATE),
                **self.metadata}
        # NOTE: one sorted JSON string: safetensors writes a multi-key metadata dict in hash order,
        # which would make the file bytes differ from run to run.
        save_file({k: v.contiguous() for k, v in self.tensors().items()}, str(path),
                  metadata={META_KEY: json.dumps(meta, sort_keys=True)})
        return path


def validate_tensors(t: dict[str, torch.Tensor], where: str,
                     codebook: int | None = None) -> None:
    """Check dtypes, ranks and the 2 * P_tok mel rule; `codebook` also bounds the prompt codes."""
    for name in _TENSORS:
        if name not in t:
            raise VoicePackError(f"{where}: tensor {name} is missing")
    tok, spk, mel, ref = (t[n] for n in _TENSORS)
    if tok.dtype != torch.int32 or tok.dim() != 1 or tok.numel() == 0:
        raise VoicePackError(f"{where}: prompt_tokens must be a non-empty int32 [P_tok], "
                             f"got {tok.dtype} {tuple(tok.shape)}")
    if codebook is not None and (tok.min() < 0 or tok.max() >= codebook):
        raise VoicePackError(f"{where}: prompt_tokens values must be in [0, {codebook})")
    if spk.dtype != torch.float32 or tuple(spk.shape) != (SPK_EMBED_DIM,):
        raise VoicePackError(f"{where}: spk_embedding must be fp32 [{SPK_EMBED_DIM}], "
                             f"got {spk.dtype} {tuple(spk.shape)}")
    want_mel = (MEL_FRAMES_PER_TOKEN * tok.numel(), MEL_BINS)
    if mel.dtype != torch.float32 or tuple(mel.shape) != want_mel:
        raise VoicePackError(f"{where}: prompt_mel must be fp32 {list(want_mel)}, "
                             f"got {mel.dtype} {tuple(mel.shape)}")
    if ref.dtype != torch.float32 or ref.dim() != 1:
        raise VoicePackError(f"{where}: ref_audio_16k must be fp32 [N], got {ref.dtype} {tuple(ref.shape)}")
    for name in ("spk_embedding", "prompt_mel", "ref_audio_16k"):
        if not torch.isfinite(t[name]).all():
            raise VoicePackError(f"{where}: {name} has non-finite values")


def load_voice(path: str | Path, codebook: int | None = None) -> VoicePack:
    """Read and validate `path` (`voices/<id>.safetensors`)."""
    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (OSError, SafetensorError) as exc:
        raise VoicePackError(f"{path}: cannot read voice pack ({exc})") from None
    extra = sorted(set(tensors) - set(_TENSORS))
    if extra:
        raise VoicePackError(f"{path}: unexpected tensors {extra}")
    validate_tensors(tensors, str(path), codebook)
    try:
        meta = {str(k): str(v) for k, v in json.loads(meta.get(META_KEY, "{}")).items()}
    except (json.JSONDecodeError, AttributeError):
        raise VoicePackError(f"{path}: metadata {META_KEY} is not a JSON object") from None
    voice_id = meta.pop("voice_id", path.stem)
    meta.pop("format_version", None)
    return VoicePack(voice_id=voice_id, metadata=meta, **tensors)


def list_voices(voices_dir: str | Path) -> dict[str, Path]:
    """voice id -> file for every pack in `voices_dir` (empty when the folder is absent)."""
    d = Path(voices_dir)
    return {p.stem: p for p in sorted(d.glob("*.safetensors"))} if d.is_dir() else {}


def make_random_voice(seed: int = RANDOM_VOICE_SEED, *, codebook: int, voice_id: str = "default",
                      num_tokens: int = RANDOM_PROMPT_TOKENS,
                      ref_seconds: float = RANDOM_REF_SECONDS) -> VoicePack:
    """The seeded random pack of §9.4 (tiny checkpoints and dummy benchmarks; P = 2 * num_tokens).

    `codebook` is the S3 codebook size (flow `vocab_size` = `tts_config.num_audio_tokens - 1`)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, codebook, (num_tokens,), generator=g).to(torch.int32)
    spk = torch.randn(SPK_EMBED_DIM, generator=g)
    mel = torch.randn(MEL_FRAMES_PER_TOKEN * num_tokens, MEL_BINS, generator=g)
    ref = torch.randn(int(ref_seconds * REF_SAMPLE_RATE), generator=g) * RANDOM_REF_STD
    return VoicePack(voice_id=voice_id, prompt_tokens=tokens, spk_embedding=spk, prompt_mel=mel,
                     ref_audio_16k=ref, metadata={"source": f"random seed {seed}",
                                                  "source_wav_sha256": "", "tool": "engine.voice"})
