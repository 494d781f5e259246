"""The reference engine in bf16 (weights and cache; rotation math in fp32), on tiny random
GQA and MLA models, checked against independent bf16 computations."""

from __future__ import annotations

import pytest
import torch

from leyline.engine.engine import Engine
from leyline.engine.forward import prefill_at
from leyline.engine.models import LoadedModel, build_tiny_mla
from leyline.engine.session import SessionCache
from leyline.protocol.algebra import Edit
from leyline.protocol.directives import Mode
from leyline.protocol.envelope import Path

from ._helpers import random_tokens, rel_err, snapshot, tiny_llama

N = 80


def _bf16_llama() -> LoadedModel:
    loaded = tiny_llama()
    loaded.model.to(torch.bfloat16)
    return loaded


@pytest.fixture(scope="module", params=["gqa", "mla-v2", "mla-v3"])
def engine(request: pytest.FixtureRequest) -> Engine:
    if request.param == "gqa":
        return Engine(_bf16_llama())
    return Engine(build_tiny_mla(request.param.removeprefix("mla-"), dtype=torch.bfloat16))


def test_bf16_models_can_be_spliced(engine: Engine) -> None:
    """Half-precision frequencies (an MLA model cast whole) are the ones rotated with."""
    assert engine.splice_refusal is None and engine.layout is not None
    assert next(engine.model.parameters()).dtype == torch.bfloat16


def test_bf16_splice_rotates_downstream_keys_to_their_new_positions(engine: Engine) -> None:
    tokens = random_tokens(N, engine.vocab_size, seed=3)
    session = SessionCache(engine)
    session.prefill(tokens)
    old = snapshot(session.kv)
    stub = tuple(random_tokens(25, engine.vocab_size, seed=4))  # 20 tokens -> 25: delta +5
    report = session.apply_edits([Edit(10, 30, stub, Mode.amortize)], want_logits=True)
    assert report.path is Path.splice and report.rotated_tokens == N - 30
    assert session.kv[0][0].dtype == torch.bfloat16
    layout = engine.layout
    assert layout is not None
    shifted = prefill_at(engine.model, tokens, 5)  # the old context, keys at new positions
    for new_layer, old_layer, ref_layer in zip(session.kv, old, shifted, strict=True):
        for slot in range(2):
            got = new_layer[slot][..., 35 : N + 4, :]  # the last token was run again
            if slot == layout.slot:
                assert rel_err(got, ref_layer[slot][..., 30 : N - 1, :]) <= 3e-2  # bf16 noise
                assert rel_err(got, old_layer[slot][..., 30 : N - 1, :]) > 5e-2  # it moved
            else:
                assert torch.equal(got, old_layer[slot][..., 30 : N - 1, :])


def test_bf16_forget_equals_a_fresh_bf16_prefill(engine: Engine) -> None:
    tokens = random_tokens(N, engine.vocab_size, seed=5)
    session = SessionCache(engine)
    session.prefill(tokens)
    session.apply_edits([Edit(20, 45, (7, 8, 9), Mode.forget)])
    _, fresh = engine.forward((), [*tokens[:20], 7, 8, 9, *tokens[45:]])
    assert rel_err(session.next_token_logits(), fresh) <= 2e-2
