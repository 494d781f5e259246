"""Edits inside the session's own KV buffers (``in_place_edit``): forward first, move after.

Every figure is checked against a computation that does not use the in-place path: the
copy path on an identical session, and an independent reference built by hand (the old
prefix, the replacement prefilled from scratch by transformers, the kept keys rotated with
eager ops, the last token run by transformers over that KV)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest
import torch
from transformers import DynamicCache

from leyline.core.turns import SamplingParams
from leyline.engine.cpu import rope_kernel
from leyline.engine.edits import in_place_edit
from leyline.engine.edits.in_place_edit import segment_runs
from leyline.engine.engine import IN_PLACE_SWITCH, Engine
from leyline.engine.forward import prefill_at
from leyline.engine.kv.buffer_views import capacity
from leyline.engine.kv.kv_blocks import KVCache
from leyline.engine.rope import rotate_into_eager
from leyline.engine.session import SessionCache
from leyline.protocol.algebra import Edit, apply_edits
from leyline.protocol.directives import Mode

from ._helpers import kv_bitwise_equal, random_tokens, snapshot, tiny_llama

N = 900  # past the attention kernel's shortest cache (512 keys), so its path runs too


def _logprob_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    pa, pb = torch.log_softmax(a.double(), -1), torch.log_softmax(b.double(), -1)
    return float((pa - pb).abs().max())


def _kv_diff(a: KVCache, b: KVCache) -> float:
    return max(
        float((x.double() - y.double()).abs().max())
        for la, lb in zip(a, b, strict=True)
        for x, y in zip(la, lb, strict=True)
    )


@pytest.fixture
def engine(llama_engine: Engine) -> Iterator[Engine]:
    assert llama_engine.can_edit_in_place  # a GQA model on the engine's attention
    was, llama_engine.edits_in_place = llama_engine.edits_in_place, True
    yield llama_engine
    llama_engine.edits_in_place = was


def _session(engine: Engine, n: int = N, seed: int = 1) -> SessionCache:
    session = SessionCache(engine)
    session.prefill(random_tokens(n, engine.vocab_size, seed=seed))
    assert session.state.owns_kv
    return session


def _both_paths(
    engine: Engine, base: SessionCache, edits: Sequence[Edit], *, want_logits: bool = True
) -> tuple[SessionCache, SessionCache]:
    """The same edits on two private copies of ``base``: in place, then by copy."""
    arms = []
    for in_place in (True, False):
        engine.edits_in_place = in_place
        session = base.fork(copy_kv=True)
        before = session.kv[0][0].data_ptr()
        session.apply_edits(edits, want_logits=want_logits)
        assert (session.kv[0][0].data_ptr() == before) is in_place, "which path ran"
        arms.append(session)
    engine.edits_in_place = True
    return arms[0], arms[1]


def _stub(n: int, seed: int) -> tuple[int, ...]:
    return tuple(random_tokens(n, 512, seed=seed))


EDITS = {
    # without the move kernel: |delta| >= MIN_DIRECT, moved piece by piece inside the buffer
    "splice_long_span": [Edit(600, 700, _stub(16, 5), Mode.amortize)],
    # without the move kernel: |delta| < MIN_DIRECT, moved through the bounce buffer
    "splice_small_delta": [Edit(300, 303, _stub(1, 6), Mode.amortize)],
    "delete_only": [Edit(600, 700, (), Mode.amortize)],
    "two_edits": [
        Edit(100, 150, _stub(3, 7), Mode.amortize),
        Edit(400, 420, _stub(30, 8), Mode.amortize),
    ],
    "near_the_tail": [Edit(N - 50, N - 5, _stub(4, 9), Mode.amortize)],
    "same_length": [Edit(200, 210, _stub(10, 10), Mode.amortize)],
}


@pytest.fixture(params=["kernel", "pieces"])
def move_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The kept runs moved by the rope kernel's sweep (every call taken by it), or, as
    without the kernel, in pieces that never overlap; both must give the copy path's keys
    bitwise."""
    taken: list[bool] = []
    for name in ("move_rotated", "move_rows"):
        real = getattr(in_place_edit, name)
        if request.param == "pieces":
            monkeypatch.setattr(in_place_edit, name, lambda *a, **k: False)
        else:
            monkeypatch.setattr(
                in_place_edit, name, lambda *a, f=real, **k: taken.append(f(*a, **k)) or taken[-1]
            )
    yield str(request.param)
    if request.param == "kernel" and rope_kernel.status().available:
        assert all(taken), "the kernel refused a move"


@pytest.mark.parametrize("name", sorted(EDITS))
@pytest.mark.parametrize("want_logits", [True, False])
def test_in_place_matches_the_copy_path(
    engine: Engine, name: str, want_logits: bool, move_path: str
) -> None:
    base = _session(engine)
    moved, copied = _both_paths(engine, base, EDITS[name], want_logits=want_logits)
    assert moved.tokens == copied.tokens
    assert moved.state.exact_length == copied.state.exact_length
    assert (moved.state.logits is None) == (copied.state.logits is None)
    assert _kv_diff(moved.kv, copied.kv) <= 1e-4
    assert _logprob_diff(moved.next_token_logits(), copied.next_token_logits()) <= 1e-4
    # the kept runs' keys were rotated by the same kernel: bitwise the copy path's
    edit = apply_edits(base.tokens, EDITS[name])
    for run in edit.runs:
        if run.kind == "kept" and run.new_end < len(edit.tokens):
            for a, b in zip(moved.kv, copied.kv, strict=True):
                for x, y in zip(a, b, strict=True):
                    assert torch.equal(
                        x[:, :, run.new_start : run.new_end], y[:, :, run.new_start : run.new_end]
                    )


def _reference(
    engine: Engine, old: KVCache, tokens: Sequence[int], edit: Edit
) -> tuple[KVCache, torch.Tensor]:
    """The KV and next-token logits of a splice built without the engine: the old prefix,
    the replacement prefilled from scratch after it, the downstream keys rotated by eager
    ops, and the last token run again by transformers over that KV."""
    assert engine.layout is not None and engine.rope is not None
    start, end, stub = edit.start, edit.end, edit.replacement
    delta = len(stub) - (end - start)
    fresh = prefill_at(engine.model, [*tokens[:start], *stub], 0)
    layers = []
    for (k_old, v_old), (k_new, v_new) in zip(old, fresh, strict=True):
        down_k = rotate_into_eager(
            torch.empty_like(k_old[:, :, end:]), k_old[:, :, end:], delta,
            engine.rope.inv_freq, engine.layout.pairing, offset=engine.layout.offset,
        )  # fmt: skip
        k = torch.cat([k_new, down_k], dim=2)
        v = torch.cat([v_new, v_old[:, :, end:]], dim=2)
        layers.append((k, v))
    total = len(tokens) + delta
    cache = DynamicCache()
    for i, (k, v) in enumerate(layers):
        cache.update(k[:, :, : total - 1].clone(), v[:, :, : total - 1].clone(), i)
    last = torch.tensor([[tokens[-1]]])
    out = engine.model(
        input_ids=last, position_ids=torch.tensor([[total - 1]]), cache=cache, use_cache=True
    )
    new_kv = tuple(
        (
            torch.cat([k[:, :, : total - 1], layer.keys[:, :, -1:]], 2),
            torch.cat([v[:, :, : total - 1], layer.values[:, :, -1:]], 2),
        )
        for (k, v), layer in zip(layers, cache.layers, strict=True)
    )
    return new_kv, out.logits[0, -1].float()


def test_in_place_splice_agrees_with_an_independent_reference(engine: Engine) -> None:
    session = _session(engine)
    old, tokens = snapshot(session.kv), session.tokens
    edit = Edit(600, 700, _stub(16, 5), Mode.amortize)
    before = session.kv[0][0].data_ptr()
    session.apply_edits([edit], want_logits=True)
    assert session.kv[0][0].data_ptr() == before  # ran in place
    want_kv, want_logits = _reference(engine, old, tokens, edit)
    assert _kv_diff(session.kv, want_kv) <= 1e-4
    assert _logprob_diff(session.next_token_logits(), want_logits) <= 1e-4
    # the prefix before the edit was never touched
    for got, was in zip(session.kv, old, strict=True):
        for x, y in zip(got, was, strict=True):
            assert torch.equal(x[:, :, :600], y[:, :, :600])


def test_a_growing_edit_runs_in_place_when_the_buffer_has_room(engine: Engine) -> None:
    session = _session(engine, n=600)
    old = session.kv
    roomy = []  # the same KV in buffers with 50 positions to spare (a generation's leave)
    for layer in old:
        slots = []
        for t in layer:
            buffer = torch.empty(*t.shape[:2], 650, t.shape[3], dtype=t.dtype)
            buffer[:, :, :600].copy_(t)
            slots.append(buffer[:, :, :600])
        roomy.append(tuple(slots))
    result = apply_edits(session.tokens, [Edit(100, 104, _stub(12, 11), Mode.amortize)])
    moved = engine.splicer.edit_in_place(tuple(roomy), result, want_logits=True)
    assert moved is not None and moved.rerun and moved.logits is not None
    assert moved.kv[0][0].data_ptr() == roomy[0][0].data_ptr()
    assert moved.kv[0][0].shape[2] == 608
    engine.edits_in_place = False
    copied = session.fork(copy_kv=True)
    copied.apply_edits([Edit(100, 104, _stub(12, 11), Mode.amortize)], want_logits=True)
    assert _logprob_diff(moved.logits, copied.next_token_logits()) <= 1e-4
    assert _kv_diff(moved.kv, copied.kv) <= 1e-4


def test_a_growing_edit_without_room_takes_the_copy_path(engine: Engine) -> None:
    session = _session(engine, n=300)
    before = session.kv[0][0].data_ptr()
    session.apply_edits([Edit(100, 104, _stub(20, 12), Mode.amortize)], want_logits=True)
    assert session.kv[0][0].data_ptr() != before
    assert session.state.owns_kv  # the copy's new buffers are its own: the next may move


@pytest.mark.parametrize(
    "edit",
    [Edit(N - 50, N, (5, 6), Mode.amortize), Edit(300, 320, (5,), Mode.forget)],
    ids=["tail_replaced", "forget"],
)
def test_a_batch_keeping_nothing_after_its_change_takes_the_copy_path(
    engine: Engine, edit: Edit
) -> None:
    session = _session(engine)
    before = session.kv[0][0].data_ptr()
    session.apply_edits([edit], want_logits=True)
    assert session.kv[0][0].data_ptr() != before


def test_a_forward_that_fails_leaves_the_session_bitwise_unchanged(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    session = _session(engine)
    tokens, revision, kv = session.tokens, session.revision, snapshot(session.kv)
    calls = {"n": 0}
    real = in_place_edit._move_kept

    def boom(*args: object, **kwargs: object) -> None:
        raise AssertionError("phase 2 must not start")

    layer = engine.model.model.layers[-1]

    def fail(*_: object) -> None:
        calls["n"] += 1
        raise MemoryError("out of memory in the forward")

    hook = layer.register_forward_pre_hook(fail)
    monkeypatch.setattr(in_place_edit, "_move_kept", boom)
    try:
        with pytest.raises(MemoryError):
            session.apply_edits([Edit(600, 700, _stub(16, 5), Mode.amortize)], want_logits=True)
    finally:
        hook.remove()
    assert calls["n"] == 1
    assert session.tokens == tokens and session.revision == revision
    assert kv_bitwise_equal(session.kv, kv)
    monkeypatch.setattr(in_place_edit, "_move_kept", real)
    session.apply_edits([Edit(600, 700, _stub(16, 5), Mode.amortize)], want_logits=True)
    assert len(session.tokens) == N - 84


def test_forks_share_their_kv_and_never_edit_it_in_place(engine: Engine) -> None:
    base = _session(engine)
    fork = base.fork()
    assert not base.state.owns_kv and not fork.state.owns_kv
    base_kv = snapshot(base.kv)
    fork.apply_edits([Edit(600, 700, _stub(16, 5), Mode.amortize)], want_logits=True)
    assert kv_bitwise_equal(base.kv, base_kv)  # the fork copied
    fork_kv = snapshot(fork.kv)
    base.apply_edits([Edit(10, 200, _stub(3, 6), Mode.amortize)], want_logits=True)
    assert kv_bitwise_equal(fork.kv, fork_kv)
    private = base.fork(copy_kv=True)
    assert private.state.owns_kv and base.state.owns_kv


def test_a_generation_begun_before_a_fork_still_commits(engine: Engine) -> None:
    session = _session(engine, n=200)
    pending = session.begin_generation(SamplingParams(max_new_tokens=2, temperature=0.0))
    session.fork()  # marks the state shared; the generation's base is still current
    result = session.generate_pending(pending)
    assert len(result.tokens) >= 1


def test_chunked_forward_matches_one_chunk(engine: Engine) -> None:
    base = _session(engine)
    long = [Edit(300, 320, _stub(100, 13), Mode.amortize)]  # 100 tokens in place of 20
    engine.prefill_chunk, chunk = 7, engine.prefill_chunk
    try:
        small = base.fork(copy_kv=True)
        small.apply_edits(long, want_logits=True)
    finally:
        engine.prefill_chunk = chunk
    whole = base.fork(copy_kv=True)
    whole.apply_edits(long, want_logits=True)
    assert _logprob_diff(small.next_token_logits(), whole.next_token_logits()) <= 1e-4
    assert _kv_diff(small.kv, whole.kv) <= 1e-4


def test_mla_models_take_the_copy_path(mla_engine: Engine) -> None:
    assert not mla_engine.can_edit_in_place
    mla_engine.edits_in_place = True  # asked for, but the engine still copies
    assert (
        mla_engine.splicer.edit_in_place(
            mla_engine.forward((), [5, 6, 7])[0],
            apply_edits([5, 6, 7], [Edit(0, 1, (), Mode.amortize)]),
            want_logits=True,
        )
        is None
    )
    mla_engine.edits_in_place = False
    session = SessionCache(mla_engine)
    session.prefill(random_tokens(200, mla_engine.vocab_size, seed=3))
    before = session.kv[0][0].data_ptr()
    session.apply_edits([Edit(50, 100, (5, 6), Mode.amortize)], want_logits=True)
    assert session.kv[0][0].data_ptr() != before


def test_segment_runs_see_kept_runs_before_them_and_not_the_rerun_entry() -> None:
    result = apply_edits(list(range(100)), [Edit(40, 60, (7, 8, 9), Mode.amortize)])
    positions = [40, 41, 42, 82]  # the stub, then the last token run again
    runs = segment_runs(result.runs, positions, 0, 4)
    stub, last = runs
    assert (stub.first, stub.end, stub.side_seen) == (0, 3, 3)
    assert [(s.start, s.end, s.delta) for s in stub.kept] == [(0, 40, 0)]
    assert (last.first, last.end, last.side_seen) == (3, 4, 4)
    # the downstream at its old positions, less the last token's own old entry
    assert [(s.start, s.end, s.delta) for s in last.kept] == [(0, 40, 0), (60, 99, -17)]


def test_capacity_reads_the_buffer_behind_a_view() -> None:
    buffer = torch.empty(1, 3, 50, 8)
    assert capacity(buffer[:, :, :20]) == 50
    assert capacity(buffer[:, :, 5:20]) is None  # not the start of the buffer
    assert capacity(buffer.transpose(2, 3)) is None
    assert capacity(torch.empty(1, 1, 30, 8)[:, :, :10]) == 30


def test_in_place_is_on_by_default_and_the_switch_turns_it_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(IN_PLACE_SWITCH, raising=False)
    assert Engine(tiny_llama(seed=2)).edits_in_place
    monkeypatch.setenv(IN_PLACE_SWITCH, "0")
    engine = Engine(tiny_llama(seed=2))
    assert engine.can_edit_in_place and not engine.edits_in_place


def test_bf16_in_place_matches_the_copy_path_within_bf16_rounding() -> None:
    loaded = tiny_llama(seed=2)
    loaded.model.to(torch.bfloat16)
    engine = Engine(loaded)
    assert engine.can_edit_in_place
    engine.edits_in_place = True
    base = _session(engine)
    moved, copied = _both_paths(engine, base, EDITS["splice_long_span"])
    assert moved.kv[0][0].dtype == torch.bfloat16
    # bf16 rounds the counter-rotated query and each segment's partial output once more
    assert _logprob_diff(moved.next_token_logits(), copied.next_token_logits()) <= 0.05
    kept = slice(616, N - 85)  # downstream keys: rotated by the same kernel, bitwise
    for a, b in zip(moved.kv, copied.kv, strict=True):
        assert torch.equal(a[0][:, :, kept], b[0][:, :, kept])
        assert torch.equal(a[1][:, :, kept], b[1][:, :, kept])


def test_the_prefill_chunk_set_on_the_engine_is_the_one_its_forwards_run(engine: Engine) -> None:
    chunk = engine.prefill_chunk
    try:
        engine.prefill_chunk = 7
        assert engine.forwards.chunk == 7
        with pytest.raises(ValueError, match="prefill_chunk"):
            engine.prefill_chunk = 0
        assert engine.forwards.chunk == 7
    finally:
        engine.prefill_chunk = chunk
