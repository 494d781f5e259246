"""The linear-kernel A/B benchmark runs end to end (tiny random MLA model: a smoke test, no
timing claims)."""

from __future__ import annotations

import pytest
import torch

from leyline.evals.bench_linear_kernel import main


@pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() != "AVX512",
    reason="the engine packs its linear layers on AVX-512 CPUs only",
)
def test_bench_linear_kernel_runs_both_settings_on_a_tiny_model(
    capsys: pytest.CaptureFixture[str],
) -> None:
    result = main(["--model", "tiny-mla-v2", "--quick", "--dtypes", "float32"])
    med = result["float32"]
    for arm in ("delete", "splice", "decode1", "decode2"):
        assert med[f"{arm}_on"] > 0 and med[f"{arm}_off"] > 0
    out = capsys.readouterr().out
    assert "on linear_kernel" in out and "argmax same: True" in out
