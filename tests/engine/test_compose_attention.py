"""COMPOSE with ``{"mode": "attention"}`` recompute against an independent computation.

The reference never calls the engine's compose, recompute, partial forwards or attention:
the cache before the recompute is written out from transformers forwards (prefix + seam
prefilled fresh, the skill alone at 0 with its keys rotated by the cos/sin formula of
``test_compose``), the scores come from transformers' own *eager* attention with
``output_attentions`` (the following tokens run on a ``DynamicCache`` of that cache), and
the selected tokens are recomputed one at a time in position order (as in
``test_compose_recompute``). SmolLM2 (GQA) needs the real weights (``slow``, ``model``);
the tiny random MLA models run everywhere.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache, PreTrainedModel

from leyline.engine.attention_mass import AttentionMass
from leyline.engine.edits.attention_recompute import ATTENTION_WINDOW, following_tokens
from leyline.engine.edits.compose import supports_attention_recompute
from leyline.engine.edits.skills import compile_skill
from leyline.engine.engine import Engine
from leyline.engine.kv.kv_blocks import KVCache
from leyline.engine.session import SessionCache
from leyline.protocol.directives import RecomputeAttention
from leyline.protocol.envelope import Path
from leyline.protocol.errors import ErrorCode, LeylineError

from ._helpers import kv_bitwise_equal, random_tokens, snapshot, tiny_llama
from .test_compose import (
    TOL,
    ComposeParts,
    _session,
    _skill,
    _texts,
    _unchanged,
    compose_parts,
    top_logprob_gap,
)
from .test_compose_recompute import _count, check_against, check_beside_a_splice, recompute_ranked


def attention(ratio: float) -> RecomputeAttention:
    return RecomputeAttention(mode="attention", ratio=ratio)


# -- the independent reference -------------------------------------------------------------


@torch.no_grad()
def eager_scores(
    model: PreTrainedModel, cache: list[list[torch.Tensor]], queries: Sequence[int], a: int, b: int
) -> torch.Tensor:
    """Attention weight ``queries`` (at positions ``b, ...`` over ``cache[..., :b]``) give
    positions ``[a, b)``, summed over layers, heads and queries: transformers' eager path."""
    dc = DynamicCache()
    for i, (keys, values) in enumerate(cache):
        dc.update(keys[..., :b, :].clone(), values[..., :b, :].clone(), i)
    ids = torch.tensor([list(queries)])
    pos = torch.arange(b, b + len(queries)).unsqueeze(0)
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")  # the one implementation that returns weights
    try:
        out = model(
            input_ids=ids, position_ids=pos, cache=dc, use_cache=True, output_attentions=True
        )
    finally:
        model.set_attn_implementation(previous)
    return sum(w[0, :, :, a:b].double().sum((0, 1)) for w in out.attentions)  # type: ignore[return-value]


@torch.no_grad()
def reference(
    parts: ComposeParts, ratio: float, following: Sequence[int], *, lowest: bool = False
) -> tuple[KVCache, list[int]]:
    """The definition's KV of ``tokens[:at] + skill + tokens[at:]`` and the recomputed
    positions, ranked by ``following``; ``lowest``: the control recomputing the least read."""
    cache = parts.block()
    a, b = parts.at + parts.seam, parts.at + len(parts.skill)
    scores = eager_scores(parts.model, cache, following, a, b)
    return recompute_ranked(parts, cache, scores, ratio, lowest=lowest)


# -- (a) the engine equals the definition; the control is far off --------------------------


@pytest.mark.parametrize(("where", "seam"), [("middle", 0), ("middle", 4), ("end", 0), ("end", 4)])
def test_attention_compose_equals_the_definition(
    case: tuple[str, Engine], where: str, seam: int
) -> None:
    """Middle: the block is ranked by the session's own tokens after it. End: nothing of the
    session follows, so the turn's question (``final_tokens``) ranks it."""
    name, engine = case
    tokens, skill_tokens, suffix = _texts(name, engine)
    at = len(tokens) // 2 if where == "middle" else len(tokens)
    final = None if where == "middle" else [*tokens, *skill_tokens, *suffix]
    following = tokens[at:] if where == "middle" else suffix
    ratio = 0.3
    skill = compile_skill(engine, skill_tokens, skill_id="tool-spec", tenant="t")
    session = SessionCache(engine)
    session.prefill(tokens)
    report = session.compose(
        skill, at, seam_tokens=seam, recompute=attention(ratio), final_tokens=final
    )
    count = _count(ratio, len(skill_tokens) - seam)
    assert report.path is Path.splice and report.prefilled_tokens == seam + count

    model = engine.model
    parts = compose_parts(name, model, tokens, skill_tokens, at, seam)
    ref, chosen = reference(parts, ratio, following)
    assert 1 < len(chosen) < len(skill_tokens) - seam  # a real choice, not all or none
    wrong, _ = reference(parts, ratio, following, lowest=True)
    # Recomputing the least-read tokens instead is far from it: the ranking matters.
    check_against(session, model, ref, wrong, suffix)


def test_ratio_one_equals_a_full_prefill(case: tuple[str, Engine]) -> None:
    name, engine = case
    tokens, skill_tokens, suffix = _texts(name, engine)
    skill = compile_skill(engine, skill_tokens, skill_id="s", tenant="t")
    session = SessionCache(engine)
    session.prefill(tokens)
    final = [*tokens, *skill_tokens, *suffix]
    session.compose(skill, len(tokens), seam_tokens=4, recompute=attention(1.0), final_tokens=final)
    assert session.state.exact_length == len(tokens) + len(skill_tokens)
    session.extend(suffix)
    with torch.no_grad():
        fresh = engine.model(input_ids=torch.tensor([final])).logits[0, -1].float()
    assert top_logprob_gap(fresh, session.next_token_logits()) <= TOL


# -- (b) what ranks a block: the following tokens --------------------------------------------


def test_following_tokens_come_from_the_request_when_it_extends_the_revision() -> None:
    revision = list(range(100, 130))
    prompt = [*revision, 7, 8, 9]
    assert following_tokens(revision, 30, prompt) == (7, 8, 9)  # a turn's question
    assert following_tokens(revision, 20, prompt) == (*range(120, 130), 7, 8, 9)
    assert following_tokens(revision, 20) == tuple(range(120, 130))  # an apply batch
    assert following_tokens(revision, 30) == ()
    diverged = [*revision[:10], 1, 2, 3]
    assert following_tokens(revision, 20, diverged) == tuple(range(120, 130))
    long = [*revision, *range(1000, 2000)]
    assert following_tokens(revision, 30, long) == tuple(range(1000, 1000 + ATTENTION_WINDOW))


def test_nothing_after_the_block_recomputes_only_the_seam(mla: Engine) -> None:
    ranked, plain, skill = _session(mla), _session(mla), _skill(mla, length=20)
    report = ranked.compose(skill, 40, seam_tokens=3, recompute=attention(0.5))
    plain.compose(skill, 40, seam_tokens=3)
    assert report.prefilled_tokens == 3 and report.reused_tokens == 40 + 17
    assert kv_bitwise_equal(ranked.kv, plain.kv)


def test_the_question_changes_what_is_recomputed(mla: Engine) -> None:
    """Two questions after the same block rank it differently (the mode reads them)."""
    tokens = random_tokens(30, mla.vocab_size, 21)
    block = random_tokens(40, mla.vocab_size, 22)
    skill = compile_skill(mla, block, skill_id="s", tenant="t")
    kvs = []
    for seed in (1, 2):
        question = random_tokens(6, mla.vocab_size, 100 + seed)
        session = SessionCache(mla)
        session.prefill(tokens)
        session.compose(skill, 30, seam_tokens=2, recompute=attention(0.2),
                        final_tokens=[*tokens, *block, *question])  # fmt: skip
        kvs.append(session.kv)
    assert not kv_bitwise_equal(kvs[0], kvs[1])


# -- (c) the batch path, failures and refusals change nothing --------------------------------


def test_an_attention_compose_beside_a_splice_equals_the_two_in_turn(mla: Engine) -> None:
    question = random_tokens(6, mla.vocab_size, 9)
    check_beside_a_splice(mla, attention(0.4), {"recompute": attention(0.4)}, question)


def test_a_failed_attention_compose_leaves_the_session_as_it_was(
    mla: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    session, skill = _session(mla), _skill(mla)
    before = (session.tokens, session.revision, snapshot(session.kv))
    final = [*session.tokens[:10], *skill.tokens, *session.tokens[10:]]

    def boom(*args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError("out of memory mid-recompute")

    monkeypatch.setattr("leyline.engine.edits.attention_recompute.forward_at", boom)
    with pytest.raises(RuntimeError):
        session.compose(skill, 10, seam_tokens=2, recompute=attention(0.5), final_tokens=final)
    _unchanged(session, *before)
    with pytest.raises(ValueError, match="not both"):
        session.compose(skill, 10, recompute_ratio=0.2, recompute=attention(0.2))
    _unchanged(session, *before)


def test_a_model_without_the_engines_attention_is_refused() -> None:
    loaded = tiny_llama()
    loaded.model.set_attn_implementation("eager")
    engine = Engine(loaded)
    assert not supports_attention_recompute(engine)
    session = SessionCache(engine)
    session.prefill(random_tokens(20, engine.vocab_size, 1))
    skill = compile_skill(engine, random_tokens(10, engine.vocab_size, 2), skill_id="s", tenant="t")
    before = (session.tokens, session.revision, snapshot(session.kv))
    with pytest.raises(LeylineError) as err:
        session.compose(skill, 5, recompute=attention(0.5))
    assert err.value.code is ErrorCode.unsupported_option and err.value.field == "recompute.mode"
    _unchanged(session, *before)


# -- (d) the weights the engine's attention hands out ----------------------------------------


def _masks(q: int, k: int) -> Iterator[tuple[str, torch.Tensor | None, torch.Tensor]]:
    """(name, mask as passed, boolean visibility) for queries at the last ``q`` of ``k``."""
    causal = torch.arange(k)[None, :] <= torch.arange(k - q, k)[:, None]
    yield "none", None, causal
    yield "bool", causal[None, None], causal
    additive = torch.zeros(q, k).masked_fill(~causal, torch.finfo(torch.float32).min)
    yield "additive", additive[None, None], causal


@pytest.mark.parametrize("q", [1, 5])
def test_attention_mass_equals_softmax_attention(q: int) -> None:
    gen = torch.Generator().manual_seed(0)
    k, d = 23, 16
    query = torch.randn(1, 6, q, d, generator=gen)
    key, value = (torch.randn(1, 2, k, d, generator=gen) for _ in range(2))
    for name, mask, visible in _masks(q, k):
        mass = AttentionMass(4, 15)
        out = mass.attend(query, key, value, mask, 0.3)
        keys = key.double().repeat_interleave(3, 1)
        scores = (query.double() @ keys.transpose(-1, -2)) * 0.3
        weights = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        assert torch.allclose(mass.total, weights[..., 4:15].sum((0, 1, 2)), atol=1e-5), name
        want = F.scaled_dot_product_attention(
            query, key, value, attn_mask=visible, scale=0.3, enable_gqa=True
        )
        assert torch.allclose(out, want.transpose(1, 2), atol=1e-5), name
        assert mass.layers == 1
    with pytest.raises(ValueError, match="key range"):
        AttentionMass(4, 30).attend(query, key, value, None, None)
