"""The lean decoder-layer forward (``lean_layers``) against transformers' own, bitwise: on
every kind of forward the engine runs (chunked prefill, decode steps, a masked splice pass,
an in-place edit's segment reads, batched decode), in fp32 and bf16."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch
from transformers import DynamicCache

from leyline.core.turns import SamplingParams
from leyline.engine.batched_decode import Row
from leyline.engine.cpu.switches import OVERRIDES
from leyline.engine.engine import Engine
from leyline.engine.forward import buffers_holding
from leyline.engine.lean_layers import (
    FUSED,
    drop_lean_layers,
    lean_forward,
    lean_refusal,
    transformers_layers,
    use_lean_layers,
)
from leyline.engine.models import LoadedModel, build_tiny_mla
from leyline.engine.session import SessionCache
from leyline.protocol.algebra import Edit
from leyline.protocol.directives import Mode

from ._helpers import random_tokens, tiny_llama, tiny_phi

Run = Callable[[Engine], list[torch.Tensor]]


def _bound(engine: Engine) -> bool:
    return all(
        getattr(layer.forward, "__func__", None) is lean_forward
        for layer in engine.model.model.layers
    )


@contextmanager
def _unfused(engine: Engine) -> Iterator[None]:
    """The lean forward alone: few-row forwards off the fused layer kernel
    (``layer_kernel``, tested against transformers within rounding in its own tests)."""
    layers = engine.model.model.layers
    saved = [layer.__dict__.pop(FUSED, None) for layer in layers]
    try:
        yield
    finally:
        for layer, fused in zip(layers, saved, strict=True):
            if fused is not None:
                layer.__dict__[FUSED] = fused


def _both(engine: Engine, run: Run) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``run`` with transformers' layer forward, then with the lean one."""
    assert _bound(engine)
    try:
        drop_lean_layers(engine.model)
        assert not _bound(engine)
        plain = run(engine)
    finally:
        assert use_lean_layers(engine.model) == len(engine.model.model.layers)
    with _unfused(engine):
        return plain, run(engine)


def _kv_tensors(session: SessionCache) -> list[torch.Tensor]:
    return [t.clone() for layer in session.kv for t in layer]


def _engine_ops(engine: Engine) -> list[torch.Tensor]:
    """A prefill in chunks, a splice with logits (in place), a replacement by copy, a FORGET,
    a generation's decode steps: every logits vector and the final KV."""
    tokens = random_tokens(300, engine.vocab_size, seed=3)
    out: list[torch.Tensor] = []
    session = SessionCache(engine)
    session.prefill(tokens)
    out.append(session.next_token_logits())
    session.apply_edits([Edit(60, 140, (7, 8, 9, 10), Mode.amortize)], want_logits=True)
    out.append(session.next_token_logits())
    fork = session.fork(copy_kv=False)
    fork.apply_edits([Edit(20, 30, (), Mode.amortize)], want_logits=True)
    out.append(fork.next_token_logits())
    session.apply_edits([Edit(200, 210, (11, 12), Mode.forget)])
    out.append(session.next_token_logits())
    session.generate(SamplingParams(max_new_tokens=4))
    out.append(session.next_token_logits())
    return out + _kv_tensors(session) + _kv_tensors(fork) + _batched_step(engine)


def _batched_step(engine: Engine) -> list[torch.Tensor]:
    """One batched decode step of two rows of different lengths: logits and new entries."""
    rows = []
    for n, seed in ((37, 4), (90, 5)):
        seq = random_tokens(n + 1, engine.vocab_size, seed=seed)
        kv, _ = engine.forward((), seq[:n])
        rows.append(Row(buffers_holding(kv, n + 1), n, seq[n]))
    logits = engine.forward_rows(rows)
    entries = [t[..., r.length, :].clone() for r in rows for layer in r.buffers for t in layer]
    return [logits, *entries]


def _identical(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tiny_llama_runs_bitwise_as_transformers_runs_it(dtype: torch.dtype) -> None:
    loaded = tiny_llama()
    loaded.model.to(dtype)
    engine = Engine(loaded)
    assert engine.lean_layers == 2
    plain, lean = _both(engine, _engine_ops)
    assert _identical(plain, lean)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_smollm2_runs_bitwise_as_transformers_runs_it(dtype: torch.dtype) -> None:
    """The real model on its packed linear layers and the engine's attention paths."""
    engine = Engine.load("smollm2", dtype=dtype)
    assert engine.lean_layers == 30 and engine.can_edit_in_place
    plain, lean = _both(engine, _engine_ops)
    assert _identical(plain, lean)


def test_a_plain_transformers_forward_with_its_own_cache_is_unchanged() -> None:
    """transformers' ``DynamicCache`` and default mask: the independent reference path."""
    engine = Engine(tiny_llama(seed=5))
    ids = torch.tensor([random_tokens(40, engine.vocab_size, seed=1)])

    def run(e: Engine) -> list[torch.Tensor]:
        cache = DynamicCache()
        first = e.model(input_ids=ids[:, :30], cache=cache, use_cache=True).logits
        second = e.model(input_ids=ids[:, 30:], cache=cache, use_cache=True).logits
        kv = [t for layer in cache.layers for t in (layer.keys, layer.values)]  # type: ignore[union-attr]
        return [first, second, *kv]

    plain, lean = _both(engine, run)
    assert _identical(plain, lean)


def test_attention_weights_are_still_recorded() -> None:
    """``output_attentions`` (tests' eager reference) runs transformers' forward: weights."""
    engine = Engine(tiny_llama())
    engine.model.set_attn_implementation("eager")
    ids = torch.tensor([random_tokens(12, engine.vocab_size, seed=4)])
    out = engine.model(input_ids=ids, output_attentions=True)
    assert len(out.attentions) == 2 and out.attentions[0].shape == (1, 4, 12, 12)


def test_a_reference_can_run_transformers_forward_for_a_block() -> None:
    """``transformers_layers``: the attention modules' own calls (hooks fire), lean after."""
    engine = Engine(tiny_llama())
    calls: list[int] = []
    hooks = [
        layer.self_attn.register_forward_hook(lambda *_a: calls.append(1))
        for layer in engine.model.model.layers
    ]
    ids = torch.tensor([random_tokens(8, engine.vocab_size, seed=6)])
    try:
        engine.model(input_ids=ids)
        assert calls == [] and _bound(engine)  # lean: the attention module is not called
        with transformers_layers(engine.model):
            assert not _bound(engine)
            engine.model(input_ids=ids)
    finally:
        for h in hooks:
            h.remove()
    assert calls == [1, 1] and _bound(engine)


def test_linear_layers_still_run_as_modules() -> None:
    """Forward hooks on the projections fire (tests capture pre-rope keys this way)."""
    engine = Engine(tiny_llama())
    seen: list[int] = []
    hooks = [
        layer.self_attn.k_proj.register_forward_hook(lambda *_a, i=i: seen.append(i))
        for i, layer in enumerate(engine.model.model.layers)
    ]
    try:
        SessionCache(engine).prefill(random_tokens(20, engine.vocab_size, seed=0))
    finally:
        for h in hooks:
            h.remove()
    assert seen == [0, 1]


@pytest.mark.parametrize("build", [lambda: build_tiny_mla("v2"), tiny_phi])
def test_other_architectures_keep_their_forward(build: Callable[[], LoadedModel]) -> None:
    engine = Engine(build())
    assert engine.lean_layers == 0
    assert lean_refusal(engine.model) == "not transformers' Llama decoder layers"
    assert not any("forward" in vars(m) for m in engine.model.modules())


def test_the_switch_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(OVERRIDES, "lean_layers", "off")
    engine = Engine(tiny_llama())
    assert (
        engine.lean_layers == 0
        and lean_refusal(engine.model) == "lean_layers switched off in process"
    )
    assert not _bound(engine)
    monkeypatch.delitem(OVERRIDES, "lean_layers")
    assert use_lean_layers(engine.model) == 2 and _bound(engine)


def test_a_layer_without_position_embeddings_is_refused() -> None:
    engine = Engine(tiny_llama())
    layer = engine.model.model.layers[0]
    with pytest.raises(ValueError, match="position embeddings"):
        layer(torch.zeros(1, 1, 128))
