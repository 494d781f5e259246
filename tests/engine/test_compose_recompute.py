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
from typing import Any

import pytest
import torch
from transformers import DynamicCache, PreTrainedModel

from leyline.core.batch import plan_batch
from leyline.engine.edits.recompute import SELECTION_LAYER as ENGINE_DEFAULT
from leyline.engine.edits.recompute import DeviationRecompute, selection_layer
from leyline.engine.edits.skills import compile_skill
from leyline.engine.engine import Engine
from leyline.engine.forward import prefill_at
from leyline.engine.kv.kv_blocks import KVCache
from leyline.engine.session import SessionCache
from leyline.protocol import ComposeDirective, SpliceDirective, TokenSpan
from leyline.protocol.algebra import Edit
from leyline.protocol.directives import (
    RecomputeAttention,
    RecomputeDeviation,
    RecomputeMode,
    Verb,
)
from leyline.protocol.envelope import Path
from leyline.protocol.errors import ErrorCode, LeylineError

from ._helpers import random_tokens, rel_err, snapshot
from .test_compose import (
    TOL,
    ComposeParts,
    _drop_last,
    _session,
    _skill,
    _texts,
    _unchanged,
    compose_parts,
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
    parts: ComposeParts, ratio: float, *, lowest: bool = False, layer: int = SELECTION_LAYER
) -> tuple[KVCache, list[int]]:
    """The definition's KV of ``tokens[:at] + skill + tokens[at:]`` and the recomputed
    positions; ``lowest``: the control that recomputes the least deviating tokens."""
    at = parts.at
    a, b = at + parts.seam, at + len(parts.skill)
    layers = parts.model.config.num_hidden_layers
    s = max(min(layer, layers - 2), 1)  # below the last layer, above layer 0
    # In context, every layer:
    inside = prefill_at(parts.model, [*parts.tokens[:at], *parts.skill], 0)
    deviation = sum(
        _per_token(inside[s][c][..., a:b, :] - parts.copied(s, c))
        / _per_token(parts.copied(s, c)).mean()
        for c in range(2)
    )
    assert isinstance(deviation, torch.Tensor)
    # The cache before the recompute: exact up to a; the block in context at layers <= s.
    cache = [
        [
            torch.cat([inside[i][c][..., :a, :], (inside[i][c][..., a:b, :] if i <= s
                       else parts.copied(i, c))], dim=-2).clone()
            for c in range(2)
        ]
        for i in range(layers)
    ]  # fmt: skip
    return recompute_ranked(parts, cache, deviation, ratio, lowest=lowest)


@torch.no_grad()
def recompute_ranked(
    parts: ComposeParts,
    cache: list[list[torch.Tensor]],
    scores: torch.Tensor,
    ratio: float,
    *,
    lowest: bool = False,
) -> tuple[KVCache, list[int]]:
    """Recompute in ``cache`` (up to the block's end) the ``ratio`` of the block's copied
    tokens that ``scores`` ranks highest (ties: the earlier first; ``lowest``: those it ranks
    lowest), then add the downstream: the definition's KV and the positions recomputed."""
    a, b = parts.at + parts.seam, parts.at + len(parts.skill)
    order = sorted(range(b - a), key=lambda j: (float(scores[j]), -j), reverse=not lowest)
    chosen = sorted(a + j for j in order[: _count(ratio, b - a)])
    sequence = [*parts.tokens[: parts.at], *parts.skill]
    recompute_in_order(parts.model, cache, sequence, chosen)
    return parts.with_downstream(cache), chosen


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
    parts = compose_parts(name, model, tokens, skill, at, seam)
    ref, chosen = reference(parts, ratio, layer=layer)
    assert 1 < len(chosen) < len(skill) - seam
    wrong, _ = reference(parts, ratio, lowest=True, layer=layer)
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


def check_beside_a_splice(
    engine: Engine,
    recompute: RecomputeDeviation | RecomputeAttention,
    in_turn: dict[str, Any],
    question: Sequence[int] | None = None,
) -> None:
    """A compose with ``recompute`` batched after a splice equals the splice, then a compose
    called with the arguments ``in_turn`` (its recompute as the caller words it).
    ``question``: what the turn asks after the batch's tokens (``final_tokens``), for both."""
    batched, sequential, skill = _session(engine), _session(engine), _skill(engine, length=20)
    replacement = random_tokens(5, engine.vocab_size, 5)
    directives = [
        SpliceDirective(span=TokenSpan(start=4, end=12), replacement=replacement),
        ComposeDirective(skill="s", at=30, seam_tokens=2, recompute=recompute),
    ]
    plan = plan_batch(
        batched.view, directives, tokenize=engine.encode, limits=engine.limits,
        vocab_size=engine.vocab_size, supported=list(Verb), skill_tokens=lambda _: skill.tokens,
        recompute_modes=set(RecomputeMode),
    )  # fmt: skip
    final = None if question is None else [*plan.result.tokens, *question]
    report = batched.execute(plan, skills={1: skill}, final_tokens=final)
    assert report.prefilled_tokens == len(replacement) + 2 + _count(recompute.ratio, 18)
    sequential.apply_edits([Edit(4, 12, tuple(replacement))])
    at = 30 - 8 + len(replacement)
    sequential.compose(skill, at, seam_tokens=2, final_tokens=final, **in_turn)
    assert batched.tokens == sequential.tokens
    assert top_logprob_gap(sequential.next_token_logits(), batched.next_token_logits()) <= TOL


def test_a_deviation_compose_beside_a_splice_equals_the_two_in_turn(mla: Engine) -> None:
    deviation = RecomputeDeviation(mode="deviation", ratio=0.4)
    check_beside_a_splice(mla, deviation, {"recompute_ratio": 0.4})


def test_a_failed_deviation_compose_leaves_the_session_as_it_was(
    mla: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    session, skill = _session(mla), _skill(mla)
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
