"""The compiled kernel's query runs (``AttentionKernel.attend_runs``): several queries, each
seeing its own prefix of each key segment, against an fp64 softmax over exactly those keys;
and the engine's two callers (``attention._by_runs``, ``segment_attention``) on it."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest
import torch

from leyline.engine.cpu import attention_kernel, kernel_build
from leyline.engine.cpu.attention_kernel import AttentionKernel, PreparedCall
from leyline.engine.engine import Engine
from leyline.engine.session import SessionCache
from leyline.protocol.algebra import Edit
from leyline.protocol.directives import Mode

from ._kernels import benchmark_lines, portable_attention_kernel

Segment = tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]


@pytest.fixture(scope="module")
def kernel() -> Iterator[AttentionKernel]:
    """The kernel with its runs taken wherever they are eligible (``run_choice`` mode
    ``kernel``): these tests check the kernel's path, whichever is faster on this CPU."""
    loaded = attention_kernel.load()
    if loaded is None:
        pytest.skip(f"attention kernel unavailable: {attention_kernel.status().detail}")
    was = loaded.run_choice.mode
    loaded.run_choice.mode = "kernel"
    yield loaded
    loaded.run_choice.mode = was


def _segment(
    heads: int, kv_heads: int, m: int, dim: int, value_dim: int, n: int, dtype: torch.dtype,
    seed: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    capacity = n + 7  # views of a bigger buffer, as the engine's caches are
    keys = torch.randn(1, kv_heads, capacity, dim, generator=g).to(dtype)[:, :, :n]
    values = torch.randn(1, kv_heads, capacity, value_dim, generator=g).to(dtype)[:, :, :n]
    # a query slice of a longer run, as _by_runs hands it over (not contiguous)
    query = torch.randn(1, heads, m + 3, dim, generator=g).to(dtype)[:, :, 1 : m + 1]
    return query, keys, values


def _reference(segments: list[Segment], scale: float) -> torch.Tensor:
    """fp64: per query, one softmax over the keys it sees in every segment."""
    heads, m = segments[0][0].shape[1], segments[0][0].shape[2]
    out = torch.empty(1, heads, m, segments[0][2].shape[-1], dtype=torch.float64)
    for j in range(m):
        scores, vals = [], []
        for q, k, v, seen in segments:
            group = heads // k.shape[1]
            kk = k[0, :, : seen[j]].double().repeat_interleave(group, 0)
            vv = v[0, :, : seen[j]].double().repeat_interleave(group, 0)
            scores.append(torch.einsum("hd,hnd->hn", q[0, :, j].double(), kk) * scale)
            vals.append(vv)
        w = torch.softmax(torch.cat(scores, -1), -1)
        out[0, :, j] = torch.einsum("hn,hnd->hd", w, torch.cat(vals, 1))
    return out


SHAPES = [
    (9, 3, 16, 64, 64, 1040),  # SmolLM2-135M, a 16-token replacement after 1k tokens
    (9, 3, 5, 64, 64, 300),  # an odd row count: a row without a partner
    (8, 2, 3, 32, 48, 129),  # a chunk boundary, value width 48 (16-lane tail)
    (4, 1, 7, 24, 16, 90),  # widths off the 16-lane path: the row-by-row code
    (6, 6, 40, 16, 16, 700),  # no grouping, 40 queries
]


@pytest.mark.parametrize(("heads", "kv", "m", "dim", "value_dim", "n"), SHAPES)
@pytest.mark.parametrize("threads", [1, 2])
def test_a_causal_run_equals_the_fp64_softmax(
    kernel: AttentionKernel, heads: int, kv: int, m: int, dim: int, value_dim: int, n: int,
    threads: int,
) -> None:  # fmt: skip
    q, k, v = _segment(heads, kv, m, dim, value_dim, n, torch.float32, n)
    causal = [n - m + 1 + j for j in range(m)]
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for scale in (dim**-0.5, 2.0):  # 2.0: peaked scores, the running max moves
            got = kernel.attend_runs([(q, k, v, causal)], scale)
            want = _reference([(q, k, v, causal)], scale)
            assert got.shape == (1, heads, m, value_dim) and got.dtype == torch.float32
            assert (got.double() - want).abs().max() < 2e-5
    finally:
        torch.set_num_threads(previous)


def test_segments_with_their_own_queries_and_limits_merge_exactly(
    kernel: AttentionKernel,
) -> None:
    """An in-place edit's replacement: a prefix seen whole, a moved segment seen whole with
    another query, the side buffer causally; some queries see nothing of a segment."""
    m = 6
    a = _segment(9, 3, m, 64, 64, 500, torch.float32, 1)
    b = _segment(9, 3, m, 64, 64, 257, torch.float32, 2)
    c = _segment(9, 3, m, 64, 64, m, torch.float32, 3)
    segments: list[Segment] = [
        (*a, [500] * m),
        (*b, [0, 0, 257, 100, 257, 1]),
        (*c, [j + 1 for j in range(m)]),
    ]
    got = kernel.attend_runs(segments, 0.125)
    assert (got.double() - _reference(segments, 0.125)).abs().max() < 2e-5


@pytest.mark.parametrize(("heads", "kv", "m", "dim", "value_dim", "n"), SHAPES[:3])
def test_bf16_is_the_fp64_softmax_of_its_inputs_within_fp32_sums(
    kernel: AttentionKernel, heads: int, kv: int, m: int, dim: int, value_dim: int, n: int
) -> None:
    q, k, v = _segment(heads, kv, m, dim, value_dim, n, torch.bfloat16, n + 1)
    causal = [n - m + 1 + j for j in range(m)]
    got = kernel.attend_runs([(q, k, v, causal)], dim**-0.5).double()
    want = _reference([(q, k, v, causal)], dim**-0.5)
    assert ((got - want).abs() <= 1e-4 * want.abs() + 2e-5).all()


@pytest.mark.parametrize(("heads", "kv", "m", "dim", "n"), [(9, 3, 6, 64, 500), (16, 1, 5, 32, 70)])
def test_bf16_segments_with_limits_are_the_fp64_softmax_within_fp32_sums(
    kernel: AttentionKernel, heads: int, kv: int, m: int, dim: int, n: int
) -> None:
    """Several bf16 segments with their own queries and limits (on the tile unit where the
    kernel has it: keys in groups of 16 with a partial last group, 80 rows = five tiles of
    rows for the second shape), against fp64."""
    a = _segment(heads, kv, m, dim, dim, n, torch.bfloat16, 4)
    b = _segment(heads, kv, m, dim, dim, 37, torch.bfloat16, 5)
    c = _segment(heads, kv, m, dim, dim, m, torch.bfloat16, 6)
    segments: list[Segment] = [
        (*a, [n] * m),
        (*b, [0, 37, 5, 0, 17, 1][:m]),
        (*c, [j + 1 for j in range(m)]),
    ]
    got = kernel.attend_runs(segments, dim**-0.5).double()
    want = _reference(segments, dim**-0.5)
    assert ((got - want).abs() <= 1e-4 * want.abs() + 2e-5).all()


def test_bf16_runs_score_on_the_tile_unit_where_the_cpu_has_it(kernel: AttentionKernel) -> None:
    """Built with the AMX flags exactly where the CPU and compiler have them; where built so
    on Linux, the process is granted the tile state and the kernel says it uses it."""
    flags = attention_kernel._flags(True)
    amx = (
        "-mavx512f" in flags
        and "amx_bf16" in kernel_build.cpu_flags()
        and kernel_build.compiler_accepts(*kernel_build.AMX_FLAGS)
    )
    assert ("-mamx-bf16" in flags) == amx
    if amx and sys.platform == "linux":
        assert kernel.amx
    if not amx:
        assert not kernel.amx


def test_the_portable_build_agrees(kernel: AttentionKernel) -> None:
    """The same source without the x86 vector flags (the code other CPUs run) gives the
    same answer, and does not claim the vectorised path."""
    portable = portable_attention_kernel()
    assert not portable.runs_vectorised
    q, k, v = _segment(9, 3, 16, 64, 64, 400, torch.float32, 4)
    causal = [400 - 16 + 1 + j for j in range(16)]
    assert not portable.takes_run(q, k, v)
    got = portable.attend_runs([(q, k, v, causal)], 0.125)
    assert (got - kernel.attend_runs([(q, k, v, causal)], 0.125)).abs().max() < 1e-5


def test_refuses_what_it_does_not_take(kernel: AttentionKernel) -> None:
    q, k, v = _segment(9, 3, 4, 64, 64, 50, torch.float32, 5)
    ok = [47, 48, 49, 50]
    with pytest.raises(ValueError, match="within"):
        kernel.attend_runs([(q, k, v, [47, 48, 49, 51])], None)  # past the segment
    with pytest.raises(ValueError, match="within"):
        kernel.attend_runs([(q, k, v, ok[:3])], None)  # a count missing
    with pytest.raises(ValueError, match="at least one key"):
        kernel.attend_runs([(q, k, v, [0, 48, 49, 50])], None)
    with pytest.raises(ValueError, match="not eligible"):
        kernel.attend_runs([(q, k.double(), v.double(), ok)], None)
    many = torch.zeros(1, 9, attention_kernel.MAX_RUN_ROWS // 3 + 1, 64)
    assert not attention_kernel.run_eligible(many, k, v)
    assert kernel.takes_run(q, k, v) == kernel.runs_vectorised
    assert not kernel.takes_run(q[:, :, :1], k, v)  # one query: the single-query kernel's


def test_the_engine_sends_a_replacement_run_to_the_kernel(
    kernel: AttentionKernel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``forward_at``'s runs: the replacement (16 queries) on the kernel, equal to the
    masked SDPA it replaces within fp32 noise; the last token on the single-query kernel."""
    if not kernel.runs_vectorised:
        pytest.skip("query runs stay on SDPA on this CPU")
    from leyline.engine import attention
    from leyline.engine.forward import causal_mask_at, query_runs

    g = torch.Generator().manual_seed(6)
    total = 900  # the replacement sees 616 keys, past RUN_MIN_KEYS
    positions = [*range(600, 616), total - 1]
    keys = torch.randn(1, 3, total, 64, generator=g)
    values = torch.randn(1, 3, total, 64, generator=g)
    query = torch.randn(1, 9, len(positions), 64, generator=g)
    mask = causal_mask_at(torch.tensor(positions), total, torch.float32, torch.device("cpu"))
    runs = query_runs(positions)
    calls: list[int] = []
    real = AttentionKernel.attend_runs

    def spy(
        self: AttentionKernel, segments: list[Segment], scale: float | None, *, checked: bool
    ) -> torch.Tensor:
        calls.append(segments[0][0].shape[2])
        return real(self, segments, scale, checked=checked)

    monkeypatch.setattr(AttentionKernel, "attend_runs", spy)
    got = attention._by_runs(query, keys, values, mask, None, runs)
    assert calls == [16]
    want = torch.nn.functional.scaled_dot_product_attention(
        query, keys, values, attn_mask=mask, enable_gqa=True
    ).transpose(1, 2)
    assert (got - want).abs().max() < 1e-5


def test_an_in_place_replacement_takes_one_call_equal_to_the_merged_segments(
    kernel: AttentionKernel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``segmented_attention``'s run of 16 (prefix in place, a moved segment with its own
    query, the side buffer causally) in one kernel call equals its segment-by-segment
    flash path merged by log-sum-exp, and a short run stays on that path."""
    if not kernel.runs_vectorised:
        pytest.skip("query runs stay on SDPA on this CPU")
    from leyline.engine.forward import causal_mask_at
    from leyline.engine.segment_attention import (
        KeptSegment,
        SegmentPlan,
        SegmentRun,
        segmented_attention,
    )

    g = torch.Generator().manual_seed(7)
    keys, values = (
        torch.randn(1, 3, 1000, 64, generator=g),
        torch.randn(1, 3, 1000, 64, generator=g),
    )
    side_k, side_v = torch.randn(1, 3, 17, 64, generator=g), torch.randn(1, 3, 17, 64, generator=g)
    query = torch.randn(1, 9, 16, 64, generator=g)
    side_mask = causal_mask_at(torch.arange(16), 17, torch.float32, torch.device("cpu"))
    kept = (KeptSegment(0, 600, 0), KeptSegment(900, 1000, -300))
    calls: list[int] = []
    real = PreparedCall.__call__

    def spy(self: PreparedCall, layer: int, queries: torch.Tensor, *rest: object) -> torch.Tensor:
        calls.append(queries.shape[0])  # one query per segment
        return real(self, layer, queries, *rest)  # type: ignore[arg-type]

    monkeypatch.setattr(PreparedCall, "__call__", spy)
    for kept_now, expect_call in ((kept, True), (kept[1:], False)):  # 716 keys, then 116
        plan = SegmentPlan(
            ((keys, values),), (SegmentRun(0, 16, kept_now, 16),), lambda q, d: q * 0.5 + d
        )
        calls.clear()
        got = segmented_attention(0, query, side_k, side_v, side_mask, None, plan)
        kernel.runs_vectorised = False
        try:
            want = segmented_attention(0, query, side_k, side_v, side_mask, None, plan)
        finally:
            kernel.runs_vectorised = True
        assert calls == ([len(kept_now) + 1] if expect_call else [])
        assert (got - want).abs().max() < 1e-5


@pytest.mark.model
def test_the_benchmark_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """``src/leyline/evals/bench_run_attention.py`` smoke run, in-model A/B included (no timing
    asserted)."""
    from leyline.evals.bench_run_attention import main

    out = benchmark_lines(main, capsys)
    rows = [line for line in out if line.startswith(("float32", "bfloat16"))]
    assert len(rows) == 4  # a shape and an engine line per dtype
    assert all("x" in line for line in rows)


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.parametrize("in_place", [False, True])
def test_a_smollm2_splice_on_the_kernels_runs_equals_it_on_torchs_flash_kernel(
    kernel: AttentionKernel, smollm2_engine: Engine, in_place: bool
) -> None:
    """A 16-token replacement 700 tokens into a real SmolLM2 session (its run sees more than
    RUN_MIN_KEYS keys in every layer), by copy and in place: the next-token log-probs with
    the kernel's runs equal those of the path they replace (tested against independent
    computations elsewhere) to fp32 noise."""
    if not kernel.runs_vectorised:
        pytest.skip("query runs stay on SDPA on this CPU")
    g = torch.Generator().manual_seed(8)
    tokens = torch.randint(100, smollm2_engine.vocab_size - 100, (1000,), generator=g).tolist()
    base = SessionCache(smollm2_engine)
    base.prefill(tokens)
    edit = Edit(700, 800, tuple(range(200, 216)), Mode.amortize)
    was = smollm2_engine.edits_in_place
    logprobs = []
    try:
        smollm2_engine.edits_in_place = in_place
        for on in (True, False):
            kernel.runs_vectorised = on
            fork = base.fork(copy_kv=in_place)
            fork.apply_edits([edit], want_logits=True)
            logprobs.append(torch.log_softmax(fork.next_token_logits().double(), -1))
            fork.release()
    finally:
        kernel.runs_vectorised, smollm2_engine.edits_in_place = True, was
        base.release()
    assert (logprobs[0] - logprobs[1]).abs().max() < 1e-4
