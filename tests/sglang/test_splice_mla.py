"""A splice on SGLang's real MLA pool, allocators and radix trees (legacy, unified x 2 cores)."""

from __future__ import annotations

import pytest
import torch

from leyline.protocol.algebra import Edit
from leyline.sglang.tree_ops import TreeOps

from ._stack import LAYERS, LORA, TREE_KINDS, Stack, TreeKind, build, free_slot_count, rope_at

OLD = list(range(100, 180))  # 80 tokens
SPAN = (20, 50)  # cut 30 tokens


def _bf16_pair_ulp(ref: torch.Tensor) -> torch.Tensor:
    """One bf16 ulp at the scale of each interleaved pair (a rotation mixes both members)."""
    pair = ref.float().abs().unflatten(-1, (-1, 2)).amax(-1, keepdim=True).expand(-1, -1, 2)
    exponent = torch.floor(torch.log2(pair.clamp_min(1e-30)))
    return torch.pow(2.0, exponent - 7).flatten(-2)


def _splice(stack: Stack, replacement: tuple[int, ...] = ()):
    stack.prefill(OLD)
    executor = stack.executor()
    edit = Edit(SPAN[0], SPAN[1], replacement)
    rows = None
    if replacement:
        n = len(replacement)
        rows = {SPAN[0]: [[torch.randn(n, 1, LORA + 16)] for _ in range(LAYERS)]}
    return executor.splice(OLD, [edit], inserted_rows=rows)


def _cut_slots(kind: TreeKind) -> tuple[Stack, torch.Tensor, torch.Tensor]:
    """The cut of ``SPAN`` on a fresh stack: the stack, and the slots of the old and of the
    new sequence."""
    stack = build(kind)
    out = _splice(stack)
    ops = TreeOps(stack.tree)
    return stack, ops.match(OLD).slots, ops.match(list(out.tokens)).slots


@pytest.mark.parametrize("kind", TREE_KINDS)
def test_spliced_sequence_rematches_all_but_its_moved_last_token(kind: TreeKind) -> None:
    """The moved last token must see its new context before anything follows it (protocol
    3.1): the tree is not given its copied KV, so any generate computes it afresh."""
    stack = build(kind)
    out = _splice(stack)
    assert out.tokens == tuple(OLD[:20] + OLD[50:])
    assert out.pending_prefill is None and out.fallback_reason is None
    assert (out.reused_tokens, out.rotated_tokens) == (50, 30)
    match = TreeOps(stack.tree).match(list(out.tokens))
    assert match.length == out.cached_tokens == len(out.tokens) - 1
    # The old sequence is still cached too (other requests may hold it).
    assert TreeOps(stack.tree).match(OLD).length == len(OLD)


@pytest.mark.parametrize("kind", TREE_KINDS)
def test_rotated_band_matches_sglang_rope_at_new_positions(kind: TreeKind) -> None:
    stack, old_slots, new_slots = _cut_slots(kind)
    moved_new = new_slots[20:]
    moved_old = old_slots[50 : 50 + len(moved_new)]
    raw = torch.stack([stack.raw_band[int(s)] for s in moved_old])
    positions = torch.arange(20, 20 + len(moved_old))
    _, expected = rope_at(stack.rope, positions, raw)
    expected = expected.reshape(raw.shape).to(torch.bfloat16)
    got = stack.pool.kv_buffer[0][moved_new, 0, LORA:]
    err = (got.float() - expected.float()).abs()
    assert bool((err <= _bf16_pair_ulp(expected)).all()), float(err.max())
    # Without the rotation the keys would be far off: the check has teeth.
    stale = stack.pool.kv_buffer[0][moved_old, 0, LORA:]
    assert float((stale.float() - expected.float()).abs().max()) > 0.1


@pytest.mark.parametrize("kind", TREE_KINDS)
def test_latent_and_unmoved_prefix_are_kept_bitwise(kind: TreeKind) -> None:
    stack, old_slots, new_slots = _cut_slots(kind)
    assert torch.equal(new_slots[:20], old_slots[:20])  # the prefix is shared, not copied
    moved = old_slots[50 : 50 + len(new_slots) - 20]
    for buf in stack.pool.kv_buffer:
        assert torch.equal(buf[new_slots[20:], 0, :LORA], buf[moved, 0, :LORA])


@pytest.mark.parametrize("kind", TREE_KINDS)
def test_no_slot_leaked_or_freed_twice(kind: TreeKind) -> None:
    stack = build(kind)
    _splice(stack, replacement=(7, 8, 9))
    ops = TreeOps(stack.tree)
    ops.evict_all()
    assert stack.allocator.available_size() == stack.size
    total, distinct = free_slot_count(stack)
    assert total == distinct == stack.size


@pytest.mark.parametrize("kind", TREE_KINDS)
def test_written_replacement_is_reused_by_a_generate(kind: TreeKind) -> None:
    stack = build(kind)
    out = _splice(stack, replacement=(7, 8, 9))
    assert out.tokens == tuple([*OLD[:20], 7, 8, 9, *OLD[50:]])
    assert (out.written_tokens, out.rotated_tokens) == (3, 30)
    assert TreeOps(stack.tree).match(list(out.tokens)).length == len(out.tokens) - 1


@pytest.mark.parametrize("kind", TREE_KINDS)
def test_replacement_without_rows_asks_for_a_prefill_then_completes(kind: TreeKind) -> None:
    stack = build(kind)
    stack.prefill(OLD)
    executor = stack.executor()
    edit = Edit(20, 50, (7, 8, 9))
    first = executor.splice(OLD, [edit])
    assert first.pending_prefill == 23  # the prefix and the replacement
    head = list(first.tokens[: first.pending_prefill])
    # What SGLang's generate would do: hit the prefix, prefill the rest, cache it.
    stack.allocator.free(torch.empty(0, dtype=torch.int64))
    _prefill_extension(stack, head)
    second = executor.splice(OLD, [edit])
    assert second.pending_prefill is None
    assert TreeOps(stack.tree).match(list(second.tokens)).length == len(second.tokens) - 1
    assert second.rotated_tokens == 30  # every moved token keeps its old KV, rotated
    TreeOps(stack.tree).evict_all()
    assert free_slot_count(stack) == (stack.size, stack.size)


def _prefill_extension(stack: Stack, tokens: list[int], salt: str | None = None) -> None:
    from array import array

    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    ops = TreeOps(stack.tree)
    match = ops.match(tokens, salt)
    fresh = stack.allocator.alloc(len(tokens) - match.length).to(torch.int64)
    for buf in stack.pool.kv_buffer:
        buf[fresh] = torch.randn(len(fresh), 1, buf.shape[-1]).to(buf.dtype)
    slots = torch.cat([match.slots, fresh])
    key = RadixKey(array("q", tokens), cache_salt=salt)
    stack.tree.insert(InsertParams(key=key, value=slots, prev_prefix_len=match.length))


@pytest.mark.parametrize("kind", TREE_KINDS)
def test_splice_twice_is_idempotent_and_frees_the_duplicates(kind: TreeKind) -> None:
    stack = build(kind)
    out = _splice(stack)
    executor = stack.executor()
    again = executor.splice(OLD, [Edit(*SPAN)])
    assert again.tokens == out.tokens
    TreeOps(stack.tree).evict_all()
    assert free_slot_count(stack) == (stack.size, stack.size)
