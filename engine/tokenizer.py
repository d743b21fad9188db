"""Tokenizer wrapper and the special-token table (model.md §4).

The text side is a Qwen2-style byte-level BPE run by the `tokenizers` library: `tokenizer.json` when the
checkpoint has one, else built from `vocab.json` + `merges.txt` + `added_tokens.json`. Every id the duplex
loop needs is resolved here BY TOKEN STRING and checked (§4.2); no other module may spell an id.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from engine.config import ConfigError, ModelConfig

log = logging.getLogger(__name__)

# Qwen2TokenizerFast pre-tokenisation pattern (splits digits one by one, keeps contractions).
_QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")

# SpecialTokens field -> token string. Required in every checkpoint (§4.2).
REQUIRED_TOKENS: dict[str, str] = {
    "im_start": "<|im_start|>",
    "im_end": "<|im_end|>",
    "unit_start": "<unit>",
    "unit_end": "</unit>",
    "audio_start": "<|audio_start|>",
    "audio_end": "<|audio_end|>",
    "listen": "<|listen|>",
    "speak": "<|speak|>",
    "tts_bos": "<|tts_bos|>",
    "chunk_eos": "<|chunk_eos|>",
    "chunk_tts_eos": "<|chunk_tts_eos|>",
    "turn_eos": "<|turn_eos|>",
    "tts_pad": "<|tts_pad|>",
}
# Required only when vision is enabled.
VISION_TOKENS: dict[str, str] = {
    "image_start": "<image>",
    "image_end": "</image>",
    "slice_start": "<slice>",
    "slice_end": "</slice>",
}


class TokenizerError(ConfigError):
    """Tokenizer files are missing or a required special token does not resolve."""


class Tokenizer:
    """Thin wrapper over `tokenizers.Tokenizer`. Also satisfies Stage0's `TextTokenizer` seam
    (`encode`, `decode` skipping specials, `token_id`, `bad_token_ids`)."""

    def __init__(self, backend: HFTokenizer, *, unk_token: str | None = None,
                 bad_token_ids: Sequence[int] = ()) -> None:
        self.backend = backend
        self.unk_token = unk_token
        self._bad = tuple(int(i) for i in bad_token_ids)

    @property
    def bad_token_ids(self) -> tuple[int, ...]:
        """`tokenizer_config.json` `bad_token_ids` (masked in Step B, §3.5.2); empty if absent."""
        return self._bad

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        tok_cfg = read_tokenizer_config(path)
        unk = _token_str(tok_cfg.get("unk_token"))
        if (path / "tokenizer.json").is_file():
            backend = HFTokenizer.from_file(str(path / "tokenizer.json"))
        else:
            backend = _build_bpe(path, tok_cfg)
        return cls(backend, unk_token=unk, bad_token_ids=_bad_token_ids(tok_cfg))

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        """The id of `token`, or None when it is absent or resolves to the unk token."""
        tid = self.backend.token_to_id(token)
        if tid is None or (self.unk_token is not None and token != self.unk_token
                           and tid == self.backend.token_to_id(self.unk_token)):
            return None
        return tid

    def token_id(self, token: str) -> int:
        """Like `token_to_id` but raises KeyError when the token is absent or unk."""
        tid = self.token_to_id(token)
        if tid is None:
            raise KeyError(f"token {token!r} is missing from the tokenizer")
        return tid

    def is_special(self, tid: int) -> bool:
        """True for added tokens flagged special (dropped by skip-special decoding, §4.1)."""
        added = self.backend.get_added_tokens_decoder().get(tid)
        return added is not None and added.special


@dataclass(frozen=True)
class SpecialTokens:
    """Every id the duplex loop uses, resolved from the tokenizer or the config at load time."""

    im_start: int
    im_end: int
    unit_start: int
    unit_end: int
    audio_start: int
    audio_end: int
    listen: int
    speak: int
    tts_bos: int
    chunk_eos: int
    chunk_tts_eos: int
    turn_eos: int
    tts_pad: int
    eos: int  # tokenizer_config `eos_token` (`<|im_end|>` in the real file)
    pad: int | None  # tokenizer_config `pad_token` (`<|endoftext|>`)
    bad_token_ids: tuple[int, ...]  # masked in Step B (§3.5.2); empty if the config has none
    tts_audio_bos: int  # a row of the TTS `emb_text`, from tts_config (not a token)
    tts_code_eos: int  # num_audio_tokens - 1
    image_start: int | None = None  # the four vision ids are None when vision is disabled
    image_end: int | None = None
    slice_start: int | None = None
    slice_end: int | None = None

    @classmethod
    def resolve(cls, tok: Tokenizer, cfg: ModelConfig, tok_cfg: dict[str, Any]) -> SpecialTokens:
        wanted = dict(REQUIRED_TOKENS)
        if cfg.vision is not None:
            wanted.update(VISION_TOKENS)
        ids: dict[str, int] = {}
        missing = []
        for name, token in wanted.items():
            tid = tok.token_to_id(token)
            if tid is None:
                missing.append(token)
            else:
                ids[name] = tid
        if missing:
            raise TokenizerError(f"tokenizer: required special tokens missing or unk: {missing}")
        eos_str = _token_str(tok_cfg.get("eos_token")) or REQUIRED_TOKENS["im_end"]
        eos = tok.token_to_id(eos_str)
        if eos is None:
            raise TokenizerError(f"tokenizer_config.eos_token: {eos_str!r} does not resolve")
        pad_str = _token_str(tok_cfg.get("pad_token"))
        pad = tok.token_to_id(pad_str) if pad_str else None
        out = cls(**ids, eos=eos, pad=pad, bad_token_ids=_bad_token_ids(tok_cfg),
                  tts_audio_bos=cfg.tts.audio_bos_token_id, tts_code_eos=cfg.tts.eos_code)
        out.validate(cfg)
        return out

    def token_ids(self) -> dict[str, int]:
        """Name -> id of every resolved LLM token (vision ones only when present)."""
        names = [*REQUIRED_TOKENS, *VISION_TOKENS, "eos", "pad"]
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

    def validate(self, cfg: ModelConfig) -> None:
        limit = min(cfg.llm.vocab_size, cfg.tts.num_text_tokens)
        for name, tid in {**self.token_ids(), **{f"bad_token_ids[{i}]": b
                                                 for i, b in enumerate(self.bad_token_ids)}}.items():
            if not 0 <= tid < limit:
                raise TokenizerError(f"tokenizer: {name} id {tid} is not < vocab_size and "
                                     f"num_text_tokens ({limit})")


def read_tokenizer_config(path: Path) -> dict[str, Any]:
    file = path / "tokenizer_config.json"
    return json.loads(file.read_text()) if file.is_file() else {}


def load_tokenizer(path: str | Path, cfg: ModelConfig) -> tuple[Tokenizer, SpecialTokens]:
    """Tokenizer and its checked special-token table for the checkpoint at `path`."""
    path = Path(path)
    tok = Tokenizer.from_dir(path)
    if len(tok) > cfg.llm.vocab_size:
        log.warning("tokenizer has %d tokens > vocab_size %d", len(tok), cfg.llm.vocab_size)
    return tok, SpecialTokens.resolve(tok, cfg, read_tokenizer_config(path))


def _bad_token_ids(tok_cfg: dict[str, Any]) -> tuple[int, ...]:
    bad = tok_cfg.get("bad_token_ids", [])
    if not isinstance(bad, list) or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0
                                            for b in bad):
        raise TokenizerError("tokenizer_config.bad_token_ids: expected a list of non-negative ids")
    return tuple(bad)


def _token_str(value: Any) -> str | None:
    # tokenizer_config stores special tokens either as strings or as AddedToken dicts.
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _build_bpe(path: Path, tok_cfg: dict[str, Any]) -> HFTokenizer:
    """Qwen2TokenizerFast equivalent from the slow-tokenizer files."""
    for name in ("vocab.json", "merges.txt"):
        if not (path / name).is_file():
            raise TokenizerError(f"{path}: neither tokenizer.json nor {name} found")
    vocab: dict[str, int] = json.loads((path / "vocab.json").read_text(encoding="utf-8"))
    merges = [tuple(line.split(" ")) for line in (path / "merges.txt").read_text(encoding="utf-8")
              .splitlines() if line and not line.startswith("#version")]
    added = _added_tokens(path, tok_cfg)
    # Added tokens enter the BPE vocab with their own ids, so sparse ids (e.g. gaps) stay exact.
    vocab = {**vocab, **{t: i for t, (i, _) in added.items()}}
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=None,
                                     fuse_unk=False, byte_fallback=False))
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_QWEN2_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    backend.decoder = decoders.ByteLevel()
    for token, (tid, special) in sorted(added.items(), key=lambda kv: kv[1][0]):
        at = AddedToken(token, special=special, normalized=False)
        (backend.add_special_tokens if special else backend.add_tokens)([at])
        if backend.token_to_id(token) != tid:
            raise TokenizerError(f"added token {token!r}: expected id {tid}, "
                                 f"got {backend.token_to_id(token)}")
    return backend


def _added_tokens(path: Path, tok_cfg: dict[str, Any]) -> dict[str, tuple[int, bool]]:
    """token -> (id, special) from `tokenizer_config.added_tokens_decoder` and `added_tokens.json`."""
    out: dict[str, tuple[int, bool]] = {}
    file = path / "added_tokens.json"
    if file.is_file():
        # Tokens listed only in added_tokens.json count as special (all loop tokens are, §4.1).
        out = {t: (int(i), True) for t, i in json.loads(file.read_text(encoding="utf-8")).items()}
    for tid, entry in tok_cfg.get("added_tokens_decoder", {}).items():
        out[entry["content"]] = (int(tid), bool(entry.get("special", False)))
    return out
