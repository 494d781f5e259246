"""``LeylineConnector`` in a real vLLM ``Scheduler`` (loaded through ``kv_connector_module_path``)
and a worker-role connector over real CPU attention KV tensors: matched tokens, pins, the rows
shipped, keys moved and rotated against keys written at the new positions, purges, answers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from vllm.model_executor.layers import rotary_embedding
from vllm.model_executor.layers.rotary_embedding import get_rope

from leyline.vllm.connector import LeylineConnector, LeylineMetadata
from leyline.vllm.kv_layout import backend_cache_write, calibrate
from leyline.vllm.link import Answer, LoadSource, Order, PurgeTarget, RowRun

from ._engine import ROPE_THETA, ROWS, Engine, rope_from_scratch, vllm_config

BS = ROWS.block_size
OLD = list(range(100, 200))  # 3 full blocks cached, 4 tokens not
NEW = OLD[:40] + OLD[60:] + [5, 6, 7]  # old [40, 60) cut: old 60.. move by -20
SPLICE = Order(load=(LoadSource("shared", tuple(OLD), (RowRun(0, 0, 40), RowRun(60, 40, 40))),))


@pytest.fixture
def engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Engine]:
    config = vllm_config(tmp_path)
    from vllm.config import set_current_vllm_config

    monkeypatch.setattr(rotary_embedding, "_ROPE_DICT", {})  # only this model's rope
    with set_current_vllm_config(config):
        get_rope(ROWS.head_size, 2048, True, {"rope_type": "default", "rope_theta": ROPE_THETA})
        yield Engine(config)


def _prefill_old(engine: Engine) -> list[int]:
    """Run ``OLD`` under the shared salt to the end; returns its blocks (cached, freed)."""
    request = engine.add(OLD, salt="shared")
    output, outputs = engine.step()
    assert outputs[request.request_id].finish_reason is not None
    blocks = list(output.scheduled_new_reqs[0].block_ids[0])
    assert engine.sources().cached_prefix("shared", OLD) == blocks[:3]
    return blocks


def test_the_factory_builds_both_roles(engine: Engine) -> None:
    assert isinstance(engine.scheduler.connector, LeylineConnector)
    assert engine.connector.scheduler_side.refusal is None
    assert engine.worker.worker_side.refusal is None


def test_a_splice_loads_kept_rows_rotated_and_answers(engine: Engine) -> None:
    old_blocks = _prefill_old(engine)
    pool = engine.scheduler.kv_cache_manager.block_pool
    splice = engine.add(NEW, salt="private", order=SPLICE)
    other = engine.add(list(range(3000, 3000 + 9 * BS - 1)))  # with the splice: every block

    output = engine.scheduler.schedule()
    # Rows 0..75 come from cached old blocks; old 96.. is not cached: new 76.. is computed.
    assert output.num_scheduled_tokens[splice.request_id] == len(NEW) - 76
    assert output.scheduled_new_reqs[0].num_computed_tokens == 76
    assert all(pool.blocks[b].ref_cnt == 1 for b in old_blocks[:3])  # pinned
    splice_blocks = output.scheduled_new_reqs[0].block_ids[0]
    other_blocks = output.scheduled_new_reqs[1].block_ids[0]
    assert set(old_blocks[:3]).isdisjoint([*splice_blocks, *other_blocks])
    assert pool.get_num_free_blocks() == 0  # all handed out but the pinned sources

    metadata = output.kv_connector_metadata
    assert isinstance(metadata, LeylineMetadata)
    moves = metadata.moves
    assert len(moves) == 76
    # new position 45 <- old 65: (old block 2, offset 1) -> (new block 1, offset 13), -20
    row = list(zip(moves.dst_blocks, moves.dst_offsets, strict=True)).index((splice_blocks[1], 13))
    assert (moves.src_blocks[row], moves.src_offsets[row], moves.shifts[row]) == (
        old_blocks[2],
        1,
        -20,
    )

    engine.load(output)
    dest = torch.arange(76)
    source = torch.where(dest < 40, dest, dest + 20)
    ids = torch.tensor(OLD)[source]
    blocks = torch.tensor(splice_blocks)[dest // BS]
    for name in engine.caches:
        layout = calibrate(backend_cache_write(engine.layers[name]), engine.caches[name], ROWS)
        keys, values = layout.gather(engine.caches[name], blocks, dest % BS)
        want = rope_from_scratch(engine.raw_keys[ids], dest)  # written at the new positions
        torch.testing.assert_close(keys, want, rtol=0, atol=2e-5)
        assert torch.equal(values, engine.values[ids])
        stale = rope_from_scratch(engine.raw_keys[ids], source)
        assert float((stale - want)[40:].abs().max()) > 0.1  # the rotation mattered

    engine.forward(output)
    outputs = engine.finish_step(output)
    assert all(pool.blocks[b].ref_cnt == 0 for b in old_blocks[:3])  # unpinned after the load
    answer = Answer.from_params(outputs[splice.request_id].kv_transfer_params)
    assert answer == Answer(
        reused=76, rotated=36, missing_from=76, fallback_reason="missing_source"
    )
    assert outputs[other.request_id].kv_transfer_params is None  # no order, no answer


def test_the_prompts_last_token_is_never_loaded(engine: Engine) -> None:
    old_blocks = _prefill_old(engine)
    prompt = OLD[:64]
    request = engine.add(
        prompt,
        salt="private",
        order=Order(load=(LoadSource("shared", tuple(OLD), (RowRun(0, 0, 64),)),)),
    )
    connector, pool = engine.connector, engine.scheduler.kv_cache_manager.block_pool
    assert connector.get_num_new_matched_tokens(request, 0) == (63, False)
    assert connector.get_num_new_matched_tokens(request, 32) == (31, False)
    assert [pool.blocks[b].ref_cnt for b in old_blocks[:2]] == [1, 1]  # pinned once
    output, outputs = engine.step()
    assert output.num_scheduled_tokens[request.request_id] == 1
    assert Answer.from_params(outputs[request.request_id].kv_transfer_params) == Answer(
        reused=63, rotated=0
    )
    assert [pool.blocks[b].ref_cnt for b in old_blocks[:2]] == [0, 0]


def test_an_unscheduled_order_is_unpinned_when_it_finishes(engine: Engine) -> None:
    old_blocks = _prefill_old(engine)
    request = engine.add(NEW, salt="private", order=SPLICE)
    pool = engine.scheduler.kv_cache_manager.block_pool
    assert engine.connector.get_num_new_matched_tokens(request, 0) == (76, False)
    assert pool.blocks[old_blocks[0]].ref_cnt == 1
    from vllm.v1.request import RequestStatus

    engine.scheduler.finish_requests(request.request_id, RequestStatus.FINISHED_ABORTED)
    assert pool.blocks[old_blocks[0]].ref_cnt == 0


def test_a_purge_order_evicts_what_sources_finds(engine: Engine) -> None:
    old_blocks = _prefill_old(engine)
    engine.add(OLD, salt="other")
    engine.step()
    purge = engine.add([1, 2, 3], order=Order(purge=(PurgeTarget("shared", tuple(OLD), 40),)))
    sources = engine.sources()
    assert sources.cached_prefix("shared", OLD) == old_blocks[:1]  # evicted on arrival
    assert len(sources.cached_prefix("other", OLD)) == 3
    _, outputs = engine.step()
    assert Answer.from_params(outputs[purge.request_id].kv_transfer_params) == Answer(
        purged_blocks=2
    )


def test_a_worker_that_cannot_write_rows_refuses_every_order(engine: Engine) -> None:
    old_blocks = _prefill_old(engine)
    engine.worker.worker_side.register(
        engine.caches,
        lambda name: lambda k, v, c, s: None,  # a write op that writes nothing
        ROWS,
        lambda: pytest.fail("the band is not read after a failed calibration"),
    )
    assert engine.worker.worker_side.refusal is not None
    engine.config.kv_transfer_config.kv_load_failure_policy = "recompute"
    engine.scheduler.recompute_kv_load_failures = True
    splice = engine.add(NEW, salt="private", order=SPLICE)
    output = engine.scheduler.schedule()
    engine.load(output)
    engine.forward(output)
    engine.finish_step(output)
    assert splice.num_computed_tokens == 0  # vLLM recomputes the refused rows
    pool = engine.scheduler.kv_cache_manager.block_pool
    assert all(pool.blocks[b].ref_cnt == 0 for b in old_blocks[:3])
    later = engine.add(NEW, salt="private2", order=SPLICE)
    assert engine.connector.get_num_new_matched_tokens(later, 0) == (0, False)
    _, outputs = engine.step()
    answer = Answer.from_params(outputs[splice.request_id].kv_transfer_params)
    assert answer is not None and answer.fallback_reason == "unsupported_layout"
    assert answer.reused == 0
