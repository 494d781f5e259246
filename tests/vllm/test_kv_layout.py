"""``kv_layout`` against vLLM's CPU attention write op: calibration, row round trips, and
keys moved to new positions compared with keys rotated there from scratch."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from leyline.core.errors import SpliceUnsupportedError
from leyline.engine.rope import Pairing
from leyline.engine.rope_band import RopeBand
from leyline.protocol.fallback import FallbackReason
from leyline.vllm.kv_layout import (
    CacheWrite,
    KVLayout,
    RowShape,
    backend_cache_write,
    calibrate,
    shift_keys,
)

from ._cpu_attention import cpu_attention_layer, kv_cache

ROWS = RowShape(block_size=32, num_kv_heads=2, head_size=64)
NUM_BLOCKS = 8


def _backend(dtype: torch.dtype) -> tuple[CacheWrite, KVLayout]:
    layer = cpu_attention_layer(dtype, ROWS)
    write = backend_cache_write(layer)
    return write, calibrate(write, kv_cache(NUM_BLOCKS, ROWS, dtype), ROWS)


def _random_rows(n: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shape = (n, ROWS.num_kv_heads, ROWS.head_size)
    return tuple(torch.randn(shape, generator=generator).to(dtype) for _ in range(2))  # type: ignore[return-value]


def _slots(count: int, first_block: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` distinct (block, offset) pairs in the four blocks from ``first_block``."""
    generator = torch.Generator().manual_seed(seed)
    slots = torch.randperm(4 * ROWS.block_size, generator=generator)[:count]
    return first_block + slots // ROWS.block_size, slots % ROWS.block_size


def _slot_mapping(blocks: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return blocks * ROWS.block_size + offsets


def test_calibration_decodes_the_vec_layout_keys_transposed() -> None:
    layer = cpu_attention_layer(torch.float32, ROWS)
    if layer.isa != "vec":
        pytest.skip(f"this CPU writes with the {layer.isa!r} ISA")
    layout = calibrate(backend_cache_write(layer), kv_cache(2, ROWS, torch.float32), ROWS)
    bs, dim = ROWS.block_size, ROWS.head_size
    t = torch.arange(bs).view(bs, 1, 1)
    h = torch.arange(ROWS.num_kv_heads).view(1, -1, 1)
    j = torch.arange(dim).view(1, 1, dim)
    head_base = h * 2 * bs * dim
    assert torch.equal(layout.keys, (head_base + j * bs + t).expand_as(layout.keys))
    assert torch.equal(layout.values, (head_base + bs * dim + t * dim + j).expand_as(layout.keys))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_round_trip_bitwise(dtype: torch.dtype) -> None:
    write, layout = _backend(dtype)
    keys, values = _random_rows(40, dtype, seed=1)
    blocks, offsets = _slots(40, first_block=0, seed=2)
    by_backend = kv_cache(NUM_BLOCKS, ROWS, dtype)
    write(keys, values, by_backend, _slot_mapping(blocks, offsets))

    got_keys, got_values = layout.gather(by_backend, blocks, offsets)
    assert torch.equal(got_keys, keys) and torch.equal(got_values, values)

    by_layout = kv_cache(NUM_BLOCKS, ROWS, dtype)
    layout.scatter(by_layout, blocks, offsets, keys, values)
    assert torch.equal(by_layout, by_backend)  # exactly where the backend writes

    # A move with no shift: keys and values land bitwise in other blocks.
    to_blocks, to_offsets = _slots(40, first_block=4, seed=3)
    no_shift = torch.zeros(40, dtype=torch.int64)
    unshifted = shift_keys(got_keys, no_shift, RopeBand(torch.ones(16), "half"))
    layout.scatter(by_backend, to_blocks, to_offsets, unshifted, got_values)
    moved_keys, moved_values = layout.gather(by_backend, to_blocks, to_offsets)
    assert torch.equal(moved_keys, keys) and torch.equal(moved_values, values)


def _rope_from_scratch(
    raw: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, pairing: Pairing
) -> torch.Tensor:
    """Keys ``raw`` rotated to ``positions`` in fp64 (angles included), cast to fp32."""
    half = inv_freq.numel()
    angles = positions.double()[:, None, None] * inv_freq.double()
    cos, sin = angles.cos(), angles.sin()
    out = raw.double().clone()
    if pairing == "half":
        first, second = slice(0, half), slice(half, 2 * half)
    else:
        first, second = slice(0, 2 * half, 2), slice(1, 2 * half, 2)
    a, b = out[..., first].clone(), out[..., second].clone()
    out[..., first] = a * cos - b * sin
    out[..., second] = b * cos + a * sin
    return out.float()


@pytest.mark.parametrize("pairing", ["half", "interleaved"])
def test_moved_keys_match_keys_recomputed_at_new_positions(pairing: Pairing) -> None:
    write, layout = _backend(torch.float32)
    n, rotary_dim = 48, 32  # a partial band: dims 32..63 of each head are not rotated
    inv_freq = 10000.0 ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    inv_freq = inv_freq.float()
    raw, values = _random_rows(n, torch.float32, seed=4)
    generator = torch.Generator().manual_seed(5)
    old = torch.randint(600, 3000, (n,), generator=generator)
    shifts = torch.randint(-500, 500, (n,), generator=generator)
    shifts[::7] = 0
    from_blocks, from_offsets = _slots(n, first_block=0, seed=6)
    to_blocks, to_offsets = _slots(n, first_block=4, seed=7)
    cache = kv_cache(NUM_BLOCKS, ROWS, torch.float32)
    write(
        _rope_from_scratch(raw, old, inv_freq, pairing),
        values,
        cache,
        _slot_mapping(from_blocks, from_offsets),
    )

    keys, got_values = layout.gather(cache, from_blocks, from_offsets)
    shifted = shift_keys(keys, shifts, RopeBand(inv_freq, pairing))
    layout.scatter(cache, to_blocks, to_offsets, shifted, got_values)
    moved_keys, moved_values = layout.gather(cache, to_blocks, to_offsets)

    want = _rope_from_scratch(raw, old + shifts, inv_freq, pairing)
    torch.testing.assert_close(moved_keys, want, rtol=0, atol=2e-5)
    assert torch.equal(moved_keys[..., rotary_dim:], keys[..., rotary_dim:])
    assert torch.equal(moved_values, values)
    assert float((keys - want)[shifts != 0].abs().max()) > 0.1  # the rotation is needed


def _refusal(call: Callable[[], object]) -> SpliceUnsupportedError:
    with pytest.raises(SpliceUnsupportedError) as caught:
        call()
    assert caught.value.reason == FallbackReason.unsupported_layout
    return caught.value


def _fails(*_: torch.Tensor) -> None:
    raise NotImplementedError("no such ISA")


_BROKEN_WRITES: dict[str, Callable[[CacheWrite], CacheWrite]] = {
    "transforms values": lambda real: lambda k, v, c, s: real(-k, v, c, s),
    "writes nothing": lambda real: lambda k, v, c, s: None,
    "ignores the block": lambda real: lambda k, v, c, s: real(k, v, c, s % ROWS.block_size),
    "drops a row": lambda real: lambda k, v, c, s: real(k[:-1], v[:-1], c, s[:-1]),
    "one row everywhere": lambda real: lambda k, v, c, s: real(k[:1].expand_as(k), v, c, s),
    "raises": lambda real: _fails,
}


@pytest.mark.parametrize("broken", sorted(_BROKEN_WRITES))
def test_calibration_refuses_a_layout_it_cannot_decode(broken: str) -> None:
    real = backend_cache_write(cpu_attention_layer(torch.float32, ROWS))
    write = _BROKEN_WRITES[broken](real)
    _refusal(lambda: calibrate(write, kv_cache(2, ROWS, torch.float32), ROWS))


def test_quantized_caches_and_other_tensors_are_refused() -> None:
    write, layout = _backend(torch.float32)
    quantized = kv_cache(2, ROWS, torch.float32).to(torch.uint8)
    assert "quantized" in _refusal(lambda: calibrate(write, quantized, ROWS)).message
    wider = torch.zeros(NUM_BLOCKS, ROWS.num_kv_heads, ROWS.block_size, 4 * ROWS.head_size)
    one = torch.zeros(1, dtype=torch.int64)
    _refusal(lambda: layout.gather(wider, one, one))
    strided = kv_cache(NUM_BLOCKS, ROWS, torch.float32).transpose(2, 3)
    strided = strided.contiguous().transpose(2, 3)  # same shape, blocks not row-major
    _refusal(lambda: layout.scatter(strided, one, one, *_random_rows(1, torch.float32, 8)))
