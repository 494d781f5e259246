"""Cache layouts: detected from the cache, and rotated keys equal keys recomputed at new positions.

"Recomputed" = the same tokens prefilled from scratch at positions shifted by delta (attention
is relative, so every layer's hidden states are those of the unshifted run): the keys of
that run are what transformers itself would cache at the new positions.
"""

from __future__ import annotations

import pytest
import torch

from leyline.core.errors import SpliceUnsupportedError
from leyline.engine.engine import Engine
from leyline.engine.forward import prefill_at
from leyline.engine.kv.layouts import CacheLayout, detect_layout, match_layouts
from leyline.engine.models import LoadedModel, build_tiny_mla
from leyline.engine.rope import RopeSpec, delta_rotate, rope_spec
from leyline.engine.session import SessionCache
from leyline.protocol.algebra import Edit
from leyline.protocol.fallback import FallbackReason

from ._helpers import YARN, random_tokens, rel_err, tiny_llama, tiny_phi

CASES = {
    "llama-yarn": lambda: tiny_llama(YARN),
    "phi-partial": tiny_phi,
    "mla-v2": lambda: build_tiny_mla("v2"),
    "mla-v3": lambda: build_tiny_mla("v3"),
    "mla-v3-yarn": lambda: build_tiny_mla(
        "v3", rope_parameters={**YARN, "mscale": 1.0}, max_position_embeddings=2048
    ),
}
EXPECTED = {
    "llama-yarn": ("gqa", 0, 0, 32, "half"),
    "phi-partial": ("gqa", 0, 0, 16, "half"),
    "mla-v2": ("mla-latent", 1, 0, 16, "interleaved"),
    "mla-v3": ("mla-latent", 1, 0, 16, "half"),
    "mla-v3-yarn": ("mla-latent", 1, 0, 16, "half"),
}


def _worst_layer_errors(
    loaded: LoadedModel, layout: CacheLayout, rope: RopeSpec, delta: int, n: int = 48
) -> tuple[float, float, float]:
    """(rotated, wrong pairing, unrotated) worst-layer rel L2 vs recomputed keys."""
    tokens = random_tokens(n, int(loaded.model.config.vocab_size), seed=1)
    old = prefill_at(loaded.model, tokens, 20)
    new = prefill_at(loaded.model, tokens, 20 + delta)
    wrong = CacheLayout(
        layout.kind,
        layout.slot,
        layout.offset,
        layout.width,
        "interleaved" if layout.pairing == "half" else "half",
    )

    def band_rotated(how: CacheLayout, layer: tuple[torch.Tensor, ...]) -> torch.Tensor:
        key = layer[how.slot]
        return delta_rotate(key, delta, rope.inv_freq, how.pairing, offset=how.offset)

    errs: tuple[list[float], list[float], list[float]] = [], [], []
    for a, b in zip(old, new, strict=True):
        want = b[layout.slot]
        errs[0].append(rel_err(band_rotated(layout, a), want))
        errs[1].append(rel_err(band_rotated(wrong, a), want))
        errs[2].append(rel_err(a[layout.slot], want))
    return max(errs[0]), min(errs[1]), min(errs[2])


@pytest.mark.parametrize("case", sorted(CASES))
def test_layout_is_detected_from_the_cache(case: str) -> None:
    loaded = CASES[case]()
    rope = rope_spec(loaded.model)
    layout = detect_layout(loaded.model, rope)
    assert (layout.kind, layout.slot, layout.offset, layout.width, layout.pairing) == EXPECTED[case]


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("delta", [-17, 141])
def test_rotated_keys_equal_recomputed_keys_on_every_layer(case: str, delta: int) -> None:
    loaded = CASES[case]()
    rope = rope_spec(loaded.model)
    layout = detect_layout(loaded.model, rope)
    right, wrong_pairing, unrotated = _worst_layer_errors(loaded, layout, rope, delta)
    assert right <= 1e-5
    assert wrong_pairing > 1e-2 and unrotated > 1e-2  # the check can fail


@pytest.mark.slow
@pytest.mark.model
def test_smollm2_rotated_keys_equal_recomputed_keys(smollm2: LoadedModel) -> None:
    rope = rope_spec(smollm2.model)
    layout = detect_layout(smollm2.model, rope)
    assert (layout.kind, layout.width, layout.pairing) == ("gqa", 64, "half")
    for delta in (-15, 290):
        right, wrong_pairing, unrotated = _worst_layer_errors(smollm2, layout, rope, delta, n=64)
        assert right <= 1e-5, right
        assert wrong_pairing > 1e-2 and unrotated > 1e-2


def test_an_mla_splice_leaves_the_latent_bitwise_unchanged() -> None:
    """Only the rope band moves: downstream latents are copied, never recomputed."""
    engine = Engine(build_tiny_mla("v3"))
    session = SessionCache(engine)
    session.prefill(random_tokens(40, engine.vocab_size, seed=2))
    old = session.kv
    session.apply_edits([Edit(10, 20, (5, 6, 7))])  # the run from 20 moves by -7
    layout = engine.layout
    assert layout is not None and layout.kind == "mla-latent"
    band = 1 - layout.slot
    for before, after in zip(old, session.kv, strict=True):
        assert torch.equal(after[band][..., 13:, :], before[band][..., 20:, :])
        assert not torch.equal(after[layout.slot][..., 13:, :], before[layout.slot][..., 20:, :])


def test_old_mla_full_key_layout_is_recognised_from_synthetic_caches() -> None:
    """Before transformers 5.15, MLA cached full per-head keys (nope | rope) and values."""
    rope = rope_spec(tiny_llama().model)  # any inv_freq; a 32-dim band
    nope, band = torch.randn(1, 4, 6, 64), torch.randn(1, 4, 6, 32)
    values = torch.randn(1, 4, 6, 48)
    unshifted = (torch.cat([nope, band], -1), values)
    shifted = (torch.cat([nope, delta_rotate(band, 9, rope.inv_freq, "interleaved")], -1), values)
    assert match_layouts(unshifted, shifted, 9, rope, tol=1e-5) == [(0, 64, "interleaved")]


def test_no_consistent_band_is_unsupported_layout() -> None:
    loaded = tiny_llama()
    rope = rope_spec(loaded.model)
    half = RopeSpec(rope.rope_type, rope.inv_freq[:4] * 3.0, 1.0)  # not the model's rope
    with pytest.raises(SpliceUnsupportedError) as info:
        detect_layout(loaded.model, half)
    assert info.value.reason is FallbackReason.unsupported_layout
