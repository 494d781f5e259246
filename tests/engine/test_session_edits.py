"""Splice / forget / erratum on tiny random models (GQA Llama, MLA V2 and V3): fast and exact."""

from __future__ import annotations

import torch

from leyline.engine.engine import Engine
from leyline.engine.forward import prefill_at
from leyline.engine.session import SessionCache
from leyline.protocol.algebra import Edit, apply_edits
from leyline.protocol.directives import Mode
from leyline.protocol.envelope import Path

from ._helpers import kl, kv_bitwise_equal, random_tokens, rel_err, snapshot

N = 80


def _session(engine: Engine, seed: int = 0, n: int = N):
    tokens = random_tokens(n, engine.vocab_size, seed)
    session = SessionCache(engine)
    session.prefill(tokens)
    return session, tokens


def _fresh(engine: Engine, tokens: tuple[int, ...] | list[int]):
    """Fresh prefill of ``tokens`` from scratch: (kv, next-token logits)."""
    return engine.forward((), list(tokens))


def test_splicing_a_span_with_itself_reproduces_full_context_logits(llama_engine: Engine) -> None:
    session, tokens = _session(llama_engine)
    before = snapshot(session.kv)
    report = session.apply_edits([Edit(10, 30, tuple(tokens[10:30]), Mode.amortize)])
    assert report.path is Path.splice and report.prefilled_tokens == 0
    assert kv_bitwise_equal(session.kv, before)
    assert rel_err(session.next_token_logits(), _fresh(llama_engine, tokens)[1]) <= 1e-5


def test_splice_keeps_downstream_values_bitwise_and_rotates_keys(tiny_engine: Engine) -> None:
    """The slot off the rope band (GQA: values; MLA: the latent) of moved tokens is bitwise
    unchanged; the rope band moves."""
    session, tokens = _session(tiny_engine, seed=3)
    old = snapshot(session.kv)
    stub = tuple(random_tokens(25, tiny_engine.vocab_size, seed=4))  # 20-token span -> 25: delta +5
    session.apply_edits([Edit(10, 30, stub, Mode.amortize)])
    layout = tiny_engine.layout
    assert layout is not None
    # Recomputed reference: the OLD sequence prefilled at positions shifted by delta gives
    # the downstream keys the old context produces at their new positions.
    shifted = prefill_at(tiny_engine.model, tokens, 5)
    for (k_new, v_new), old_layer, ref_layer in zip(session.kv, old, shifted, strict=True):
        new_layer = (k_new, v_new)
        for slot in range(2):
            got = new_layer[slot][..., 35 : N + 5, :]
            if slot == layout.slot:
                assert rel_err(got, ref_layer[slot][..., 30:, :]) <= 1e-5
                assert rel_err(got, old_layer[slot][..., 30:, :]) > 1e-2  # it did move
            else:
                assert torch.equal(got, old_layer[slot][..., 30:, :])  # bitwise
        # The untouched prefix is bitwise the old one.
        assert all(
            torch.equal(new_layer[s][..., :10, :], old_layer[s][..., :10, :]) for s in range(2)
        )


def test_forget_equals_a_fresh_prefill_of_the_edited_text(tiny_engine: Engine) -> None:
    session, tokens = _session(tiny_engine, seed=5)
    stub = (7, 8, 9)
    report = session.apply_edits([Edit(20, 45, stub, Mode.forget)])
    assert report.path is Path.reprefill and report.rotated_tokens == 0
    fresh_kv, fresh_logits = _fresh(tiny_engine, tokens[:20] + list(stub) + tokens[45:])
    assert rel_err(session.next_token_logits(), fresh_logits) <= 1e-5
    for got, want in zip(session.kv, fresh_kv, strict=True):
        for slot in range(2):
            assert rel_err(got[slot], want[slot]) <= 1e-5


def test_erratum_appends_and_keeps_the_prefix_bitwise(llama_engine: Engine) -> None:
    session, tokens = _session(llama_engine, seed=6)
    old = snapshot(session.kv)
    note = (11, 12, 13, 14)
    report = session.apply_edits([Edit(N, N, note, Mode.amortize)])
    assert report.reused_tokens == N and report.prefilled_tokens == 4 and report.rotated_tokens == 0
    assert session.tokens == tuple(tokens) + note
    assert all(
        torch.equal(a[s][..., :N, :], b[s])
        for a, b in zip(session.kv, old, strict=True)
        for s in range(2)
    )
    assert rel_err(session.next_token_logits(), _fresh(llama_engine, session.tokens)[1]) <= 1e-5


def test_a_batch_equals_its_edits_applied_one_by_one(llama_engine: Engine) -> None:
    tokens = random_tokens(N, llama_engine.vocab_size, seed=7)
    a, b = (5, 6, 7), (21, 22)
    batch = SessionCache(llama_engine)
    batch.prefill(tokens)
    batch.apply_edits([Edit(50, 60, b, Mode.amortize), Edit(10, 20, a, Mode.amortize)])
    steps = SessionCache(llama_engine)
    steps.prefill(tokens)
    steps.apply_edits([Edit(10, 20, a, Mode.amortize)])  # later edit: shifted by -7
    steps.apply_edits([Edit(43, 53, b, Mode.amortize)])
    assert batch.tokens == steps.tokens
    for x, y in zip(batch.kv, steps.kv, strict=True):
        assert rel_err(x[0], y[0]) <= 1e-5 and rel_err(x[1], y[1]) <= 1e-5
    assert rel_err(batch.next_token_logits(), steps.next_token_logits()) <= 1e-4


def test_delete_only_splice_moves_the_tail_without_prefill(llama_engine: Engine) -> None:
    session, tokens = _session(llama_engine, seed=8)
    report = session.apply_edits([Edit(30, 50, (), Mode.amortize)])
    assert report.prefilled_tokens == 0 and report.rotated_tokens == N - 50
    assert session.tokens == tuple(tokens[:30] + tokens[50:])


def test_mla_splice_is_closer_to_reprefill_than_no_rotation(mla_engine: Engine) -> None:
    """RANDOM WEIGHTS (tiny MLA): KL to re-prefill, right rotation vs none, over many edits."""
    from leyline.engine.edits.run_executor import execute_edit
    from leyline.engine.rope import RopeSpec

    right, none = [], []
    rope = mla_engine.rope
    assert rope is not None and mla_engine.layout is not None
    zero = RopeSpec(rope.rope_type, torch.zeros_like(rope.inv_freq), 1.0)
    for seed in range(6):
        session, tokens = _session(mla_engine, seed=10 + seed, n=60)
        result = apply_edits(tokens, [Edit(8, 28, (3, 4, 5), Mode.amortize)])
        ref = _fresh(mla_engine, result.tokens)[1]
        base = dict(old_exact_length=60)
        for spec, sink in ((rope, right), (zero, none)):
            out = execute_edit(
                mla_engine.forwards, mla_engine.layout, spec, session.kv, result, **base
            )
            last = mla_engine.forward(
                tuple(tuple(t[..., :-1, :] for t in layer) for layer in out.kv), result.tokens[-1:]
            )[1]
            sink.append(kl(ref, last))
    assert sum(right) < sum(none) / 3, (right, none)


def test_eager_logits_equal_lazy_logits(llama_engine: Engine) -> None:
    tokens = random_tokens(N, llama_engine.vocab_size, seed=9)
    edit = Edit(10, 30, (4, 5), Mode.amortize)
    eager, lazy = SessionCache(llama_engine), SessionCache(llama_engine)
    eager.prefill(tokens)
    lazy.prefill(tokens)
    eager.apply_edits([edit], want_logits=True)
    lazy.apply_edits([edit])
    assert eager.state.logits is not None and lazy.state.logits is None
    # the eager last token is one row of the pass's matrix products, the lazy one a lone
    # row: different GEMM kernels, whose fp32 sums differ by ~1e-6 relative on AVX2 CPUs
    assert rel_err(eager.state.logits, lazy.next_token_logits()) <= 1e-5
    assert all(
        rel_err(a[s], b[s]) <= 1e-6
        for a, b in zip(eager.kv, lazy.kv, strict=True)
        for s in range(2)
    )


def test_after_a_splice_the_next_tokens_do_not_depend_on_when_logits_were_asked(
    llama_engine: Engine,
) -> None:
    """One rule: the spliced sequence's last token is recomputed in its new context, whether
    the next request reads logits first or appends first."""
    tokens = random_tokens(N, llama_engine.vocab_size, seed=10)
    more = random_tokens(5, llama_engine.vocab_size, seed=11)
    asked, appended = SessionCache(llama_engine), SessionCache(llama_engine)
    for session in (asked, appended):
        session.prefill(tokens)
        session.apply_edits([Edit(10, 30, (4, 5), Mode.amortize)])  # ends in a kept run
    asked.next_token_logits()  # a client that looks at the next token first
    asked.prefill(asked.tokens + tuple(more))
    report = appended.prefill(appended.tokens + tuple(more))
    assert report.prefilled_tokens == len(more) + 1  # the last spliced token, then the rest
    assert rel_err(asked.next_token_logits(), appended.next_token_logits()) <= 1e-6
    for a, b in zip(asked.kv, appended.kv, strict=True):
        assert rel_err(a[0], b[0]) <= 1e-6 and rel_err(a[1], b[1]) <= 1e-6
