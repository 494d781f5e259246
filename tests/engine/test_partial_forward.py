"""The partial forwards behind selective recompute, against transformers' own prefill
(tiny random GQA Llama and MLA models)."""

from __future__ import annotations

import pytest
import torch

from leyline.engine.engine import Engine
from leyline.engine.forward import filled, forward_at, new_buffers, prefill_at
from leyline.engine.partial_forward import decoder_layers, forward_through

from ._helpers import random_tokens, rel_err


@pytest.fixture(params=["llama", "mla"])
def engine(request: pytest.FixtureRequest, llama_engine: Engine, mla_engine: Engine) -> Engine:
    return llama_engine if request.param == "llama" else mla_engine


def _buffers_holding(engine: Engine, tokens: list[int], upto: int) -> list[list[torch.Tensor]]:
    """Buffers for ``tokens`` whose first ``upto`` positions hold their prefill, NaN after."""
    full = prefill_at(engine.model, tokens, 0)
    buffers = new_buffers(full, len(tokens))
    for layer, slots in zip(full, buffers, strict=True):
        for src, dst in zip(layer, slots, strict=True):
            dst.fill_(float("nan"))
            dst[..., :upto, :].copy_(src[..., :upto, :])
    return buffers


def test_scattered_over_a_contiguous_tail_is_a_chunked_prefill(engine: Engine) -> None:
    tokens = random_tokens(30, engine.vocab_size, 1)
    full = prefill_at(engine.model, tokens, 0)
    buffers = _buffers_holding(engine, tokens, 12)
    logits = forward_at(
        engine.model, buffers, list(range(12, 30)), tokens[12:], chunk=5, by_runs=False
    )
    for got, want in zip(filled(buffers, 30), full, strict=True):
        for g, w in zip(got, want, strict=True):
            assert rel_err(g, w) <= 1e-5
    with torch.no_grad():
        plain = engine.model(input_ids=torch.tensor([tokens])).logits[0, -1]
    assert rel_err(logits, plain) <= 1e-5


def test_scattered_positions_see_only_what_precedes_them(engine: Engine) -> None:
    """Recomputing positions 13 and 20 of an exact cache changes nothing (up to rounding):
    each sees its true prefix. NaN after position 20 proves nothing later is read."""
    tokens = random_tokens(30, engine.vocab_size, 2)
    full = prefill_at(engine.model, tokens, 0)
    buffers = _buffers_holding(engine, tokens, 21)
    forward_at(engine.model, buffers, [13, 20], [tokens[13], tokens[20]], by_runs=False)
    for got, want in zip(filled(buffers, 21), full, strict=True):
        for g, w in zip(got, want, strict=True):
            assert rel_err(g, w[..., :21, :]) <= 1e-5
    with pytest.raises(ValueError):
        forward_at(engine.model, buffers, [3, 2], [tokens[3], tokens[2]], by_runs=False)


def test_forward_through_runs_the_first_layers_only(engine: Engine) -> None:
    tokens = random_tokens(30, engine.vocab_size, 3)
    full = prefill_at(engine.model, tokens, 0)
    buffers = _buffers_holding(engine, tokens, 10)
    forward_through(engine.model, buffers, 10, tokens[10:], 0, chunk=7)
    for i, (got, want) in enumerate(zip(buffers, full, strict=True)):
        for g, w in zip(got, want, strict=True):
            if i == 0:  # the prefill's own KV
                assert rel_err(g, w) <= 1e-5
            else:  # never run: still NaN past the prefix
                assert torch.isnan(g[..., 10:, :]).all()
    layers = decoder_layers(engine.model)
    assert layers is not None and not any(layer._forward_pre_hooks for layer in layers)
