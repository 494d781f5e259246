"""COMPOSE against an independent computation of its definition, and the SkillStore.

The reference never calls ``compose``/``run_executor``: the skill's KV is a fresh forward
from position 0, its keys are rotated with the cos/sin formula written here (checked
against the skill prefilled at its new positions), the seam is a full forward of prefix +
seam, downstream keys are the session's rotated the same way, and logits come from the
model run on a transformers ``DynamicCache`` holding that KV.

SmolLM2 cases need the real weights (``slow``, ``model``); the tiny random MLA models
(DeepSeek-V2 interleaved, V3 half-split rope bands) run everywhere.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import pytest
import torch
from transformers import DynamicCache, PreTrainedModel

from leyline.core.errors import SpliceUnsupportedError
from leyline.engine.edits.skills import Skill, SkillStore, compile_skill
from leyline.engine.engine import Engine
from leyline.engine.forward import Forwards, prefill_at
from leyline.engine.kv.kv_blocks import KVCache
from leyline.engine.models import build_tiny_mla
from leyline.engine.session import SessionCache
from leyline.protocol.algebra import Edit
from leyline.protocol.directives import Mode, Verb
from leyline.protocol.envelope import Path
from leyline.protocol.errors import ErrorCode, LeylineError
from leyline.protocol.fallback import FallbackReason

from ._helpers import kv_bitwise_equal, random_tokens, rel_err, snapshot, tiny_llama

TOL = 1e-4  # max |Δ logprob| over the reference's top 20, fp32
TOP = 20

#: Where each model keeps its rope band: (cache slot, pairing). The band is the whole
#: tensor in both (SmolLM2 rotates all 64 key dims; MLA caches the 16-dim band alone).
ROPE_BAND = {
    "smollm2": (0, "half"),
    "tiny-mla-v2": (1, "interleaved"),
    "tiny-mla-v3": (1, "half"),
}

SESSION_TEXT = (
    "<|im_start|>system\nYou are a coding agent. Use the tools you are given.<|im_end|>\n"
    "<|im_start|>user\nThe test test_divide fails in calculator.py. Find the bug and tell "
    "me which function is wrong.<|im_end|>\n<|im_start|>assistant\n"
)
SKILL_TEXT = (
    "Tool read_file(path: str) -> str: returns the text of a file in the repository. "
    "Call it before answering questions about code."
)
SUFFIX_TEXT = "I will read calculator.py first."


def _texts(name: str, engine: Engine) -> tuple[list[int], list[int], list[int]]:
    """(session tokens, skill tokens, suffix tokens): ~60 / ~25 / ~8."""
    if name == "smollm2":
        enc = engine.encode
        return list(enc(SESSION_TEXT)), list(enc(SKILL_TEXT)), list(enc(SUFFIX_TEXT))
    vocab = engine.vocab_size
    return random_tokens(60, vocab, 1), random_tokens(25, vocab, 2), random_tokens(8, vocab, 3)


# -- the independent reference -------------------------------------------------------------


def _rotate(x: torch.Tensor, delta: int, theta: float, pairing: str) -> torch.Tensor:
    """``x`` (the whole last dim rotary) moved by ``delta`` positions: each pair of dims
    (i, i + d/2) or (2i, 2i + 1) turned by ``delta·θ^(-2i/d)``, computed in fp64."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d)  # as HF
    angle = inv_freq.double() * delta
    cos, sin = angle.cos(), angle.sin()
    y = x.double()
    if pairing == "half":
        a, b = y[..., : d // 2], y[..., d // 2 :]
        out = torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
    else:
        a, b = y[..., 0::2], y[..., 1::2]
        out = torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)
    return out.to(x.dtype)


def _theta(model: PreTrainedModel) -> float:
    params = model.config.rope_parameters
    assert params["rope_type"] == "default", params  # the formula above is default RoPE
    return float(params["rope_theta"])


def _cat(*parts: torch.Tensor) -> torch.Tensor:
    return torch.cat([p for p in parts if p.shape[-2]], dim=-2)


@dataclasses.dataclass(frozen=True)
class ComposeParts:
    """What the definition of composing ``skill`` into ``tokens`` at ``at`` is built from:
    the skill's KV computed alone and the session's own, and where the model keeps its rope
    band. Every reference (this file's, the recompute modes') starts from these."""

    model: PreTrainedModel
    tokens: Sequence[int]
    skill: Sequence[int]
    at: int
    seam: int
    """The seam's length (at most the skill's)."""
    slot: int
    pairing: str
    alone: KVCache
    """The skill with nothing before it."""
    old: KVCache
    """The session's own KV."""

    def copied(self, layer: int, c: int, *, rotate: bool = True) -> torch.Tensor:
        """The skill's KV past the seam, its keys moved to ``at``: what a compose copies."""
        y = self.alone[layer][c][..., self.seam :, :]
        if rotate and c == self.slot:
            return _rotate(y, self.at, _theta(self.model), self.pairing)
        return y

    def block(self, *, rotate: bool = True) -> list[list[torch.Tensor]]:
        """Per layer (keys, values) up to the block's end before any recompute: prefix +
        seam prefilled fresh, then the copied skill (``rotate=False``: its keys left at 0)."""
        head = prefill_at(self.model, [*self.tokens[: self.at], *self.skill[: self.seam]], 0)
        return [
            [_cat(h[c], self.copied(i, c, rotate=rotate)) for c in range(2)]
            for i, h in enumerate(head)
        ]

    def with_downstream(self, cache: Sequence[Sequence[torch.Tensor]]) -> KVCache:
        """``cache`` (the sequence up to the block's end) followed by the session's KV from
        ``at`` on, its keys moved by the skill's length (AMORTIZE)."""
        out = []
        for i, slots in enumerate(cache):
            parts = []
            for c in range(2):
                down = self.old[i][c][..., self.at :, :]
                if c == self.slot:
                    down = _rotate(down, len(self.skill), _theta(self.model), self.pairing)
                parts.append(_cat(slots[c], down))
            out.append(tuple(parts))
        return tuple(out)


def compose_parts(
    name: str,
    model: PreTrainedModel,
    tokens: Sequence[int],
    skill: Sequence[int],
    at: int,
    seam: int,
) -> ComposeParts:
    slot, pairing = ROPE_BAND[name]
    alone, old = prefill_at(model, list(skill), 0), prefill_at(model, list(tokens), 0)
    return ComposeParts(model, tokens, skill, at, min(seam, len(skill)), slot, pairing, alone, old)


def reference_kv(parts: ComposeParts, *, rotate_skill: bool = True) -> KVCache:
    """The definition's KV of ``tokens[:at] + skill + tokens[at:]``."""
    return parts.with_downstream(parts.block(rotate=rotate_skill))


@torch.no_grad()
def logits_after(model: PreTrainedModel, kv: KVCache, tokens: Sequence[int]) -> torch.Tensor:
    """Next-token logits after ``kv`` followed by ``tokens``, on transformers' own cache."""
    cache = DynamicCache()
    for i, layer in enumerate(kv):
        cache.update(layer[0].clone(), layer[1].clone(), i)
    start = int(kv[0][0].shape[-2])
    ids = torch.tensor([list(tokens)], dtype=torch.long)
    pos = torch.arange(start, start + len(tokens)).unsqueeze(0)
    out = model(input_ids=ids, position_ids=pos, cache=cache, use_cache=True)
    return out.logits[0, -1].float()


def top_logprob_gap(reference: torch.Tensor, got: torch.Tensor) -> float:
    """max |Δ logprob| over the reference's top 20 tokens."""
    ref, other = torch.log_softmax(reference.double(), -1), torch.log_softmax(got.double(), -1)
    top = ref.topk(TOP).indices
    return float((ref[top] - other[top]).abs().max())


def _drop_last(kv: KVCache) -> KVCache:
    return tuple(tuple(t[..., :-1, :] for t in layer) for layer in kv)


# -- (a) logits equal the definition's; (b) the no-rotation control -------------------------


def _measure(name: str, engine: Engine, where: str, seam: int) -> dict[str, float]:
    tokens, skill_tokens, suffix = _texts(name, engine)
    at = len(tokens) // 2 if where == "middle" else len(tokens)
    model = engine.model
    skill = compile_skill(engine, skill_tokens, skill_id="tool-spec", tenant="t")
    session = SessionCache(engine)
    session.prefill(tokens)
    report = session.compose(skill, at, seam_tokens=seam)
    composed = tokens[:at] + skill_tokens + tokens[at:]
    assert session.tokens == tuple(composed) and report.path is Path.splice
    assert report.prefilled_tokens == seam

    # The last-token rule: the composed sequence's last token runs in its new context.
    parts = compose_parts(name, model, tokens, skill_tokens, at, seam)
    ref = _drop_last(reference_kv(parts))
    plain = _drop_last(reference_kv(parts, rotate_skill=False))
    last = [composed[-1]]
    figures = {
        "next": top_logprob_gap(logits_after(model, ref, last), session.next_token_logits()),
        "control": top_logprob_gap(logits_after(model, plain, last), session.next_token_logits()),
    }
    session.extend(suffix)
    figures["suffix"] = top_logprob_gap(
        logits_after(model, ref, last + suffix), session.next_token_logits()
    )
    figures["suffix_control"] = top_logprob_gap(
        logits_after(model, plain, last + suffix), session.next_token_logits()
    )
    return figures


@pytest.mark.parametrize("seam", [0, 4])
@pytest.mark.parametrize("where", ["middle", "end"])
def test_compose_equals_the_definition(case: tuple[str, Engine], where: str, seam: int) -> None:
    name, engine = case
    figures = _measure(name, engine, where, seam)
    assert figures["next"] <= TOL and figures["suffix"] <= TOL, figures
    # (b) Copying the skill's KV without rotating its keys is far off the definition.
    assert min(figures["control"], figures["suffix_control"]) > 100 * TOL, figures


def test_the_test_rotation_matches_the_model_at_new_positions(case: tuple[str, Engine]) -> None:
    """The formula above agrees with the model's own RoPE: the skill prefilled at positions
    ``at, at+1, ...`` has the keys of the skill at 0 rotated by ``at`` (attention is
    relative), and values/latents equal."""
    name, engine = case
    _, skill_tokens, _ = _texts(name, engine)
    slot, pairing = ROPE_BAND[name]
    at0, moved = (
        prefill_at(engine.model, skill_tokens, 0),
        prefill_at(engine.model, skill_tokens, 37),
    )
    for a, b in zip(at0, moved, strict=True):
        assert rel_err(_rotate(a[slot], 37, _theta(engine.model), pairing), b[slot]) <= 1e-5
        assert rel_err(a[slot], b[slot]) > 1e-2  # and the rotation is not a no-op
        assert rel_err(a[1 - slot], b[1 - slot]) <= 1e-5


# -- (c) the KV itself: seam, rotated skill, downstream shifted as a splice -----------------


@pytest.mark.parametrize("seam", [0, 4])
def test_compose_kv_is_the_definition_and_downstream_moves_as_a_splice(
    case: tuple[str, Engine], seam: int
) -> None:
    name, engine = case
    tokens, skill_tokens, _ = _texts(name, engine)
    at, n = len(tokens) // 2, len(skill_tokens)
    skill = compile_skill(engine, skill_tokens, skill_id="s", tenant="t")
    session = SessionCache(engine)
    session.prefill(tokens)
    old, revision = snapshot(session.kv), session.revision
    report = session.compose(skill, at, seam_tokens=seam)
    assert session.revision == revision + 1 and report.revision == revision + 1
    assert (report.reused_tokens, report.prefilled_tokens, report.rotated_tokens) == (
        len(tokens) + n - seam,
        seam,
        (n - seam) + (len(tokens) - at),
    )
    ref = reference_kv(compose_parts(name, engine.model, tokens, skill_tokens, at, seam))
    slot, _ = ROPE_BAND[name]
    splice = SessionCache(engine)
    splice.prefill(tokens)
    splice.apply_edits([Edit(at, at, tuple(skill_tokens), Mode.amortize)])
    seam_end, down = at + seam, at + n
    for got, want, before, spliced, compiled in zip(
        session.kv, ref, old, splice.kv, skill.kv, strict=True
    ):
        for s in range(2):
            assert rel_err(got[s], want[s]) <= 1e-5
            assert torch.equal(got[s][..., :at, :], before[s][..., :at, :])  # prefix: bitwise
            # Downstream: bitwise what a splice inserting the same tokens leaves there.
            assert torch.equal(got[s][..., down:, :], spliced[s][..., down:, :])
            if s != slot:  # position-free: copied bitwise
                assert torch.equal(got[s][..., down:, :], before[s][..., at:, :])
                assert torch.equal(got[s][..., seam_end:down, :], compiled[s][..., seam:, :])


def test_compose_at_zero_of_an_empty_session_is_the_compiled_skill(
    case: tuple[str, Engine],
) -> None:
    name, engine = case
    _, skill_tokens, _ = _texts(name, engine)
    skill = compile_skill(engine, skill_tokens, skill_id="s", tenant="t")
    session = SessionCache(engine)
    report = session.compose(skill, 0, seam_tokens=0)
    assert report.rotated_tokens == 0 and report.reused_tokens == len(skill)
    assert kv_bitwise_equal(session.kv, skill.kv)
    assert session.state.exact_length == len(skill)  # nothing before it: a fresh prefill
    fresh = engine.forward((), skill_tokens)[1]
    assert top_logprob_gap(fresh, session.next_token_logits()) <= TOL


def test_eager_logits_equal_lazy_logits(case: tuple[str, Engine]) -> None:
    name, engine = case
    tokens, skill_tokens, _ = _texts(name, engine)
    skill = compile_skill(engine, skill_tokens, skill_id="s", tenant="t")
    eager, lazy = SessionCache(engine), SessionCache(engine)
    for session in (eager, lazy):
        session.prefill(tokens)
    eager.compose(skill, len(tokens), seam_tokens=4, want_logits=True)
    lazy.compose(skill, len(tokens), seam_tokens=4)
    assert eager.state.logits is not None and lazy.state.logits is None
    # the eager last token is one row of the pass's matrix products, the lazy one a lone
    # row: different GEMM kernels, whose fp32 sums differ by ~1e-6 relative on AVX2 CPUs
    assert rel_err(eager.state.logits, lazy.next_token_logits()) <= 1e-5


# -- (d) failures change nothing; fallback -------------------------------------------------


def _unchanged(session: SessionCache, tokens: tuple[int, ...], revision: int, kv: KVCache) -> None:
    assert session.tokens == tokens and session.revision == revision
    assert kv_bitwise_equal(session.kv, kv)


def _session(engine: Engine, n: int = 40) -> SessionCache:
    session = SessionCache(engine)
    session.prefill(random_tokens(n, engine.vocab_size, 11))
    return session


def _skill(
    engine: Engine, skill_id: str = "s", tenant: str = "t", seed: int = 12, length: int = 16
) -> Skill:
    tokens = random_tokens(length, engine.vocab_size, seed)
    return compile_skill(engine, tokens, skill_id=skill_id, tenant=tenant)


def test_a_failed_compose_leaves_the_session_as_it_was(
    mla: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    session, skill = _session(mla), _skill(mla)
    before = (session.tokens, session.revision, snapshot(session.kv))
    with pytest.raises(LeylineError) as err:
        session.compose(skill, len(session.tokens) + 1)
    assert err.value.code is ErrorCode.invalid_span
    _unchanged(session, *before)
    with pytest.raises(LeylineError) as err:
        session.compose(skill, 3, seam_tokens=-1)
    assert err.value.code is ErrorCode.invalid_directive
    with pytest.raises(LeylineError) as err:
        session.compose(skill, 3, base_revision=session.revision + 5)
    assert err.value.code is ErrorCode.revision_conflict
    _unchanged(session, *before)

    def boom(*args: object) -> torch.Tensor:
        raise RuntimeError("out of memory mid-seam")

    monkeypatch.setattr(Forwards, "into", boom)
    with pytest.raises(RuntimeError):
        session.compose(skill, 10, seam_tokens=4)
    _unchanged(session, *before)


def test_a_skill_from_another_model_is_refused(mla: Engine) -> None:
    session = _session(mla)
    before = (session.tokens, session.revision, snapshot(session.kv))
    other = Engine(build_tiny_mla("v3"))
    foreign = _skill(other)
    relabelled = dataclasses.replace(_skill(mla), model="another-model (float32)")
    for skill in (foreign, relabelled):
        with pytest.raises(LeylineError) as err:
            session.compose(skill, 5)
        assert err.value.code is ErrorCode.skill_mismatch
        _unchanged(session, *before)


def test_a_model_that_cannot_rotate_falls_back_to_prefill() -> None:
    """Dynamic NTK: cached keys cannot be moved exactly; everything from ``at`` is
    prefilled (or, without fallback, refused and nothing changes)."""
    engine = Engine(tiny_llama({"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}))
    assert engine.splice_refusal is not None
    session, skill = _session(engine), _skill(engine)
    before = (session.tokens, session.revision, snapshot(session.kv))
    with pytest.raises(SpliceUnsupportedError):
        session.compose(skill, 10, allow_fallback=False)
    _unchanged(session, *before)
    report = session.compose(skill, 10)
    assert report.path is Path.reprefill
    assert report.fallback_reason is FallbackReason.unsupported_rope
    fresh = engine.forward((), session.tokens)[1]
    assert top_logprob_gap(fresh, session.next_token_logits()) <= TOL


# -- (d) SkillStore ------------------------------------------------------------------------


def test_store_evicts_the_least_recently_used_skill_within_its_budget(mla: Engine) -> None:
    size = _skill(mla).nbytes
    store = SkillStore(int(2.5 * size))
    a = store.register(mla, random_tokens(16, mla.vocab_size, 1), skill_id="a", tenant="t")
    store.register(mla, random_tokens(16, mla.vocab_size, 2), skill_id="b", tenant="t")
    assert a.nbytes == size and store.nbytes == 2 * size
    store.get("t", "a")  # a is now the more recently used
    store.register(mla, random_tokens(16, mla.vocab_size, 3), skill_id="c", tenant="t")
    assert ("t", "a") in store and ("t", "c") in store and ("t", "b") not in store
    assert store.nbytes <= store.budget_bytes
    with pytest.raises(LeylineError) as err:
        store.get("t", "b")
    assert err.value.code is ErrorCode.unknown_skill


def test_store_never_evicts_a_skill_in_use(mla: Engine) -> None:
    size = _skill(mla).nbytes
    store = SkillStore(int(2.5 * size))
    for i, name in enumerate("ab"):
        store.register(mla, random_tokens(16, mla.vocab_size, i), skill_id=name, tenant="t")
    held = store.acquire("t", "a")
    store.get("t", "b")  # a is now the least recently used, but held
    store.register(mla, random_tokens(16, mla.vocab_size, 5), skill_id="c", tenant="t")
    assert ("t", "a") in store and ("t", "b") not in store
    with store.using("t", "c"):
        with pytest.raises(LeylineError) as err:  # both held: no room, and nothing evicted
            store.register(mla, random_tokens(16, mla.vocab_size, 6), skill_id="d", tenant="t")
        assert err.value.code is ErrorCode.limit_exceeded
        assert len(store) == 2 and store.users("t", "c") == 1
    _session(mla).compose(held, 7)  # a compose reads the held skill
    store.release(held)
    assert store.users("t", "a") == 0
    store.register(mla, random_tokens(16, mla.vocab_size, 6), skill_id="d", tenant="t")
    assert ("t", "a") not in store  # released: evictable again (the least recently used)
    with pytest.raises(ValueError):
        store.release(held)


def test_store_isolates_tenants_and_deduplicates_content(mla: Engine) -> None:
    store = SkillStore(1 << 30)
    tokens = random_tokens(16, mla.vocab_size, 7)
    first = store.register(mla, tokens, skill_id="x", tenant="t1")
    again = store.register(mla, tokens, skill_id="x", tenant="t1")
    alias = store.register(mla, tokens, skill_id="y", tenant="t1")
    assert again is first and alias.content_hash == first.content_hash
    assert alias.kv is first.kv  # same tokens, same tenant: not prefilled again
    with pytest.raises(LeylineError) as err:
        store.get("t2", "x")
    assert err.value.code is ErrorCode.unknown_skill
    theirs = store.register(mla, random_tokens(16, mla.vocab_size, 8), skill_id="x", tenant="t2")
    assert store.get("t1", "x") is first and theirs.content_hash != first.content_hash
    same_elsewhere = store.register(mla, tokens, skill_id="z", tenant="t2")
    assert same_elsewhere.content_hash == first.content_hash  # a function of model + tokens
    assert same_elsewhere.kv is not first.kv  # but never shared across tenants
    assert store.skill_tokens("t1")("x") == tuple(tokens)
    assert store.skill_tokens("t2")("y") is None


def test_store_refuses_to_replace_a_skill_in_use(mla: Engine) -> None:
    store = SkillStore(1 << 30)
    store.register(mla, random_tokens(16, mla.vocab_size, 1), skill_id="x", tenant="t")
    with store.using("t", "x") as held:
        with pytest.raises(LeylineError):
            store.register(mla, random_tokens(16, mla.vocab_size, 2), skill_id="x", tenant="t")
        assert store.get("t", "x") is held
    replaced = store.register(mla, random_tokens(16, mla.vocab_size, 2), skill_id="x", tenant="t")
    assert replaced is not held and store.get("t", "x") is replaced


def test_a_compose_next_to_a_splice_in_one_batch_equals_the_two_in_turn(mla: Engine) -> None:
    """A splice replacing the session's tail and a compose at its end: the algebra merges
    the two insertions into one run, and the block inside it must still be copied (not
    prefilled). The batch equals the splice, then the compose at the block's position."""
    from leyline.core.batch import plan_batch
    from leyline.protocol import ComposeDirective, SpliceDirective, TokenSpan

    skill = _skill(mla)
    batched, sequential = _session(mla), _session(mla)
    n = len(batched.tokens)
    replacement = random_tokens(6, mla.vocab_size, 5)
    directives = [
        SpliceDirective(span=TokenSpan(start=n - 8, end=n), replacement=replacement),
        ComposeDirective(skill="s", at=n, seam_tokens=4),
    ]
    plan = plan_batch(
        batched.view, directives, tokenize=mla.encode, limits=mla.limits,
        vocab_size=mla.vocab_size, supported=list(Verb), skill_tokens=lambda _: skill.tokens,
    )  # fmt: skip
    report = batched.execute(plan, skills={1: skill})
    assert report.reused_tokens == (n - 8) + (len(skill) - 4)  # the block's copy counted
    sequential.apply_edits([Edit(n - 8, n, tuple(replacement))])
    sequential.compose(skill, n - 8 + len(replacement), seam_tokens=4)
    assert batched.tokens == sequential.tokens
    got = torch.log_softmax(batched.next_token_logits().double(), -1)
    want = torch.log_softmax(sequential.next_token_logits().double(), -1)
    assert float((got - want).abs().max()) < 1e-4


# -- (e) an anchored skill: compiled after context tokens whose KV it drops ---------------


@pytest.mark.parametrize("where", ["anchor", "elsewhere"])
def test_an_anchored_skill_composed_after_its_anchor_is_a_fresh_prefill(
    case: tuple[str, Engine], where: str
) -> None:
    """Composed right after the very tokens it was compiled after, the block saw exactly its
    real context: the compose (K = 0) must equal a prefill of anchor + skill, keys included
    (the rotation back by -len(anchor) and forward by +at cancel). Anywhere else the block
    lands as the definition says, rotated from "compiled at 0"."""
    name, engine = case
    tokens, skill_tokens, suffix = _texts(name, engine)
    anchor = tokens[:12]
    skill = compile_skill(engine, skill_tokens, skill_id="s", tenant="t", anchor=anchor)
    plain = compile_skill(engine, skill_tokens, skill_id="p", tenant="t")
    assert skill.anchor == tuple(anchor) and len(skill) == len(skill_tokens)
    assert skill.content_hash != plain.content_hash and skill.nbytes == plain.nbytes
    slot, pairing = ROPE_BAND[name]
    at = len(anchor) if where == "anchor" else len(tokens)
    session = SessionCache(engine)
    session.prefill(tokens[:at])
    session.compose(skill, at, seam_tokens=0)
    composed = list(tokens[:at]) + skill_tokens
    fresh = prefill_at(engine.model, list(anchor) + skill_tokens, 0)
    for got, want in zip(session.kv, fresh, strict=True):
        for s in range(2):
            block = got[s][..., at:, :]
            expected = want[s][..., len(anchor) :, :]
            if s == slot:  # the independent rotation: compiled after the anchor, moved
                expected = _rotate(expected, at - len(anchor), _theta(engine.model), pairing)
            assert rel_err(block, expected) <= 1e-5, (where, s)
    if where == "anchor":
        session.extend(suffix)
        reference = engine.forward((), composed + suffix)[1]
        assert top_logprob_gap(reference, session.next_token_logits()) <= TOL


def test_an_anchor_changes_what_the_block_holds(mla: Engine) -> None:
    """The anchor is seen: an anchored block's values differ from the plain compile's (a
    compile that ignored the anchor would pass the test above at at == 0 only)."""
    tokens = random_tokens(16, mla.vocab_size, 12)
    plain = compile_skill(mla, tokens, skill_id="p", tenant="t")
    anchored = compile_skill(mla, tokens, skill_id="a", tenant="t", anchor=[5, 6, 7])
    assert not torch.allclose(plain.kv[-1][0], anchored.kv[-1][0], atol=1e-3)


def test_an_anchor_outside_the_vocabulary_is_refused(mla: Engine) -> None:
    with pytest.raises(LeylineError) as err:
        compile_skill(mla, [1, 2, 3], skill_id="s", tenant="t", anchor=[mla.vocab_size])
    assert err.value.code is ErrorCode.invalid_directive
