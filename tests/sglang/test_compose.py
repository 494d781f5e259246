"""COMPOSE on SGLang's real MLA pool, allocators and radix trees (legacy, unified x 2 cores).

A skill is prefilled in the public namespace (a stand-in for the generate the plugin runs:
random latents, k_pe rotated by SGLang's own rope at positions from 0) and held; a compose
builds the new sequence in a session's own namespace: the prefix copied, the seam left to
a generate, the rest of the block copied from the skill's slots with k_pe rotated to its
new positions, the downstream tokens rotated as a splice does. Checked against SGLang's
rope applied at the new positions to the unrotated keys that were written.
"""

from __future__ import annotations

from array import array
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from sglang.srt.mem_cache.base_prefix_cache import InsertParams
from sglang.srt.mem_cache.radix_cache import RadixKey

from leyline.protocol.algebra import Edit
from leyline.protocol.errors import ErrorCode, LeylineError
from leyline.sglang.link import BlockSource, SchedulerOrder
from leyline.sglang.scheduler_side import HELD_SHARE, handle
from leyline.sglang.tree_ops import TreeOps
from leyline.sglang.wire import to_wire

from ._stack import LAYERS, LORA, TREE_KINDS, Stack, TreeKind, build, free_slot_count, rope_at
from .test_splice_mla import _bf16_pair_ulp

OLD = list(range(100, 160))  # 60 tokens
SKILL = list(range(500, 524))  # 24 tokens
ANCHOR = [900, 901, 902]
AT, SEAM = 20, 4
SALT = "leyline-session-test"


def _write(stack: Stack, tokens: list[int], salt: str | None, seed: int) -> None:
    """A generate of ``tokens`` in ``salt``'s namespace: fresh KV (random latent, k_pe by
    SGLang's rope at the token's position) for the whole pages past the match."""
    ops = TreeOps(stack.tree)
    match = ops.match(tokens, salt)
    n = len(tokens) - len(tokens) % stack.pool.page_size
    if n <= match.length:
        return
    fresh = stack.allocator.alloc(n - match.length).to(torch.int64)
    g = torch.Generator().manual_seed(seed)
    positions = torch.arange(match.length, n)
    for layer in range(LAYERS):
        latent = torch.randn(len(fresh), LORA, generator=g)
        raw = torch.randn(len(fresh), 16, generator=g)
        _, k_pe = rope_at(stack.rope, positions, raw)
        row = torch.cat([latent, k_pe.reshape(len(fresh), 16)], dim=-1)
        stack.pool.kv_buffer[layer][fresh] = row.to(stack.pool.store_dtype).unsqueeze(1)
        if layer == 0:
            stack.raw_band.update({int(s): raw[i] for i, s in enumerate(fresh)})
    key = RadixKey(array("q", tokens[:n]), cache_salt=salt)
    value = torch.cat([match.slots[: match.length], fresh])
    stack.tree.insert(InsertParams(key=key, value=value, prev_prefix_len=match.length))


def _scheduler(stack: Stack) -> Any:
    """The scheduler over ``stack`` (one per stack: it keeps the holds)."""
    if "scheduler" in stack.__dict__:
        return stack.__dict__["scheduler"]
    model = torch.nn.Module()
    model.rotary_emb = stack.rope
    return stack.__dict__.setdefault(
        "scheduler",
        SimpleNamespace(
            tree_cache=stack.tree,
            tp_worker=SimpleNamespace(model_runner=SimpleNamespace(model=model)),
            token_to_kv_pool_allocator=stack.allocator,
            req_to_token_pool=stack.req_to_token,
        ),
    )


def _hold(scheduler: Any, key: str, tokens: list[int]) -> Any:
    return handle(scheduler, to_wire(SchedulerOrder("hold", tokens, key=key)))


def _compose(
    stack: Stack, *, anchor: list[int] | None = None, seam: int = SEAM
) -> tuple[Any, BlockSource, Any]:
    """Prefill OLD and the skill, hold the skill, compose it at AT: the first call asks
    for the seam, a generate prefills it, the second call completes."""
    lead = anchor or []
    _write(stack, OLD, None, seed=1)
    _write(stack, lead + SKILL, None, seed=2)
    scheduler = _scheduler(stack)
    assert _hold(scheduler, "skill", lead + SKILL).ok
    block = BlockSource(AT, AT + len(SKILL), tuple(lead + SKILL), len(lead), seam)
    executor = stack.executor()
    edit = Edit(AT, AT, tuple(SKILL))
    first = executor.splice(OLD, [edit], blocks=[block], new_salt=SALT)
    out = first
    if first.pending_prefill is not None:
        _write(stack, list(first.tokens[: first.pending_prefill]), SALT, seed=3)
        out = executor.splice(OLD, [edit], blocks=[block], new_salt=SALT)
    return first, block, out


def _slots(stack: Stack, tokens: list[int] | tuple[int, ...], salt: str | None) -> torch.Tensor:
    return TreeOps(stack.tree).match(list(tokens), salt).slots


def _check_rotated(stack: Stack, src: torch.Tensor, dst: torch.Tensor, positions: Any) -> None:
    """k_pe at ``dst`` is SGLang's rope at ``positions`` of the raw keys written at ``src``
    (within one bf16 ulp of each pair), and the latents are ``src``'s bitwise."""
    raw = torch.stack([stack.raw_band[int(s)] for s in src])
    _, expected = rope_at(stack.rope, torch.as_tensor(positions), raw)
    expected = expected.reshape(raw.shape).to(torch.bfloat16)
    got = stack.pool.kv_buffer[0][dst, 0, LORA:]
    err = (got.float() - expected.float()).abs()
    assert bool((err <= _bf16_pair_ulp(expected)).all()), float(err.max())
    for buf in stack.pool.kv_buffer:
        assert torch.equal(buf[dst, 0, :LORA], buf[src, 0, :LORA])


@pytest.mark.parametrize("kind", TREE_KINDS)
def test_the_block_is_the_skill_rotated_to_its_position_in_the_session_namespace(
    kind: TreeKind,
) -> None:
    stack = build(kind)
    first, _, out = _compose(stack)
    new = [*OLD[:AT], *SKILL, *OLD[AT:]]
    assert out.tokens == tuple(new)
    assert first.pending_prefill == AT + SEAM  # the prefix is built, the seam is asked for
    assert out.pending_prefill is None and out.fallback_reason is None
    body, downstream = len(SKILL) - SEAM, len(OLD) - AT
    assert out.rotated_tokens == body + downstream
    assert out.reused_tokens == AT + body + downstream
    mine = _slots(stack, new, SALT)
    assert len(mine) == len(new) - 1  # the moved last token is left to the generate
    skill_slots, old_slots = _slots(stack, SKILL, None), _slots(stack, OLD, None)
    # Block past the seam: the skill's KV, keys turned from 0.. to AT + SEAM..
    positions = torch.arange(AT + SEAM, AT + len(SKILL))
    _check_rotated(stack, skill_slots[SEAM:], mine[AT + SEAM : AT + len(SKILL)], positions)
    # Downstream: the old KV moved by the block's length, as a splice moves it.
    positions = torch.arange(AT + len(SKILL), len(new) - 1)
    _check_rotated(stack, old_slots[AT:-1], mine[AT + len(SKILL) :], positions)
    # The prefix: a bitwise copy in the session's own namespace (not the public slots).
    assert not set(mine[:AT].tolist()) & set(old_slots.tolist())
    for buf in stack.pool.kv_buffer:
        assert torch.equal(buf[mine[:AT]], buf[old_slots[:AT]])
    # Without the rotation the block's keys would be far off: the check has teeth.
    stale = stack.pool.kv_buffer[0][skill_slots[SEAM:], 0, LORA:].float()
    fresh = stack.pool.kv_buffer[0][mine[AT + SEAM : AT + len(SKILL)], 0, LORA:].float()
    assert float((stale - fresh).abs().max()) > 0.1


@pytest.mark.parametrize("kind", TREE_KINDS)
def test_no_other_request_matches_the_composed_sequence(kind: TreeKind) -> None:
    """Protocol 3.4: composed KV is not a prefill of its tokens; only the session's own
    namespace holds it. The public tree still matches the old sequence and the skill."""
    stack = build(kind)
    _, _, out = _compose(stack)
    ops = TreeOps(stack.tree)
    assert ops.match(list(out.tokens)).length == AT  # the public prefix only
    assert ops.match(OLD).length == len(OLD)
    assert ops.match(SKILL).length == len(SKILL)


@pytest.mark.parametrize("kind", TREE_KINDS)
def test_an_anchored_skill_is_read_after_its_anchor(kind: TreeKind) -> None:
    stack = build(kind)
    _, block, out = _compose(stack, anchor=ANCHOR)
    assert block.tokens == tuple(SKILL)
    mine = _slots(stack, out.tokens, SALT)
    source = _slots(stack, ANCHOR + SKILL, None)
    positions = torch.arange(AT + SEAM, AT + len(SKILL))
    src = source[len(ANCHOR) + SEAM :]
    _check_rotated(stack, src, mine[AT + SEAM : AT + len(SKILL)], positions)


@pytest.mark.parametrize("kind", TREE_KINDS)
def test_seam_zero_copies_the_whole_block_at_once(kind: TreeKind) -> None:
    stack = build(kind)
    first, _, out = _compose(stack, seam=0)
    assert first.pending_prefill is None and first is out  # nothing to prefill
    assert out.rotated_tokens == len(SKILL) + len(OLD) - AT
    mine = _slots(stack, out.tokens, SALT)
    positions = torch.arange(AT, AT + len(SKILL))
    _check_rotated(stack, _slots(stack, SKILL, None), mine[AT : AT + len(SKILL)], positions)


@pytest.mark.parametrize("kind", TREE_KINDS)
def test_a_held_skill_survives_eviction_and_nothing_leaks(kind: TreeKind) -> None:
    stack = build(kind)
    _compose(stack)
    scheduler = _scheduler(stack)
    ops = TreeOps(stack.tree)
    ops.evict_all()
    assert ops.match(SKILL).length == len(SKILL)  # held: never evicted
    assert ops.match(OLD).length < len(OLD)
    released = handle(scheduler, to_wire(SchedulerOrder("release", key="skill")))
    assert released.ok and released.cached_tokens == 0
    ops.evict_all()
    assert ops.match(SKILL).length == 0
    assert free_slot_count(stack) == (stack.size, stack.size)


@pytest.mark.parametrize("kind", TREE_KINDS)
def test_a_page_the_tree_does_not_hold_of_the_skill_is_prefilled(kind: TreeKind) -> None:
    """Page size 4, a 23-token skill: the tree holds 20 of them; the block's last 3 are
    prefilled in context like the seam, and the build completes."""
    stack = build(kind, page_size=4)
    skill = SKILL[:23]
    _write(stack, OLD, None, seed=1)
    _write(stack, skill, None, seed=2)
    scheduler = _scheduler(stack)
    assert _hold(scheduler, "skill", skill).cached_tokens == 20
    block = BlockSource(AT, AT + 23, tuple(skill), 0, SEAM)
    executor = stack.executor()
    edit = Edit(AT, AT, tuple(skill))
    asked = []
    for _ in range(4):
        out = executor.splice(OLD, [edit], blocks=[block], new_salt=SALT)
        if out.pending_prefill is None:
            break
        asked.append(out.pending_prefill)
        _write(stack, list(out.tokens[: out.pending_prefill]), SALT, seed=len(asked) + 3)
    assert asked == [AT + SEAM, AT + 23 + 1]  # the seam; the tail to the end of its page
    mine = _slots(stack, out.tokens, SALT)
    assert len(mine) == len(out.tokens) - 1 - (len(out.tokens) - 1) % 4
    src = _slots(stack, skill, None)[SEAM:20]
    _check_rotated(stack, src, mine[AT + SEAM : AT + 20], torch.arange(AT + SEAM, AT + 20))


def test_holds_are_capped_at_a_share_of_the_pool_and_a_refusal_holds_nothing() -> None:
    stack = build("unified-rust", size=128)
    scheduler = _scheduler(stack)
    cap = stack.size // HELD_SHARE
    tokens = list(range(300, 300 + cap))
    _write(stack, tokens, None, seed=5)
    assert _hold(scheduler, "a", tokens).cached_tokens == cap
    refused = _hold(scheduler, "b", [7])
    assert not refused.ok and refused.error_code == ErrorCode.limit_exceeded
    assert "b" not in scheduler._leyline_holds
    # The same key again replaces its own hold (it does not count against itself).
    assert _hold(scheduler, "a", tokens[: cap // 2]).cached_tokens == cap // 2
    # Room made by releasing an evictable key, and only when that suffices.
    more = list(range(700, 700 + cap // 2 + 1))
    _write(stack, more, None, seed=6)
    big = more + [1] * cap
    too_big = handle(scheduler, to_wire(SchedulerOrder("hold", big, key="c", evictable=["a"])))
    assert not too_big.ok and set(scheduler._leyline_holds) == {"a"}  # nothing released
    made = handle(scheduler, to_wire(SchedulerOrder("hold", more, key="c", evictable=["a"])))
    assert made.ok and made.released == ["a"] and set(scheduler._leyline_holds) == {"c"}


def test_a_block_that_is_not_its_skills_tokens_is_refused_with_nothing_changed() -> None:
    stack = build("legacy")
    _write(stack, OLD, None, seed=1)
    _write(stack, SKILL, None, seed=2)
    before = stack.snapshot()
    block = BlockSource(AT, AT + len(SKILL), tuple(SKILL), 0, SEAM)
    other = tuple(t + 1 for t in SKILL)
    with pytest.raises(LeylineError) as info:
        stack.executor().splice(OLD, [Edit(AT, AT, other)], blocks=[block], new_salt=SALT)
    assert info.value.code is ErrorCode.invalid_directive
    after = stack.snapshot()
    assert all(torch.equal(a, b) for a, b in zip(after[0], before[0], strict=True))
    assert after[1:] == before[1:]


@pytest.mark.parametrize("kind", TREE_KINDS)
def test_a_block_that_ends_the_sequence_leaves_its_last_token_to_the_generate(
    kind: TreeKind,
) -> None:
    """Protocol 3.4: a block that ends the new sequence has its last token recomputed in
    context before anything follows it; the tree holds the rest of the block."""
    stack = build(kind)
    _write(stack, OLD, None, seed=1)
    _write(stack, SKILL, None, seed=2)
    assert _hold(_scheduler(stack), "skill", SKILL).ok
    n = len(OLD)
    block = BlockSource(n, n + len(SKILL), tuple(SKILL), 0, 0)
    out = stack.executor().splice(OLD, [Edit(n, n, tuple(SKILL))], blocks=[block], new_salt=SALT)
    assert out.pending_prefill is None and out.cached_tokens == n + len(SKILL) - 1
    assert len(_slots(stack, out.tokens, SALT)) == n + len(SKILL) - 1


@pytest.mark.parametrize("kind", TREE_KINDS)
def test_a_last_token_before_every_change_keeps_its_kv(kind: TreeKind) -> None:
    """A cut of the tail leaves the last token in the unchanged prefix: its KV already saw
    exactly its context, so the tree holds all of it."""
    stack = build(kind)
    _write(stack, OLD, None, seed=1)
    out = stack.executor().splice(OLD, [Edit(50, 60, ())])
    assert out.cached_tokens == 50 and TreeOps(stack.tree).match(OLD[:50]).length == 50


@pytest.mark.parametrize("kind", TREE_KINDS)
def test_a_block_after_a_generations_uncached_last_token_is_still_copied(
    kind: TreeKind,
) -> None:
    """A session ends with the token its last generation sampled, which the tree never
    holds. A block composed after it: the generate computes that token, then the build
    goes on and copies the block (it is not left to the generate)."""
    stack = build(kind)
    _write(stack, OLD[:-1], None, seed=1)  # the last token's KV was never computed
    _write(stack, SKILL, None, seed=2)
    assert _hold(_scheduler(stack), "skill", SKILL).ok
    n = len(OLD)
    block = BlockSource(n, n + len(SKILL), tuple(SKILL), 0, SEAM)
    edit = Edit(n, n, tuple(SKILL))
    executor, asked = stack.executor(), []
    for round_ in range(4):
        out = executor.splice(OLD, [edit], blocks=[block], new_salt=SALT)
        if out.pending_prefill is None:
            break
        asked.append(out.pending_prefill)
        _write(stack, list(out.tokens[: out.pending_prefill]), SALT, seed=10 + round_)
    assert asked == [n, n + SEAM]  # the sampled token, then the seam
    assert out.rotated_tokens == len(SKILL) - SEAM
    assert out.reused_tokens == n - 1 + len(SKILL) - SEAM  # not the computed token
    mine = _slots(stack, out.tokens, SALT)
    body = mine[n + SEAM :]
    src = _slots(stack, SKILL, None)[SEAM : SEAM + len(body)]
    _check_rotated(stack, src, body, torch.arange(n + SEAM, n + SEAM + len(body)))
