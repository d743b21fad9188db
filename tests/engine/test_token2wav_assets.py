"""Token2Wav assets: restricted flow.yaml parser, strict loader, layout detection, byte-identical writer."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import pytest
import torch

from engine.config import ConfigError
from engine.token2wav.assets import (
    AssetError,
    build_tiny_modules,
    load_token2wav,
    write_tiny_token2wav_assets,
)
from engine.token2wav.config import TINY_FLOW, FlowConfig, flow_yaml_text, parse_flow_yaml

FILES = ("flow.yaml", "flow.pt", "hift.pt")


def _hashes(d: Path) -> list[str]:
    return [hashlib.sha256((d / f).read_bytes()).hexdigest() for f in FILES]


def test_writer_is_byte_identical_per_seed(tmp_path):
    write_tiny_token2wav_assets(tmp_path / "a", seed=0)
    write_tiny_token2wav_assets(tmp_path / "b", seed=0)
    write_tiny_token2wav_assets(tmp_path / "c", seed=1)
    assert _hashes(tmp_path / "a") == _hashes(tmp_path / "b")
    assert _hashes(tmp_path / "a")[1:] != _hashes(tmp_path / "c")[1:]


def test_loader_round_trip(tmp_path):
    write_tiny_token2wav_assets(tmp_path, seed=0)
    m = load_token2wav(tmp_path, "cpu")
    assert m.layout == "A" and m.flow_cfg == TINY_FLOW
    assert (m.hift_cfg.base_channels, m.hift_cfg.f0_cond_channels) == (32, 32)
    flow, hift = build_tiny_modules(seed=0)
    for a, b in ((m.flow, flow), (m.hift, hift)):
        for k, v in b.state_dict().items():
            torch.testing.assert_close(a.state_dict()[k], v, atol=1e-7, rtol=1e-6)
    raw = torch.load(tmp_path / "hift.pt", weights_only=True)
    assert all(k.startswith("generator.") for k in raw)
    assert "generator.conv_pre.parametrizations.weight.original0" in raw
    assert "generator.source_downs.0.weight" in raw          # plain conv, not weight-normed


def test_loader_is_strict(tmp_path):
    write_tiny_token2wav_assets(tmp_path, seed=0)
    state = torch.load(tmp_path / "flow.pt", weights_only=True)
    state.pop("encoder.after_norm.weight")
    state["encoder.bogus"] = torch.zeros(1)
    state["encoder_proj.bias"] = torch.zeros(3)
    torch.save(state, tmp_path / "flow.pt")
    with pytest.raises(AssetError) as err:
        load_token2wav(tmp_path, "cpu")
    msg = str(err.value)
    assert "encoder.after_norm.weight" in msg and "encoder.bogus" in msg and "encoder_proj.bias" in msg


def test_layout_b_loads_hift_original(tmp_path, caplog):
    write_tiny_token2wav_assets(tmp_path, seed=0)
    (tmp_path / "hift.pt").rename(tmp_path / "hift_original.pt")
    torch.save({"generator.causal": torch.zeros(1)}, tmp_path / "hift.pt")   # the CosyVoice3 vocoder
    (tmp_path / "config.yaml").write_text("{}\n")
    with caplog.at_level(logging.WARNING):
        m = load_token2wav(tmp_path, "cpu")
    assert m.layout == "B" and "layout B" in caplog.text


def test_flow_yaml_round_trip_and_full_size():
    assert parse_flow_yaml(flow_yaml_text(TINY_FLOW)) == TINY_FLOW
    assert parse_flow_yaml(flow_yaml_text(FlowConfig())) == FlowConfig()


@pytest.mark.parametrize("bad", [
    "flow: !new:os.system\n    command: ls\n",
    "x: !apply:os.system [ls]\nflow: 1\n",
    "x: !name:os.system\n",
    "n: 512\nflow: !new:cosyvoice2.flow.flow.CausalMaskedDiffWithXvec\n    input_size: !ref <n>\n",
    "flow: !!python/object/apply:os.system [ls]\n",
])
def test_flow_yaml_rejects_other_tags(bad):
    with pytest.raises(ConfigError):
        parse_flow_yaml(bad)


def test_flow_yaml_rejects_unknown_and_bad_fields():
    text = flow_yaml_text(TINY_FLOW)
    with pytest.raises(ConfigError, match="unknown keys"):
        parse_flow_yaml(text.replace("    vocab_size:", "    surprise: 1\n    vocab_size:"))
    with pytest.raises(ConfigError, match="C8"):
        parse_flow_yaml(text.replace("up_stride: 2", "up_stride: 3"))
    with pytest.raises(ConfigError, match="missing"):
        parse_flow_yaml(text.replace("            depth: 2\n", ""))
