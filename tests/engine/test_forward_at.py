"""The masked pass (``forward.forward_at``) and the splices that use it, on tiny random
models (GQA Llama, MLA V2 and V3): every figure is checked against a computation that
does not use it (transformers' own prefill, or the sequential run-by-run splice)."""

from __future__ import annotations

import pytest
import torch

from leyline.engine.attention import NAME, grouped_sdpa_forward
from leyline.engine.edits.run_executor import SourcedRun, execute_edit, fill_runs, fused_plan
from leyline.engine.engine import Engine
from leyline.engine.forward import (
    Forwards,
    KVBuffers,
    filled,
    forward_at,
    new_buffers,
    prefill_at,
    query_runs,
)
from leyline.engine.session import SessionCache
from leyline.protocol.algebra import Edit, apply_edits
from leyline.protocol.directives import Mode

from ._helpers import kv_bitwise_equal, random_tokens, snapshot

N = 96


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max())


def _logprob_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return _max_diff(torch.log_softmax(a.double(), -1), torch.log_softmax(b.double(), -1))


@pytest.fixture(params=["gqa", "mla"])
def engine(request: pytest.FixtureRequest, llama_engine: Engine, mla_engine: Engine) -> Engine:
    return llama_engine if request.param == "gqa" else mla_engine


def test_scattered_positions_reproduce_a_full_prefill(engine: Engine) -> None:
    """Every position but a few scattered ones copied from transformers' own prefill; the
    masked pass computes those few (the last included) as the full prefill does."""
    tokens = random_tokens(N, engine.vocab_size, seed=1)
    reference = prefill_at(engine.model, tokens, 0)
    _, ref_logits = engine.forward((), tokens)
    holes = [3, 4, 5, 40, 41, 70, N - 1]
    buffers = new_buffers(reference, N)
    for layer, ref in zip(buffers, reference, strict=True):
        for dst, src in zip(layer, ref, strict=True):
            dst.copy_(src)
            dst[..., holes, :] = float("nan")  # anything read before it is written shows
    logits = engine.forwards.at(buffers, holes, [tokens[p] for p in holes], N)
    assert _logprob_diff(logits, ref_logits) <= 1e-4
    for layer, ref in zip(filled(buffers, N), reference, strict=True):
        for got, want in zip(layer, ref, strict=True):
            assert not got.isnan().any()
            assert _max_diff(got[..., holes, :], want[..., holes, :]) <= 1e-4


def test_query_runs_split_scattered_positions_into_consecutive_runs() -> None:
    # (first query, end query, keys the run sees): the run's last position + 1.
    assert query_runs([3, 4, 5, 40, 41, 70]) == ((0, 3, 6), (3, 5, 42), (5, 6, 71))
    assert query_runs([7]) == ((0, 1, 8),)


def test_chunks_see_what_earlier_chunks_wrote(llama_engine: Engine) -> None:
    tokens = random_tokens(N, llama_engine.vocab_size, seed=2)
    reference = prefill_at(llama_engine.model, tokens, 0)
    buffers = new_buffers(reference, N)
    positions = list(range(20, N))
    for layer, ref in zip(buffers, reference, strict=True):
        for dst, src in zip(layer, ref, strict=True):
            dst[..., :20, :].copy_(src[..., :20, :])
    one = forward_at(llama_engine.model, buffers, positions, tokens[20:], N, chunk=1000)
    again = new_buffers(reference, N)
    for dst_layer, src_layer in zip(again, buffers, strict=True):
        for dst, src in zip(dst_layer, src_layer, strict=True):
            dst[..., :20, :].copy_(src[..., :20, :])
            # Slots of later chunks are not written yet: a chunk that read them would show.
            dst[..., 20:, :] = float("nan")
    chunked = forward_at(llama_engine.model, again, positions, tokens[20:], N, chunk=7)
    assert _logprob_diff(one, chunked) <= 1e-4
    for a, b in zip(filled(buffers, N), filled(again, N), strict=True):
        for x, y in zip(a, b, strict=True):
            assert _max_diff(x, y) <= 1e-4


@pytest.mark.parametrize(
    ("positions", "tokens", "match"),
    [([5, 5], [1, 2], "increase"), ([3, 2], [1, 2], "increase"), ([3], [1, 2], "tokens for"),
     ([N], [1], "below"), ([], [], "tokens for")],
)  # fmt: skip
def test_bad_positions_are_refused(
    llama_engine: Engine, positions: list[int], tokens: list[int], match: str
) -> None:
    kv, _ = llama_engine.forward((), random_tokens(N, llama_engine.vocab_size, seed=0))
    buffers = new_buffers(kv, N)
    with pytest.raises(ValueError, match=match):
        llama_engine.forwards.at(buffers, positions, tokens, N)


def _edits(engine: Engine) -> list[Edit]:
    stub = tuple(random_tokens(9, engine.vocab_size, seed=5))
    return [Edit(60, 64, (), Mode.amortize), Edit(10, 30, stub, Mode.amortize)]


class _NoRefine:
    """A refiner that recomputes nothing: the runs then go through the sequential loop."""

    def recomputed(self, length: int) -> int:
        return 0

    def __call__(self, buffers: KVBuffers, tokens: object, run: object) -> list[int]:
        return []


def test_fused_splice_equals_the_sequential_one(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Replacement, a deletion downstream and the last token again, in one pass or run by
    run: the same KV and next-token logits up to rounding."""
    session = SessionCache(engine)
    tokens = random_tokens(N, engine.vocab_size, seed=3)
    session.prefill(tokens)
    result = apply_edits(tokens, _edits(engine))
    runs = [
        SourcedRun(r, session.kv, _NoRefine()) if r.kind == "kept" else SourcedRun(r)
        for r in result.runs
    ]
    seq_kv, seq_logits, _ = fill_runs(
        engine.forwards, engine.layout, engine.rope, result.tokens, runs,
        template=session.kv, want_logits=True,
    )  # fmt: skip
    calls: list[list[int]] = []
    at = Forwards.at

    def counted(self, buffers, positions, toks, total=None, **kw):  # type: ignore[no-untyped-def]
        calls.append(list(positions))
        return at(self, buffers, positions, toks, total, **kw)

    monkeypatch.setattr(Forwards, "at", counted)
    fused = execute_edit(
        engine.forwards, engine.layout, engine.rope, session.kv, result,
        old_exact_length=N, want_logits=True,
    )  # fmt: skip
    n = len(result.tokens)
    assert calls == [[*range(10, 19), n - 1]]  # the stub and the last token, one pass
    assert fused.logits is not None and seq_logits is not None
    assert _logprob_diff(fused.logits, seq_logits) <= 1e-4
    for a, b in zip(fused.kv, seq_kv, strict=True):
        for x, y in zip(a, b, strict=True):
            assert _max_diff(x, y) <= 1e-4


def test_sessions_splice_in_one_pass_and_a_failure_changes_nothing(
    llama_engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    session = SessionCache(llama_engine)
    session.prefill(random_tokens(N, llama_engine.vocab_size, seed=4))
    before, state = snapshot(session.kv), session.state

    def broken(*args: object) -> None:
        raise RuntimeError("out of memory, say")

    monkeypatch.setattr(Forwards, "at", broken)
    monkeypatch.setattr(llama_engine, "edits_in_place", False)  # the copy path's pass
    with pytest.raises(RuntimeError, match="out of memory"):
        session.apply_edits(_edits(llama_engine), want_logits=True)
    assert session.state is state and kv_bitwise_equal(session.kv, before)


def test_fused_plan_keeps_single_passes_and_refiners_sequential(llama_engine: Engine) -> None:
    tokens = random_tokens(N, llama_engine.vocab_size, seed=6)
    result = apply_edits(tokens, _edits(llama_engine))
    runs = [SourcedRun(r) for r in result.runs]
    n = len(result.tokens)
    assert fused_plan(runs, n, want_logits=True) == ([*range(10, 19), n - 1], True)
    assert fused_plan(runs, n, want_logits=False) is None  # the stub alone: one pass already
    appended = apply_edits(tokens, [Edit(N, N, (1, 2, 3), Mode.amortize)])
    assert fused_plan([SourcedRun(r) for r in appended.runs], N + 3, want_logits=True) is None

    class Refine:
        def recomputed(self, length: int) -> int:
            return 1

        def __call__(self, buffers: object, tokens: object, run: object) -> list[int]:
            return []

    refined = [SourcedRun(r, refine=Refine() if r.kind == "kept" else None) for r in result.runs]
    assert fused_plan(refined, n, want_logits=True) is None


def test_grouped_attention_matches_transformers_sdpa(llama_engine: Engine) -> None:
    """The engine's attention (grouped heads read in place) against transformers' own
    ``sdpa`` on a chunked prefill, where a mask is passed with many queries."""
    model = llama_engine.model
    assert model.config._attn_implementation == NAME
    tokens = random_tokens(N, llama_engine.vocab_size, seed=7)
    ours = prefill_at(model, tokens[:50], 0)
    kv_ours, logits_ours = llama_engine.forward(ours, tokens[50:])
    model.config._attn_implementation = "sdpa"
    try:
        theirs = prefill_at(model, tokens[:50], 0)
        kv_theirs, logits_theirs = llama_engine.forward(theirs, tokens[50:])
    finally:
        model.config._attn_implementation = NAME
    assert _logprob_diff(logits_ours, logits_theirs) <= 1e-5
    for a, b in zip(kv_ours, kv_theirs, strict=True):
        for x, y in zip(a, b, strict=True):
            assert _max_diff(x, y) <= 1e-5


def test_grouped_attention_refuses_what_it_cannot_do() -> None:
    q = torch.zeros(1, 2, 3, 4)
    with pytest.raises(ValueError, match="softcap"):
        grouped_sdpa_forward(torch.nn.Module(), q, q, q, None, softcap=1.0)
