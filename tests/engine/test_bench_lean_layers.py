"""The lean- and fused-layer benchmark runs end to end (SmolLM2 at 512 tokens: a smoke
test, no timing claims) and says so when a model's layers cannot go lean."""

from __future__ import annotations

import pytest

from leyline.evals.bench_lean_layers import main

from ._helpers import needs_fused


@pytest.mark.slow
@pytest.mark.model
@needs_fused()
def test_bench_lean_layers_times_every_arm(capsys: pytest.CaptureFixture[str]) -> None:
    result = main(["--quick", "--dtypes", "float32"])
    figures = result["float32"][512]
    assert set(figures) == {"decode", "delete+logits", "splice+logits"}
    assert all(len(arms) == 3 and min(arms) > 0 for arms in figures.values())
    out = capsys.readouterr().out
    assert "30 lean layers, 30 fused" in out and "512 | splice+logits  |" in out
    assert "fused/loop" in out


def test_a_model_that_cannot_go_lean_is_reported(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--quick", "--model", "tiny-mla-v2", "--dtypes", "float32"]) == {}
    assert "cannot go lean" in capsys.readouterr().out
