"""Where a replacement's query run goes: the attention kernel's runs or torch's flash kernel,
chosen per shape by timing both once (``run_choice``), or as a set ``mode``
says; either way the attention is the same."""

from __future__ import annotations

import pytest
import torch

from leyline.engine.cpu import attention_kernel, run_choice
from leyline.engine.cpu.run_choice import RunChooser, ShapeKey


def _run(dtype: torch.dtype = torch.float32, m: int = 16) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 9, m, 64, generator=g).to(dtype)
    k = torch.randn(1, 3, 700, 64, generator=g).to(dtype)
    v = torch.randn(1, 3, 700, 64, generator=g).to(dtype)
    return q, k, v


class Timed(RunChooser):
    """A chooser whose measurements are the test's numbers (and counted)."""

    def __init__(self, kernel_s: float, torch_s: float) -> None:
        super().__init__(kernel=None, mode="auto")  # type: ignore[arg-type]
        self.times, self.calls = (kernel_s, torch_s), 0

    def measure(self, shape: ShapeKey) -> tuple[float, float]:
        self.calls += 1
        return self.times


@pytest.mark.parametrize(("kernel_s", "torch_s", "wins"), [(1e-4, 2e-4, True), (3e-4, 2e-4, False)])
def test_the_faster_path_wins_and_each_shape_is_measured_once(
    kernel_s: float, torch_s: float, wins: bool
) -> None:
    chooser = Timed(kernel_s, torch_s)
    q, k, v = _run()
    assert [chooser.kernel_wins(q, k, v) for _ in range(3)] == [wins] * 3
    assert chooser.calls == 1
    chooser.kernel_wins(*_run(torch.bfloat16))  # another dtype: another shape
    chooser.kernel_wins(*_run(m=4))  # another run length too
    chooser.kernel_wins_over(q, k, v, 3000)  # another key-count bucket
    chooser.kernel_wins_over(q, k, v, 4096)  # the same bucket as 3000
    assert chooser.calls == 4
    chooser.kernel_wins_over(q, k, v, 700, parts=2)  # a run over two segments: apart
    chooser.kernel_wins_over(q, k, v, 700, parts=3)  # any more share it
    assert chooser.calls == 5
    assert len(chooser.measured) == 5


def test_key_buckets_are_powers_of_two_within_their_bounds() -> None:
    assert [run_choice.key_bucket(n) for n in (1, 512, 513, 1024, 1500, 9000, 10**6)] == [
        512,
        512,
        1024,
        1024,
        2048,
        16384,
        16384,
    ]


def test_a_set_mode_decides_without_measuring() -> None:
    for mode, wins in (("kernel", True), ("torch", False)):
        chooser = Timed(1.0, 2.0)
        chooser.mode = mode
        assert chooser.kernel_wins(*_run()) is wins
        assert chooser.calls == 0


def test_a_real_measurement_times_both_paths_and_takes_runs_follows_it() -> None:
    kernel = attention_kernel.load()
    if kernel is None or not kernel.runs_vectorised:
        pytest.skip("no vectorised query runs on this CPU: torch's kernel takes every run")
    chooser = RunChooser(kernel, "auto")
    q, k, v = _run(torch.bfloat16)
    kernel_s, torch_s = chooser.measure((torch.bfloat16, 9, 3, 16, 64, 64, 1024, 1))
    assert kernel_s > 0 and torch_s > 0
    was = kernel.run_choice
    try:
        kernel.run_choice = chooser
        chooser.measured[(torch.bfloat16, 9, 3, 16, 64, 64, 1024, 1)] = (1.0, 2.0)
        assert kernel.takes_run(q, k, v)
        chooser.measured[(torch.bfloat16, 9, 3, 16, 64, 64, 1024, 1)] = (2.0, 1.0)
        assert not kernel.takes_run(q, k, v)
        # a run seeing 2k keys over its segments is another bucket, measured on its own
        chooser.measured[(torch.bfloat16, 9, 3, 16, 64, 64, 2048, 1)] = (1.0, 2.0)
        assert kernel.takes_run(q, k, v, keys=2000)
    finally:
        kernel.run_choice = was


def test_both_paths_give_the_same_attention() -> None:
    """What the choice may not change: the attention (fp32 rounding apart)."""
    kernel = attention_kernel.load()
    if kernel is None or not kernel.runs_vectorised:
        pytest.skip("no vectorised query runs on this CPU")
    q, k, v = _run()
    n, m = k.shape[2], q.shape[2]
    seen = [n - m + 1 + j for j in range(m)]
    mask = torch.zeros(1, 1, m, n)
    for j, s in enumerate(seen):
        mask[..., j, s:] = float("-inf")
    by_kernel = kernel.attend_runs([(q, k, v, seen)], None)
    by_torch, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, False, attn_mask=mask
    )
    assert (by_kernel - by_torch).abs().max() < 1e-5


def test_a_segmented_run_is_timed_as_segment_attention_runs_it() -> None:
    """Several segments: torch's arm attends each and merges them, the kernel's takes them
    in one call; both compute the run's attention over the whole cache."""
    kernel = attention_kernel.load()
    if kernel is None or not kernel.runs_vectorised:
        pytest.skip("no vectorised query runs on this CPU")
    chooser = RunChooser(kernel, "auto")
    q, k, v = _run()
    n, m = k.shape[2], q.shape[2]
    arms = chooser._segmented_arms(q, k, v, m)
    whole = kernel.attend_runs([(q, k, v, [n - m + 1 + j for j in range(m)])], None)
    for name, arm in arms.items():
        out = arm()
        assert isinstance(out, torch.Tensor), name
        assert (out.float() - whole).abs().max() < 1e-5, name
    kernel_s, torch_s = chooser.measure((torch.float32, 9, 3, m, 64, 64, 1024, 2))
    assert kernel_s > 0 and torch_s > 0
