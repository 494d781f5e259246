"""COMPOSE with selective recompute (``deviation``) against an independent computation.

The reference never calls the engine's compose, recompute or partial forwards: the
in-context KV of every layer comes from one transformers forward of prefix + skill (a
prefill's early layers are exactly the definition's in-context KV), the skill's KV from a
fresh forward at 0 with keys rotated by the cos/sin formula of ``test_compose``, the
deviation and the selection are written out here, and the selected tokens are recomputed
one at a time in position order, each a one-token forward on a transformers
``DynamicCache`` holding the cache as the definition says it is at that point (causal, so
this equals recomputing them all at once).

SmolLM2 (GQA) needs the real weights (``slow``, ``model``); the tiny random MLA models run
everywhere.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch
from transformers import DynamicCache, PreTrainedModel

from leyline.engine.edits.recompute import SELECTION_LAYER as ENGINE_DEFAULT
from leyline.engine.edits.recompute import DeviationRecompute, selection_layer
from leyline.engine.edits.skills import compile_skill
from leyline.engine.engine import Engine
from leyline.engine.forward import prefill_at
from leyline.engine.kv.kv_blocks import KVCache
from leyline.engine.models import build_tiny_mla
from leyline.engine.session import SessionCache
from leyline.protocol.algebra import Edit
from leyline.protocol.directives import Verb
from leyline.protocol.envelope import Path
from leyline.protocol.errors import ErrorCode, LeylineError

from ._helpers import random_tokens, rel_err, snapshot
from .test_compose import (
    ROPE_BAND,
    TOL,
    _drop_last,
    _rotate,
    _texts,
    _theta,
    _unchanged,
    logits_after,
    top_logprob_gap,
)

SELECTION_LAYER = 4  # the definition's default: the fifth decoder layer (capped)


# -- the independent reference -------------------------------------------------------------


def _count(ratio: float, m: int) -> int:
    return min(m, math.ceil(ratio * m - 1e-9))


def _per_token(t: torch.Tensor) -> torch.Tensor:
    """Squared norm of each position of ``[..., T, dim]``, fp64 ``[T]``."""
    return t.double().pow(2).sum(-1).sum(tuple(range(t.dim() - 2)))


@torch.no_grad()
def reference(
    name: str,
    model: PreTrainedModel,
    tokens: Sequence[int],
    skill: Sequence[int],
    at: int,
    seam: int,
    ratio: float,
    *,
    lowest: bool = False,
    layer: int = SELECTION_LAYER,
) -> tuple[KVCache, list[int]]:
    """The definition's KV of ``tokens[:at] + skill + tokens[at:]`` and the recomputed
    positions; ``lowest``: the control that recomputes the least deviating tokens."""
    slot, pairing = ROPE_BAND[name]
    theta, k, n = _theta(model), min(seam, len(skill)), len(skill)
    a, b = at + k, at + n
    layers = model.config.num_hidden_layers
    s = max(min(layer, layers - 2), 1)  # below the last layer, above layer 0
    inside = prefill_at(model, list(tokens[:at]) + list(skill), 0)  # in context, every layer
    alone = prefill_at(model, list(skill), 0)
    old = prefill_at(model, list(tokens), 0)

    def copied(layer: int, c: int) -> torch.Tensor:
        y = alone[layer][c][..., k:, :]
        return _rotate(y, at, theta, pairing) if c == slot else y

    deviation = sum(
        _per_token(inside[s][c][..., a:b, :] - copied(s, c)) / _per_token(copied(s, c)).mean()
        for c in range(2)
    )
    assert isinstance(deviation, torch.Tensor)
    order = sorted(range(b - a), key=lambda j: (float(deviation[j]), -j), reverse=not lowest)
    chosen = sorted(a + j for j in order[: _count(ratio, b - a)])
    # The cache before the recompute: exact up to a; the block in context at layers <= s.
    cache = [
        [
            torch.cat([inside[i][c][..., :a, :], (inside[i][c][..., a:b, :] if i <= s
                       else copied(i, c))], dim=-2).clone()
            for c in range(2)
        ]
        for i in range(layers)
    ]  # fmt: skip
    recompute_in_order(model, cache, list(tokens[:at]) + list(skill), chosen)
    return with_downstream(name, model, cache, old, at, n), chosen


@torch.no_grad()
def recompute_in_order(
    model: PreTrainedModel,
    cache: list[list[torch.Tensor]],
    sequence: Sequence[int],
    chosen: Sequence[int],
) -> None:
    """Recompute ``chosen`` positions of ``cache`` (per layer: keys, values) in place, one
    token at a time in position order: each sees positions before it as they now are
    (causal, so this equals recomputing them all at once)."""
    for p in chosen:
        dc = DynamicCache()
        for i, (keys, values) in enumerate(cache):
            dc.update(keys[..., :p, :].clone(), values[..., :p, :].clone(), i)
        ids = torch.tensor([[sequence[p]]])
        model(input_ids=ids, position_ids=torch.tensor([[p]]), cache=dc, use_cache=True)
        for i, layer in enumerate(dc.layers):
            assert layer.keys is not None and layer.values is not None
            cache[i][0][..., p, :] = layer.keys[..., p, :]
            cache[i][1][..., p, :] = layer.values[..., p, :]


def with_downstream(
    name: str,
    model: PreTrainedModel,
    cache: list[list[torch.Tensor]],
    old: KVCache,
    at: int,
    n: int,
) -> KVCache:
    """``cache`` (the sequence up to the block's end) followed by the session's KV from
    ``at`` on (``old``), its keys rotated by the block's length ``n`` (AMORTIZE)."""
    slot, pairing = ROPE_BAND[name]
    theta = _theta(model)
    out = []
    for i, slots in enumerate(cache):
        parts = []
        for c in range(2):
            down = old[i][c][..., at:, :]
            if c == slot:
                down = _rotate(down, n, theta, pairing)
            parts.append(torch.cat([slots[c], down], dim=-2))
        out.append(tuple(parts))
    return tuple(out)


def check_against(
    session: SessionCache,
    model: PreTrainedModel,
    ref: KVCache,
    lowest: KVCache,
    suffix: Sequence[int],
) -> None:
    """The composed ``session`` against the reference KV ``ref``: KV within 1e-5, next-token
    logits and those after ``suffix`` within ``TOL``; the ``lowest`` control (the least
    chosen tokens recomputed instead) far from it, so the selection matters."""
    for got, want in zip(session.kv, ref, strict=True):
        for s in range(2):
            assert rel_err(got[s], want[s]) <= 1e-5
    last = [session.tokens[-1]]
    figures = {"next": top_logprob_gap(logits_after(model, _drop_last(ref), last),
                                       session.next_token_logits())}  # fmt: skip
    figures["lowest"] = top_logprob_gap(
        logits_after(model, _drop_last(lowest), last), session.next_token_logits()
    )
    session.extend(suffix)
    figures["suffix"] = top_logprob_gap(
        logits_after(model, _drop_last(ref), last + suffix), session.next_token_logits()
    )
    assert figures["next"] <= TOL and figures["suffix"] <= TOL, figures
    assert figures["lowest"] > 100 * TOL, figures


def _composed(
    engine: Engine, where: str, seam: int, ratio: float, name: str
) -> tuple[SessionCache, list[int], list[int], list[int], int]:
    tokens, skill_tokens, suffix = _texts(name, engine)
    at = len(tokens) // 2 if where == "middle" else len(tokens)
    skill = compile_skill(engine, skill_tokens, skill_id="tool-spec", tenant="t")
    session = SessionCache(engine)
    session.prefill(tokens)
    report = session.compose(skill, at, seam_tokens=seam, recompute_ratio=ratio)
    count = _count(ratio, len(skill_tokens) - seam)
    assert report.path is Path.splice
    assert report.prefilled_tokens == seam + count
    assert report.reused_tokens == len(tokens) + len(skill_tokens) - seam - count
    return session, tokens, skill_tokens, suffix, at


# -- (a) the engine equals the definition; controls far off ---------------------------------


@pytest.mark.parametrize(
    ("where", "seam", "layer"),
    [("middle", 0, SELECTION_LAYER), ("middle", 4, SELECTION_LAYER), ("end", 0, SELECTION_LAYER),
     ("end", 4, SELECTION_LAYER), ("middle", 4, 1)],
)  # fmt: skip
def test_deviation_compose_equals_the_definition(
    case: tuple[str, Engine], where: str, seam: int, layer: int
) -> None:
    name, engine = case
    ratio = 0.3
    default, engine.recompute_selection_layer = engine.recompute_selection_layer, layer
    try:
        session, tokens, skill, suffix, at = _composed(engine, where, seam, ratio, name)
    finally:
        engine.recompute_selection_layer = default
    model = engine.model
    ref, chosen = reference(name, model, tokens, skill, at, seam, ratio, layer=layer)
    assert 1 < len(chosen) < len(skill) - seam
    wrong, _ = reference(name, model, tokens, skill, at, seam, ratio, lowest=True, layer=layer)
    # Recomputing the least deviating tokens instead is far from it: the selection matters.
    check_against(session, model, ref, wrong, suffix)


def test_ratio_one_equals_a_full_prefill(case: tuple[str, Engine]) -> None:
    name, engine = case
    session, tokens, skill, suffix, at = _composed(engine, "end", 4, 1.0, name)
    assert session.state.exact_length == len(tokens) + len(skill)  # the block is exact now
    session.extend(suffix)
    ids = torch.tensor([list(tokens) + list(skill) + list(suffix)])
    with torch.no_grad():
        fresh = engine.model(input_ids=ids).logits[0, -1].float()
    assert top_logprob_gap(fresh, session.next_token_logits()) <= TOL
    plain = SessionCache(engine)  # and the seam alone is not (the test can fail)
    plain.prefill(tokens)
    plain.compose(compile_skill(engine, skill, skill_id="s", tenant="t"), at, seam_tokens=4)
    plain.extend(suffix)
    assert top_logprob_gap(fresh, plain.next_token_logits()) > 100 * TOL


# -- (b) the batch path, and failures change nothing ---------------------------------------


@pytest.fixture(scope="module")
def mla() -> Engine:
    return Engine(build_tiny_mla("v2"))


def test_a_deviation_compose_beside_a_splice_equals_the_two_in_turn(mla: Engine) -> None:
    from leyline.core.batch import plan_batch
    from leyline.protocol import ComposeDirective, SpliceDirective, TokenSpan
    from leyline.protocol.directives import RecomputeDeviation, RecomputeMode

    tokens = random_tokens(40, mla.vocab_size, 11)
    skill = compile_skill(mla, random_tokens(20, mla.vocab_size, 12), skill_id="s", tenant="t")
    batched, sequential = SessionCache(mla), SessionCache(mla)
    for session in (batched, sequential):
        session.prefill(tokens)
    replacement = random_tokens(5, mla.vocab_size, 5)
    directives = [
        SpliceDirective(span=TokenSpan(start=4, end=12), replacement=replacement),
        ComposeDirective(skill="s", at=30, seam_tokens=2,
                         recompute=RecomputeDeviation(mode="deviation", ratio=0.4)),
    ]  # fmt: skip
    plan = plan_batch(
        batched.view, directives, tokenize=mla.encode, limits=mla.limits,
        vocab_size=mla.vocab_size, supported=list(Verb), skill_tokens=lambda _: skill.tokens,
        recompute_modes=set(RecomputeMode),
    )  # fmt: skip
    report = batched.execute(plan, skills={1: skill})
    count = _count(0.4, 18)
    assert report.prefilled_tokens == len(replacement) + 2 + count
    sequential.apply_edits([Edit(4, 12, tuple(replacement))])
    sequential.compose(skill, 30 - 8 + len(replacement), seam_tokens=2, recompute_ratio=0.4)
    assert batched.tokens == sequential.tokens
    assert top_logprob_gap(sequential.next_token_logits(), batched.next_token_logits()) <= TOL


def test_a_failed_deviation_compose_leaves_the_session_as_it_was(
    mla: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    session = SessionCache(mla)
    session.prefill(random_tokens(40, mla.vocab_size, 11))
    skill = compile_skill(mla, random_tokens(16, mla.vocab_size, 12), skill_id="s", tenant="t")
    before = (session.tokens, session.revision, snapshot(session.kv))
    for ratio in (0.0, 1.5, float("nan")):
        with pytest.raises(LeylineError) as err:
            session.compose(skill, 10, recompute_ratio=ratio)
        assert err.value.code is ErrorCode.invalid_directive
        _unchanged(session, *before)

    def boom(*args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError("out of memory mid-recompute")

    monkeypatch.setattr("leyline.engine.edits.recompute.forward_at", boom)
    with pytest.raises(RuntimeError):
        session.compose(skill, 10, seam_tokens=2, recompute_ratio=0.5)
    _unchanged(session, *before)


def test_the_selection_layer_is_capped_and_never_layer_zero(mla: Engine) -> None:
    assert ENGINE_DEFAULT == SELECTION_LAYER  # the test's definition is the engine's default
    assert [selection_layer(n) for n in (1, 2, 3, 5, 30)] == [0, 1, 1, 3, 4]
    assert selection_layer(30, 1) == 1 and selection_layer(30, 40) == 28
    with pytest.raises(ValueError, match="at least 1"):
        DeviationRecompute(mla.model, 0.15, layer=0)
