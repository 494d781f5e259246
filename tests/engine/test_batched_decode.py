"""A batched decode step equals each row's sequence prefilled from scratch.

Rows of different lengths run one token each in one forward (``batched_decode``): per-row
attention on a grouped-query Llama and on SmolLM2, padded latents on MLA. The independent
reference is a fresh prefill of each row's whole sequence (a mixed-up row, a wrong position
or a missing key would each show here).
"""

from __future__ import annotations

import pytest
import torch

from leyline.engine.batched_decode import Row, decode_mode, forward_rows
from leyline.engine.engine import Engine
from leyline.engine.forward import buffers_holding, prefill_at

from ._helpers import random_tokens, rel_err

LENGTHS = (7, 40, 1, 23)


def _rows(engine: Engine, lengths: tuple[int, ...]) -> tuple[list[Row], list[list[int]]]:
    rows, seqs = [], []
    for i, n in enumerate(lengths):
        seq = random_tokens(n + 1, engine.vocab_size, seed=10 + i)
        kv, _ = engine.forward((), seq[:n])
        rows.append(Row(buffers_holding(kv, n + 1), n, seq[n]))
        seqs.append(seq)
    return rows, seqs


def _check(engine: Engine, lengths: tuple[int, ...], bound: float) -> None:
    assert engine.batches_decode
    rows, seqs = _rows(engine, lengths)
    logits = forward_rows(engine.model, rows)
    assert logits.shape == (len(rows), engine.vocab_size) and logits.dtype == torch.float32
    for row, seq, got in zip(rows, seqs, logits, strict=True):
        _, fresh = engine.forward((), seq)
        assert rel_err(got, fresh) <= bound
        # The new entry landed at the row's own length, equal to a fresh prefill's.
        reference = prefill_at(engine.model, seq, 0)
        for layer, ref in zip(row.buffers, reference, strict=True):
            for slot, want in zip(layer, ref, strict=True):
                entry = slot[..., row.length, :]
                assert rel_err(entry, want[..., row.length, :]) <= bound


def test_per_row_attention_on_a_grouped_query_llama(llama_engine: Engine) -> None:
    assert decode_mode(llama_engine.model) == "rows"
    _check(llama_engine, LENGTHS, 1e-5)


def test_padded_latents_on_mla(mla_engine: Engine) -> None:
    assert decode_mode(mla_engine.model) == "padded"
    _check(mla_engine, LENGTHS, 1e-5)


def test_engine_steps_one_row_as_a_plain_decode_step(llama_engine: Engine) -> None:
    rows, seqs = _rows(llama_engine, (12,))
    single = llama_engine.forward_rows(rows)
    _, fresh = llama_engine.forward((), seqs[0])
    assert single.shape == (1, llama_engine.vocab_size) and rel_err(single[0], fresh) <= 1e-5


def test_no_rows_is_an_error(llama_engine: Engine) -> None:
    with pytest.raises(ValueError, match="at least one row"):
        forward_rows(llama_engine.model, [])


@pytest.mark.slow
@pytest.mark.model
def test_per_row_attention_on_smollm2(smollm2_engine: Engine) -> None:
    assert decode_mode(smollm2_engine.model) == "rows"
    _check(smollm2_engine, (30, 3, 75), 1e-4)
