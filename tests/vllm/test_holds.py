"""Skill holds in a real vLLM ``Scheduler``: a hold order keeps the blocks its request
computed out of eviction (a reference of its own in vLLM's ``BlockPool``), a compose loads
its rows by the hold's key with keys rotated, a release gives every reference back (the
pool's free count returns to where it was), and the room is a quarter of the pool."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from vllm.model_executor.layers import rotary_embedding
from vllm.model_executor.layers.rotary_embedding import get_rope

from leyline.vllm.holds import HELD_SHARE
from leyline.vllm.kv_layout import backend_cache_write, calibrate
from leyline.vllm.link import Answer, HoldOrder, LoadSource, Order, PurgeTarget, RowRun

from ._engine import NUM_BLOCKS, ROPE_THETA, ROWS, Engine, rope_from_scratch, vllm_config

BS = ROWS.block_size
ANCHOR = list(range(300, 310))
BLOCK = list(range(400, 450))
SKILL = ANCHOR + BLOCK  # 60 rows: one full block and a partial one


@pytest.fixture
def engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Engine]:
    config = vllm_config(tmp_path)
    from vllm.config import set_current_vllm_config

    monkeypatch.setattr(rotary_embedding, "_ROPE_DICT", {})
    with set_current_vllm_config(config):
        get_rope(ROWS.head_size, 2048, True, {"rope_type": "default", "rope_theta": ROPE_THETA})
        yield Engine(config)


def _run(engine: Engine, tokens: list[int], salt: str | None, order: Order) -> Answer | None:
    request = engine.add(tokens, salt=salt, order=order)
    _, outputs = engine.step()
    return Answer.from_params(outputs[request.request_id].kv_transfer_params)


def _hold(engine: Engine, key: str, tokens: list[int], **kw: object) -> Answer | None:
    order = Order(hold=HoldOrder(key, len(tokens), **kw))  # type: ignore[arg-type]
    return _run(engine, tokens, "tenant", order)


def test_a_hold_keeps_its_blocks_out_of_eviction_through_a_purge(engine: Engine) -> None:
    pool = engine.scheduler.kv_cache_manager.block_pool
    free = pool.get_num_free_blocks()
    answer = _hold(engine, "k", SKILL)
    assert answer is not None and answer.held == len(SKILL) and answer.hold_error is None
    held = engine.connector.scheduler_side._holds.get("k")  # type: ignore[union-attr]
    assert held is not None and len(held.blocks) == 2  # the partial last block too
    assert [b.ref_cnt for b in held.blocks] == [1, 1]  # the hold's own reference
    assert pool.get_num_free_blocks() == free - 2
    # A purge of the same tokens drops the full block's hash, never the data it holds.
    _run(engine, [1], "carrier", Order(purge=(PurgeTarget("tenant", tuple(SKILL), 0),)))
    assert engine.sources().cached_prefix("tenant", SKILL) == []


def test_a_compose_loads_the_held_rows_rotated(engine: Engine) -> None:
    _hold(engine, "k", SKILL)
    _run(engine, [1], "carrier", Order(purge=(PurgeTarget("tenant", tuple(SKILL), 0),)))
    context = list(range(1000, 1064))  # two full blocks, computed and cached first
    _run(engine, [*context, 5], "private", Order())
    new = context + BLOCK + [9, 9]
    at = len(context)
    body = RowRun(len(ANCHOR), at, len(BLOCK))  # a seam of 0: the whole block borrowed
    compose = engine.add(
        new, salt="private", order=Order(load=(LoadSource(None, (), (body,), "k"),))
    )
    output = engine.scheduler.schedule()
    assert output.scheduled_new_reqs[0].num_computed_tokens == at + len(BLOCK)
    blocks = output.scheduled_new_reqs[0].block_ids[0]
    engine.load(output)
    dest = torch.arange(at, at + len(BLOCK))
    ids = torch.tensor(BLOCK)
    where = torch.tensor(blocks)[dest // BS]
    for name in engine.caches:
        layout = calibrate(backend_cache_write(engine.layers[name]), engine.caches[name], ROWS)
        keys, values = layout.gather(engine.caches[name], where, dest % BS)
        want = rope_from_scratch(engine.raw_keys[ids], dest)  # as if computed at the block
        torch.testing.assert_close(keys, want, rtol=0, atol=2e-5)
        assert torch.equal(values, engine.values[ids])
    engine.forward(output)
    outputs = engine.finish_step(output)
    answer = Answer.from_params(outputs[compose.request_id].kv_transfer_params)
    assert answer == Answer(reused=len(BLOCK), rotated=len(BLOCK))


def test_a_release_gives_every_reference_back_and_later_loads_miss(engine: Engine) -> None:
    pool = engine.scheduler.kv_cache_manager.block_pool
    free = pool.get_num_free_blocks()
    _hold(engine, "k", SKILL)
    blocks = engine.connector.scheduler_side._holds.get("k").blocks  # type: ignore[union-attr]
    _run(engine, [1], "carrier", Order(release=("k",)))
    assert [b.ref_cnt for b in blocks] == [0, 0]
    assert pool.get_num_free_blocks() == free  # nothing leaked (the carrier's block freed)
    body = RowRun(len(ANCHOR), 0, 8)
    answer = _run(engine, BLOCK[:9], "x", Order(load=(LoadSource(None, (), (body,), "k"),)))
    assert answer is not None and answer.missing_from == 0
    assert answer.fallback_reason == "missing_source"


def test_holds_take_a_quarter_of_the_pool_releasing_idle_ones_lru(engine: Engine) -> None:
    cap = NUM_BLOCKS // HELD_SHARE  # 4 blocks
    one = list(range(500, 500 + 2 * BS))  # 2 blocks each
    two = list(range(600, 600 + 2 * BS))
    three = list(range(700, 700 + 2 * BS))
    assert _hold(engine, "one", one).held == len(one)  # type: ignore[union-attr]
    assert _hold(engine, "two", two).held == len(two)  # type: ignore[union-attr]
    side = engine.connector.scheduler_side
    assert side._holds is not None and side._holds.held_blocks() == cap
    refused = _hold(engine, "three", three)
    assert refused is not None and refused.held == 0 and refused.hold_error == "limit_exceeded"
    assert side._holds.held_blocks() == cap and side._holds.get("three") is None
    made_room = _hold(engine, "three", three, evictable=("one", "two"))
    assert made_room is not None and made_room.held == len(three)
    assert made_room.released == ("one",)  # the least recently used, only as many as needed
    assert side._holds.get("one") is None and side._holds.get("two") is not None
    # A replacement does not count the hold it replaces.
    again = _hold(engine, "two-new", list(range(800, 800 + 2 * BS)), replaces="two")
    assert again is not None and again.held == 2 * BS and again.released == ()
    assert side._holds.get("two") is None and side._holds.held_blocks() == cap
    for key in ("three", "two-new"):
        _run(engine, [1], "carrier", Order(release=(key,)))
    assert side._holds.held_blocks() == 0
    pool = engine.scheduler.kv_cache_manager.block_pool
    assert all(b.ref_cnt == 0 for b in pool.blocks[1:])  # vLLM's invariant: all free at idle
