"""An in-place edit's forward as one loop over the fused layers (``fused_forward``), its
attention from kernel calls prepared once (``segment_attention.PreparedPlan``,
``attention_kernel.PreparedCall``).

The loop must be the model's forward without its Python: every test compares it with the
same edit run through ``model(...)`` (the loop switched off), bitwise, and checks
that the loop really ran in one arm and not in the other."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest
import torch

from leyline.core.turns import SamplingParams
from leyline.engine.batched_decode import Row
from leyline.engine.cpu import attention_kernel
from leyline.engine.cpu.fused_forward import FusedModel, fused_model
from leyline.engine.cpu.run_choice import RunMode
from leyline.engine.cpu.switches import OVERRIDES
from leyline.engine.engine import Engine
from leyline.engine.forward import buffers_holding, filled
from leyline.engine.kv.kv_blocks import KVCache
from leyline.engine.lean_layers import drop_lean_layers, use_lean_layers
from leyline.engine.segment_attention import PreparedPlan
from leyline.engine.session import SessionCache
from leyline.protocol.algebra import Edit
from leyline.protocol.directives import Mode

from ._helpers import (
    fused_dtypes,
    kv_bitwise_equal,
    needs_fused,
    random_tokens,
    snapshot,
    tiny_llama,
)

N = 900  # the replacement's queries see 600+ keys: past the kernel's shortest run


def _stub(n: int, seed: int) -> tuple[int, ...]:
    return tuple(random_tokens(n, 512, seed=seed))


EDITS = {
    "splice": [Edit(600, 700, _stub(16, 5), Mode.amortize)],
    "delete": [Edit(600, 700, (), Mode.amortize)],  # the last token alone: one query
    # the second replacement's queries see the first kept run moved: a counter-rotated query
    "two_splices": [
        Edit(520, 560, _stub(3, 7), Mode.amortize),
        Edit(700, 720, _stub(12, 8), Mode.amortize),
    ],
    "near_the_tail": [Edit(N - 40, N - 3, _stub(5, 9), Mode.amortize)],
}


def _kernel_sending_runs(mode: RunMode) -> Iterator[attention_kernel.AttentionKernel]:
    loaded = attention_kernel.load()
    if loaded is None:
        pytest.fail(f"attention kernel unavailable: {attention_kernel.status().detail}")
    was, loaded.run_choice.mode = loaded.run_choice.mode, mode
    yield loaded
    loaded.run_choice.mode = was


@pytest.fixture
def kernel() -> Iterator[attention_kernel.AttentionKernel]:
    """The attention kernel with every run it takes sent to it (not measured against
    torch's on this CPU), so the prepared kernel calls are the ones under test."""
    yield from _kernel_sending_runs("kernel")


@pytest.fixture(params=["kernel", "torch"])
def runs_to(request: pytest.FixtureRequest) -> Iterator[str]:
    """A replacement's runs sent to the kernel, or to torch's flash kernel segment by
    segment (as on a CPU where torch's measured faster); a lone query goes to the kernel
    either way."""
    for _ in _kernel_sending_runs(request.param):
        yield str(request.param)


@pytest.fixture(params=fused_dtypes(), ids=["fp32", "bf16"])
def engine(
    request: pytest.FixtureRequest, kernel: attention_kernel.AttentionKernel
) -> Iterator[Engine]:
    loaded = tiny_llama(seed=3)
    loaded.model.to(request.param)
    built = Engine(loaded)
    assert built.can_edit_in_place and fused_model(built.model) is not None
    built.edits_in_place = True
    yield built


@pytest.fixture
def loops(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many rows each fused loop ran (a spy on :meth:`FusedModel.logits`)."""
    rows: list[int] = []
    real = FusedModel.logits

    def spy(self: FusedModel, tokens: Sequence[Sequence[int]], *args: object) -> torch.Tensor:
        rows.append(sum(len(t) for t in tokens))
        return real(self, tokens, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(FusedModel, "logits", spy)
    return rows


def _session(engine: Engine) -> SessionCache:
    session = SessionCache(engine)
    session.prefill(random_tokens(N, engine.vocab_size, seed=11))
    return session


def _loop(monkeypatch: pytest.MonkeyPatch, on: bool) -> None:
    """The fused loop on (as by default) or off, until the test ends."""
    monkeypatch.setitem(OVERRIDES, "fused_forward", "auto" if on else "off")


def _edited(
    base: SessionCache, edits: list[Edit], fused: bool, monkeypatch: pytest.MonkeyPatch
) -> SessionCache:
    _loop(monkeypatch, fused)
    session = base.fork(copy_kv=True)
    before = session.kv[0][0].data_ptr()
    session.apply_edits(edits, want_logits=True)
    assert session.kv[0][0].data_ptr() == before, "the edit ran in place"
    return session


@pytest.mark.parametrize("name", sorted(EDITS))
def test_the_fused_loop_is_the_models_forward_bitwise(
    engine: Engine, name: str, runs_to: str, loops: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    base = _session(engine)
    by_model = _edited(base, EDITS[name], False, monkeypatch)
    assert loops == []
    fused = _edited(base, EDITS[name], True, monkeypatch)
    assert len(loops) == 1 and loops[0] >= 1
    assert fused.tokens == by_model.tokens
    assert torch.equal(fused.next_token_logits(), by_model.next_token_logits())
    assert kv_bitwise_equal(fused.kv, by_model.kv)


@needs_fused()
def test_a_real_model_splice_takes_the_loop_bitwise(
    smollm2_engine: Engine,
    kernel: attention_kernel.AttentionKernel,
    loops: list[int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = smollm2_engine
    was, engine.edits_in_place = engine.edits_in_place, True
    try:
        base = SessionCache(engine)
        base.prefill(random_tokens(1100, engine.vocab_size, seed=4))
        edit = [Edit(700, 900, tuple(random_tokens(16, engine.vocab_size, seed=5)), Mode.amortize)]
        by_model = _edited(base, edit, False, monkeypatch)
        fused = _edited(base, edit, True, monkeypatch)
    finally:
        engine.edits_in_place = was
    assert loops == [17]  # the stub and the last token, in one pass
    assert torch.equal(fused.next_token_logits(), by_model.next_token_logits())
    assert kv_bitwise_equal(fused.kv, by_model.kv)


def test_a_failure_inside_the_loop_leaves_the_session_bitwise_unchanged(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    session = _session(engine)
    tokens, revision, kv = session.tokens, session.revision, snapshot(session.kv)
    real = PreparedPlan.attend

    def fail_late(self: PreparedPlan, layer: int, query: torch.Tensor) -> torch.Tensor:
        if layer == len(engine.model.model.layers) - 1:
            raise MemoryError("out of memory in the last layer's attention")
        return real(self, layer, query)

    monkeypatch.setattr(PreparedPlan, "attend", fail_late)
    with pytest.raises(MemoryError):
        session.apply_edits(EDITS["splice"], want_logits=True)
    assert session.tokens == tokens and session.revision == revision
    assert kv_bitwise_equal(session.kv, kv)
    monkeypatch.setattr(PreparedPlan, "attend", real)
    session.apply_edits(EDITS["splice"], want_logits=True)
    assert len(session.tokens) == N - 84


@needs_fused()
def test_models_it_cannot_run_whole_are_refused(
    llama_engine: Engine, mla_engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = llama_engine.model
    assert fused_model(model) is not None
    assert fused_model(mla_engine.model) is None  # not transformers' Llama
    _loop(monkeypatch, False)
    assert fused_model(model) is None
    monkeypatch.delitem(OVERRIDES, "fused_forward")
    for module in (model, model.model, model.model.layers[1]):  # modules the loop skips
        hook = module.register_forward_hook(lambda *_: None)
        try:
            assert fused_model(model) is None  # their hooks would not fire
        finally:
            hook.remove()
    product = model.model.layers[0].mlp.up_proj
    hook = product.register_forward_pre_hook(lambda *_: None)
    try:
        assert fused_model(model) is None  # a hooked product runs as a module (lean path)
    finally:
        hook.remove()
    assert drop_lean_layers(model) == len(model.model.layers)
    try:
        assert fused_model(model) is None
    finally:
        use_lean_layers(model)
    assert fused_model(model) is not None


def test_transformers_capturing_hooks_do_not_turn_the_loop_off(
    engine: Engine, loops: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A forward asked for attention weights (an eval's reference, say) leaves transformers'
    output-capturing hooks on the model's layers for good; they record nothing outside such
    a forward, so the loop still runs, and still equals the model's forward."""
    model = engine.model
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        model(input_ids=torch.tensor([[5, 6, 7]]), output_attentions=True)
    finally:
        model.set_attn_implementation(previous)
    assert model.model.layers[0]._forward_hooks  # installed, and kept
    base = _session(engine)
    by_model = _edited(base, EDITS["splice"], False, monkeypatch)
    fused = _edited(base, EDITS["splice"], True, monkeypatch)
    assert loops == [17]
    assert torch.equal(fused.next_token_logits(), by_model.next_token_logits())
    assert kv_bitwise_equal(fused.kv, by_model.kv)


@needs_fused()
def test_the_loop_refuses_more_rows_than_its_layers_take(llama_engine: Engine) -> None:
    fused = fused_model(llama_engine.model)
    assert fused is not None
    n = fused.max_rows + 1
    with pytest.raises(ValueError, match="fused forward takes"):
        fused.logits([list(range(3, 3 + n))], [list(range(n))], lambda *_: torch.empty(0))
    with pytest.raises(ValueError, match="of one length"):
        fused.logits([[5, 6], [7]], [[0, 1], [0]], lambda *_: torch.empty(0))
    with pytest.raises(ValueError, match="one position per token"):
        fused.logits([[5, 6]], [[0]], lambda *_: torch.empty(0))


def test_a_splice_near_the_start_takes_the_loop_with_its_run_on_torch(
    engine: Engine, loops: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The replacement sees fewer keys than the kernel's shortest run: its run goes to
    torch's flash kernel, inside the loop, and the pass is still the model's, bitwise."""
    edit = [Edit(40, 60, _stub(6, 3), Mode.amortize)]
    base = _session(engine)
    by_model = _edited(base, edit, False, monkeypatch)
    fused = _edited(base, edit, True, monkeypatch)
    assert loops == [7]
    assert torch.equal(fused.next_token_logits(), by_model.next_token_logits())
    assert kv_bitwise_equal(fused.kv, by_model.kv)


def test_a_pass_longer_than_the_chunk_runs_the_models_forward(
    engine: Engine, loops: list[int]
) -> None:
    engine.prefill_chunk = 8  # the model's forward yields between chunks; the loop cannot
    session = _session(engine)
    session.apply_edits(EDITS["splice"], want_logits=True)
    assert loops == []


def _decode(engine: Engine, base: SessionCache, steps: int) -> tuple[list[torch.Tensor], KVCache]:
    """``steps`` greedy decode steps after ``base``'s tokens, on a copy of its KV."""
    buffers = buffers_holding(base.kv, len(base.tokens) + steps)
    length, token, logits = len(base.tokens), base.tokens[-1], []
    for _ in range(steps):
        logits.append(engine.forward_into(buffers, length, [token]))
        length, token = length + 1, int(logits[-1].argmax())
    return logits, filled(buffers, length)


def test_a_decode_step_takes_the_loop_bitwise(
    engine: Engine, loops: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    base = _session(engine)
    _loop(monkeypatch, False)
    by_model = _decode(engine, base, 3)
    assert loops == []
    _loop(monkeypatch, True)
    fused = _decode(engine, base, 3)
    assert loops == [1, 1, 1]
    assert all(torch.equal(a, b) for a, b in zip(fused[0], by_model[0], strict=True))
    assert kv_bitwise_equal(fused[1], by_model[1])


@needs_fused()
def test_a_real_model_generation_is_the_same_with_the_loop(
    smollm2_engine: Engine,
    kernel: attention_kernel.AttentionKernel,
    loops: list[int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    base = SessionCache(smollm2_engine)
    base.prefill(random_tokens(700, smollm2_engine.vocab_size, seed=6))
    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    _loop(monkeypatch, False)
    plain = base.fork(copy_kv=True)
    expected = plain.generate(params)
    assert loops == []
    _loop(monkeypatch, True)
    fused = base.fork(copy_kv=True)
    got = fused.generate(params)
    assert len(loops) == len(got.tokens) - 1 >= 1  # every step after the prefill's logits
    assert got.tokens == expected.tokens
    assert torch.equal(fused.next_token_logits(), plain.next_token_logits())
    assert kv_bitwise_equal(fused.kv, plain.kv)


def _rows(sessions: Sequence[SessionCache], room: int) -> list[Row]:
    return [
        Row(buffers_holding(s.kv, len(s.tokens) + room), len(s.tokens), s.tokens[-1])
        for s in sessions
    ]


def test_a_batched_decode_step_takes_the_loop_bitwise(
    engine: Engine, loops: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert engine.batches_decode
    sessions = []
    for n, seed in ((900, 1), (640, 2), (1203, 3)):  # rows of their own lengths
        session = SessionCache(engine)
        session.prefill(random_tokens(n, engine.vocab_size, seed=seed))
        sessions.append(session)
    results = {}
    for switch in ("0", "1"):
        _loop(monkeypatch, switch == "1")
        rows = _rows(sessions, 2)
        first = engine.forward_rows(rows)
        rows = [
            Row(r.buffers, r.length + 1, int(x.argmax())) for r, x in zip(rows, first, strict=True)
        ]
        results[switch] = (first, engine.forward_rows(rows), rows)
    assert loops == [3, 3]
    by_model, fused = results["0"], results["1"]
    assert torch.equal(fused[0], by_model[0]) and torch.equal(fused[1], by_model[1])
    for a, b in zip(fused[2], by_model[2], strict=True):
        assert kv_bitwise_equal(filled(a.buffers, a.length + 1), filled(b.buffers, b.length + 1))


def test_a_short_cache_or_a_full_buffer_runs_the_models_forward(
    engine: Engine, loops: list[int]
) -> None:
    short = SessionCache(engine)
    short.prefill(random_tokens(20, engine.vocab_size, seed=2))  # below the kernel's shortest
    _decode(engine, short, 1)
    assert loops == []
    base = _session(engine)
    buffers = [[t.clone() for t in layer] for layer in base.kv]  # no room for another position
    with pytest.raises(ValueError, match="buffer holds"):
        engine.forward_into(buffers, len(base.tokens), [5])
    assert loops == []


def _layers(
    seed: int, count: int, n: int, dtype: torch.dtype
) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        k = torch.randn(1, 2, n, 64, generator=g).to(dtype)
        v = torch.randn(1, 2, n, 64, generator=g).to(dtype)
        out.append([(k[:, :, :600], v[:, :, :600]), (k[:, :, 600:], v[:, :, 600:])])
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_prepared_call_is_attend_runs_and_attend_segments_at_each_layer(
    kernel: attention_kernel.AttentionKernel, dtype: torch.dtype
) -> None:
    layers = _layers(0, 3, 640, dtype)
    g = torch.Generator().manual_seed(1)
    m, heads = 5, 6
    seen = [[600] * m, [40 - m + 1 + j for j in range(m)]]
    runs = kernel.prepare(layers, heads, m, 0.125, seen)
    lone = kernel.prepare(layers, heads, 1, 0.125)
    for i, segments in enumerate(layers):
        q = torch.randn(2, heads, m, 64, generator=g).to(dtype)
        expected = kernel.attend_runs(
            [
                (q[s : s + 1], k, v, c)
                for s, ((k, v), c) in enumerate(zip(segments, seen, strict=True))
            ],
            0.125,
        )
        assert torch.equal(runs(i, q.float()), expected[0])
        one = q[:, :, :1]
        expected_one, _ = kernel.attend_segments(
            [(one[s : s + 1], k, v) for s, (k, v) in enumerate(segments)], 0.125
        )
        assert torch.equal(lone(i, one.float().contiguous()), expected_one[0])


def test_prepare_refuses_layers_that_lie_otherwise_and_calls_check_their_queries(
    kernel: attention_kernel.AttentionKernel,
) -> None:
    layers = _layers(0, 2, 640, torch.float32)
    k, v = layers[1][0]
    layers[1][0] = (k.transpose(2, 3).contiguous().transpose(2, 3), v)  # other strides
    with pytest.raises(ValueError, match="lie as the first"):
        kernel.prepare(layers, 4, 1, None)
    call = kernel.prepare(layers[:1], 4, 1, None)
    with pytest.raises(ValueError, match="queries"):
        call(0, torch.zeros(2, 4, 2, 64))  # two queries where the call was prepared for one
    with pytest.raises(ValueError, match="queries"):
        call(0, torch.zeros(2, 4, 1, 64, dtype=torch.float64))
    with pytest.raises(ValueError, match="lse"):
        call(0, torch.zeros(2, 4, 1, 64), torch.zeros(3))  # four heads' log-sum-exps
    with pytest.raises(ValueError, match="see at least one key"):
        kernel.prepare(layers[:1], 4, 2, None, [[0, 0], [0, 1]])
