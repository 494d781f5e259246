"""The packed-linear benchmark runs end to end (tiny random model: a smoke test, no timing)."""

from __future__ import annotations

import pytest
import torch

from leyline.evals.bench_packed_linear import main


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch without oneDNN")
def test_bench_packed_linear_runs_on_a_tiny_model(capsys: pytest.CaptureFixture[str]) -> None:
    # Packed even where the engine would not pack by default (off AVX-512): the bench
    # compares the arms wherever oneDNN packs.
    rows = main(["--model", "tiny-mla-v2", "--quick", "--dtypes", "float32", "--hints", "1", "64"])
    assert [r["rows"] for r in rows] == [1, 17]
    assert all(r["plain_ms"] > 0 and r["packed@1_ms"] > 0 and r["packed@64_ms"] > 0 for r in rows)
    out = capsys.readouterr().out
    assert "linear layers" in out and "packed@64_ms" in out
    if torch.backends.cpu.get_cpu_capability() == "AVX512":  # the kernel reads the packing
        assert all(r["kernel_ms"] > 0 for r in rows) and "kernel_ms" in out
