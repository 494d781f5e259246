"""The turn benchmark runs end to end (SmolLM2 at 512 tokens: a smoke test, no timing
claims)."""

from __future__ import annotations

import pytest

from leyline.evals.bench_turn import PHASES, main


@pytest.mark.slow
@pytest.mark.model
def test_bench_turn_times_both_arms(capsys: pytest.CaptureFixture[str]) -> None:
    result = main(["--quick", "--dtypes", "float32"])
    med = result["float32"][512]
    assert set(med) == {"room", "copy"}
    for arm in med.values():
        assert all(arm[p] > 0 for p in PHASES)
        assert arm["turn"] >= arm["generate"]
    assert "512 | turn |" in capsys.readouterr().out
