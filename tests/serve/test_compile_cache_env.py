"""Where `duplex serve` points the stages' torch.compile cache (serve/tritonserver.py `compile_cache_env`); the
e2e test tests/e2e/test_compile_cache.py shows the stubs writing there and a restart loading it."""

from __future__ import annotations

from pathlib import Path

import pytest

from serve.tritonserver import COMPILE_CACHE_ENV, compile_cache_env


def test_the_compile_cache_goes_under_the_cache_dir_as_an_absolute_path(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    env = compile_cache_env(Path("cache"), {})
    assert env == {COMPILE_CACHE_ENV: str(tmp_path / "cache" / "torch-compile")}


def test_a_cache_dir_the_caller_set_is_kept_and_an_empty_one_is_unset(tmp_path: Path) -> None:
    assert compile_cache_env(tmp_path, {COMPILE_CACHE_ENV: "/theirs"}) == {}
    assert compile_cache_env(tmp_path, {COMPILE_CACHE_ENV: ""}) == {COMPILE_CACHE_ENV: str(tmp_path / "torch-compile")}
