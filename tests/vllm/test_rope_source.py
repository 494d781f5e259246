"""``rope_source`` against vLLM's real rotary modules, built on CPU by ``get_rope``: keys that
vLLM's own forward rotated to a position, shifted by ``leyline.engine.rope`` with the band,
match vLLM's forward at the new position; rope types that cannot be shifted are refused."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding, get_rope

from leyline.core.errors import SpliceUnsupportedError
from leyline.engine.rope import rotate_into
from leyline.engine.rope_band import RopeBand
from leyline.protocol.fallback import FallbackReason
from leyline.vllm.rope_source import band_of, band_of_model

HEAD, HEADS, MAX_POSITION = 64, 2, 4096

#: name -> (rope_parameters, is_neox_style): one of each supported class, both pairings.
SUPPORTED: dict[str, tuple[dict[str, Any], bool]] = {
    "default neox": ({"rope_type": "default", "rope_theta": 10000.0}, True),
    "default interleaved, partial": (
        {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        False,
    ),
    "llama3": (
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 1024,
        },
        True,
    ),
    "yarn": (
        {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 1024,
        },
        True,
    ),
    "deepseek yarn interleaved": (
        {
            "rope_type": "deepseek_yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 1024,
            "mscale": 1.0,
            "mscale_all_dim": 0.707,
        },
        False,
    ),
}

#: Rope types whose frequencies or positions a shift cannot reproduce exactly.
UNSUPPORTED: dict[str, dict[str, Any]] = {
    "dynamic ntk": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    "longrope": {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0] * (HEAD // 2),
        "long_factor": [2.0] * (HEAD // 2),
        "original_max_position_embeddings": 1024,
    },
    "m-rope": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 12, 12]},
}


@pytest.fixture(autouse=True)
def _vllm_config() -> Iterator[None]:
    """vLLM's custom ops read the current config when built (longrope its max length)."""
    config = VllmConfig()
    config.model_config = SimpleNamespace(max_model_len=MAX_POSITION)
    with set_current_vllm_config(config):
        yield


def _rope(name: str, dtype: torch.dtype = torch.float32) -> Any:
    parameters, neox = SUPPORTED[name]
    return get_rope(HEAD, MAX_POSITION, neox, parameters, dtype)


def _vllm_keys(rotary: Any, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``keys`` ``[n, heads, head]`` rotated to ``positions`` by vLLM's own forward."""
    _, rotated = rotary.forward_native(positions, torch.zeros_like(keys), keys.clone())
    assert isinstance(rotated, torch.Tensor)
    return rotated


def _fp32_angle_tolerance(band: RopeBand, positions: torch.Tensor, keys: torch.Tensor) -> float:
    """vLLM forms each angle ``p·f`` in fp32 (half an ulp off), leyline's shift in fp64: the
    keys may differ by that much (twice: at the old and the new position), plus rounding."""
    largest_angle = float(positions.max()) * float(band.inv_freq.max())
    return 2 * 2**-24 * (largest_angle + 8) * float(keys.abs().max()) * 1.2


@pytest.mark.parametrize("name", sorted(SUPPORTED))
@pytest.mark.parametrize("shift", [-300, 517])
def test_keys_shifted_with_the_band_match_vllms_rope_at_the_new_position(
    name: str, shift: int
) -> None:
    rotary = _rope(name)
    band = band_of(rotary)
    assert band.width == rotary.rotary_dim
    assert band.pairing == ("half" if rotary.is_neox_style else "interleaved")
    generator = torch.Generator().manual_seed(len(name))
    raw = torch.randn(64, HEADS, HEAD, generator=generator)
    old = torch.randint(300, 900, (64,), generator=generator)
    # One key moved from or to position 0, where vLLM's key is the raw one (times YaRN's
    # mscale): the band's rotation of a plain vector by the whole position.
    old[0] = max(0, -shift)

    cached = _vllm_keys(rotary, raw, old)
    shifted = rotate_into(torch.empty_like(cached), cached, shift, band.inv_freq, band.pairing)
    want = _vllm_keys(rotary, raw, old + shift)

    tolerance = _fp32_angle_tolerance(band, torch.cat((old, old + shift)), cached)
    torch.testing.assert_close(shifted, want, rtol=0, atol=tolerance)
    assert torch.equal(shifted[..., band.width :], raw[..., band.width :])
    other: Any = "interleaved" if band.pairing == "half" else "half"
    wrong = rotate_into(torch.empty_like(cached), cached, shift, band.inv_freq, other)
    assert float((wrong - want).abs().max()) > 100 * tolerance  # the pairing matters


def test_vllms_cpu_kernel_rotates_as_its_native_forward() -> None:
    """The shift is checked against ``forward_native``; the CPU kernel the server runs
    agrees with it (both pairings), so the check covers what is really cached."""
    generator = torch.Generator().manual_seed(9)
    raw = torch.randn(16, HEADS, HEAD, generator=generator)
    positions = torch.randint(0, MAX_POSITION, (16,), generator=generator)
    flat = raw.flatten(1)  # the kernel takes a layer's heads flat, as the model passes them
    for name in ("default neox", "default interleaved, partial", "llama3"):
        rotary = _rope(name)
        _, by_kernel = rotary.forward_cpu(positions, torch.zeros_like(flat), flat.clone())
        by_native = _vllm_keys(rotary, raw, positions)
        torch.testing.assert_close(by_kernel.view_as(raw), by_native, rtol=0, atol=1e-6)


def test_the_band_is_the_same_for_a_half_precision_module() -> None:
    """A bf16 model's table is rounded; its keys were rotated from the same fp32 frequencies."""
    for name in sorted(SUPPORTED):
        half = band_of(_rope(name, torch.bfloat16))
        assert torch.equal(half.inv_freq, band_of(_rope(name)).inv_freq)
        assert half.inv_freq.dtype == torch.float32


def _refused(call: Any) -> str:
    with pytest.raises(SpliceUnsupportedError) as caught:
        call()
    assert caught.value.reason == FallbackReason.unsupported_rope
    return caught.value.message


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_rope_types_that_cannot_be_shifted_exactly_are_refused(name: str) -> None:
    rotary = get_rope(HEAD, MAX_POSITION, True, UNSUPPORTED[name], torch.float32)
    assert type(rotary).__name__ in _refused(lambda: band_of(rotary))
    _refused(lambda: band_of_model(nn.ModuleList([rotary])))


def test_a_subclass_and_a_table_that_disagrees_are_refused() -> None:
    class Tweaked(RotaryEmbedding):
        pass

    _refused(lambda: band_of(Tweaked(HEAD, HEAD, 512, 10000.0, True, torch.float32)))
    # Built directly, not through get_rope, whose modules are shared: this one is altered,
    # so its frequencies no longer give the table its forward rotates with.
    rotary = RotaryEmbedding(HEAD, HEAD, 512, 10000.0, True, torch.float32)
    band_of(rotary)
    rotary.base = 10001.0
    assert "table" in _refused(lambda: band_of(rotary))


class _Layer(nn.Module):
    def __init__(self, rotary: nn.Module) -> None:
        super().__init__()
        self.rotary_emb = rotary


def test_a_model_has_one_band_or_is_refused() -> None:
    shared = _rope("llama3")
    model = nn.ModuleList([_Layer(shared), _Layer(shared)])
    assert torch.equal(band_of_model(model).inv_freq, band_of(shared).inv_freq)
    mixed = nn.ModuleList([_Layer(shared), _Layer(_rope("default neox"))])
    assert "different" in _refused(lambda: band_of_model(mixed))
    assert "no RoPE" in _refused(lambda: band_of_model(nn.Linear(2, 2)))
