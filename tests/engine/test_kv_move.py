"""Rows moved inside one buffer by the rope kernel (``rope.move_rotated``, ``rope.move_rows``).

The reference for every case is computed from an untouched clone: ``rotate_into`` (itself
checked against eager ops and an fp64 formula in ``test_rope_kernel``) of the source rows
into a fresh tensor, or the source rows themselves for ``move_rows``. The move must equal
it bitwise at the destination and leave every position outside the destination as it was,
whatever the overlap between source and destination.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from leyline.engine.cpu import rope_kernel
from leyline.engine.rope import Pairing, move_rotated, move_rows, rotate_into

CAP = 700  # positions a buffer holds
HEADS = 3


@pytest.fixture(autouse=True)
def _kernel() -> Iterator[None]:
    if not rope_kernel.status().available:
        pytest.skip(f"fused rope kernel unavailable: {rope_kernel.status().detail}")
    yield


def _freqs(half: int) -> torch.Tensor:
    return (10000.0 ** (-torch.arange(half, dtype=torch.float64) / half)).float()


def _buffer(dtype: torch.dtype, dim: int = 64, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, HEADS, CAP, dim, generator=g).to(dtype)


def _outside_unchanged(after: torch.Tensor, before: torch.Tensor, lo: int, hi: int) -> bool:
    return torch.equal(after[:, :, :lo], before[:, :, :lo]) and torch.equal(
        after[:, :, hi:], before[:, :, hi:]
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pairing", ["half", "interleaved"])
# (source start, destination start, length): left and right, overlapping by all but one
# row, by a few, not at all, and shifted by one row
@pytest.mark.parametrize(
    "src0,dst0,n", [(300, 5, 395), (10, 20, 600), (100, 99, 500), (400, 0, 300), (0, 1, 699)]
)
def test_move_rotated_equals_rotation_from_a_copy(
    dtype: torch.dtype, pairing: Pairing, src0: int, dst0: int, n: int
) -> None:
    t = _buffer(dtype)
    before = t.clone()
    delta, inv = dst0 - src0, _freqs(32)
    want = rotate_into(
        torch.empty(1, HEADS, n, 64, dtype=dtype),
        before[:, :, src0 : src0 + n],
        delta,
        inv,
        pairing,
    )
    assert move_rotated([(t[:, :, dst0 : dst0 + n], t[:, :, src0 : src0 + n])], delta, inv, pairing)
    assert torch.equal(t[:, :, dst0 : dst0 + n], want)
    assert _outside_unchanged(t, before, dst0, dst0 + n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_band_with_passthrough_dims(dtype: torch.dtype) -> None:
    """A rotary band inside a wider row (MLA's rope dims after the latent; partial rotary):
    the band rotated, the dims around it moved bitwise."""
    t = _buffer(dtype, dim=96, seed=3)
    before = t.clone()
    inv, src0, dst0, n = _freqs(16), 250, 40, 400
    want = rotate_into(
        torch.empty(1, HEADS, n, 96, dtype=dtype),
        before[:, :, src0 : src0 + n],
        dst0 - src0,
        inv,
        "half",
        offset=48,
    )
    views = [(t[:, :, dst0 : dst0 + n], t[:, :, src0 : src0 + n])]
    assert move_rotated(views, dst0 - src0, inv, "half", offset=48)
    assert torch.equal(t[:, :, dst0 : dst0 + n], want)
    assert torch.equal(t[:, :, dst0 : dst0 + n, :48], before[:, :, src0 : src0 + n, :48])
    assert _outside_unchanged(t, before, dst0, dst0 + n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("src0,dst0,n", [(300, 5, 395), (10, 11, 600)])
def test_move_rows_is_bitwise_and_takes_many_buffers(
    dtype: torch.dtype, src0: int, dst0: int, n: int
) -> None:
    buffers = [_buffer(dtype, seed=s) for s in range(5)]  # a layer's values each
    before = [b.clone() for b in buffers]
    pairs = [(b[:, :, dst0 : dst0 + n], b[:, :, src0 : src0 + n]) for b in buffers]
    assert move_rows(pairs)
    for after, old in zip(buffers, before, strict=True):
        assert torch.equal(after[:, :, dst0 : dst0 + n], old[:, :, src0 : src0 + n])
        assert _outside_unchanged(after, old, dst0, dst0 + n)


def test_special_values_survive_the_row_move() -> None:
    t = _buffer(torch.float32)
    t[0, 1, 400, :4] = torch.tensor([float("nan"), float("inf"), -0.0, float("-inf")])
    before = t.clone()
    assert move_rows([(t[:, :, 100:400], t[:, :, 200:500])])
    assert torch.equal(t[:, :, 100:400].view(torch.int32), before[:, :, 200:500].view(torch.int32))


def test_refusals_write_nothing() -> None:
    """Every case the kernel cannot take safely returns False with the buffers untouched."""
    t = _buffer(torch.float32)
    other = _buffer(torch.float32, seed=1)
    before, before_other = t.clone(), other.clone()
    inv = _freqs(32)
    one = (t[:, :, 0:100], t[:, :, 50:150])

    def heads(at: int) -> torch.Tensor:  # 3 heads of 100 rows, 50 rows apart
        return t.view(-1).as_strided((3, 100, 64), (50 * 64, 64, 1), at)

    cases = {
        "two views of different storages": [(other[:, :, 0:100], t[:, :, 50:150])],
        "a storage in two pairs": [one, (t[:, :, 200:300], t[:, :, 250:350])],
        "shapes differ": [(t[:, :, 0:100], t[:, :, 50:151])],
        "strides differ": [(t[:, :, 0:100:2], t[:, :, 50:150])],
        "not a whole row apart": [(t.view(-1)[1:6401].view(100, 64), t[0, 0, 0:100])],
        "heads that would reach each other": [(heads(64), heads(0))],
        "a good pair beside a bad one": [one, (other[:, :, 0:10], t[:, :, 600:610])],
    }
    for what, pairs in cases.items():
        assert not move_rotated(pairs, -50, inv, "half"), what
        assert not move_rows(pairs), what
    assert not move_rotated([one], 0, inv, "half")  # nothing to rotate: a plain move's job
    assert torch.equal(t, before) and torch.equal(other, before_other)


def test_describe_move_checks_the_slices_reach() -> None:
    t = _buffer(torch.float32)
    # heads CAP positions apart: a move may reach the end of its head, not the next one
    assert rope_kernel.describe_move(t[:, :, 0:600], t[:, :, 10:610]) is not None
    assert rope_kernel.describe_move(t[0, :, 0 : CAP - 1], t[0, :, 1:CAP]) is not None
    # heads 697 rows apart, 699 rows each (they overlap): refused
    close = t.view(-1).as_strided((3, CAP - 1, 64), ((CAP - 3) * 64, 64, 1))
    assert rope_kernel.describe_move(close[:, 0 : CAP - 2], close[:, 1 : CAP - 1]) is None
    # heads 698 rows apart: rows merge into one plain sweep over all heads, which is safe
    merged = t.view(-1).as_strided((3, CAP - 1, 64), ((CAP - 2) * 64, 64, 1))
    assert rope_kernel.describe_move(merged[:, 0 : CAP - 2], merged[:, 1 : CAP - 1]) is not None
    # heads 699 rows apart: the same move ends where the next head begins
    touching = t.view(-1).as_strided((3, CAP - 1, 64), ((CAP - 1) * 64, 64, 1))
    views = (touching[:, 0 : CAP - 2], touching[:, 1 : CAP - 1])
    assert rope_kernel.describe_move(*views) is not None
    # a single row, shifted by less than its width, is refused
    flat = t.view(-1)
    assert rope_kernel.describe_move(flat[32:96].view(1, 64), flat[0:64].view(1, 64)) is None
    assert rope_kernel.describe_move(flat[64:128].view(1, 64), flat[0:64].view(1, 64)) is not None
