"""The batched-decode benchmark runs end to end (tiny random model: a smoke test, no timing)."""

from __future__ import annotations

import pytest

from leyline.evals.bench_decode import main


def test_bench_decode_runs_on_a_tiny_model(capsys: pytest.CaptureFixture[str]) -> None:
    rows = main(["--model", "tiny-mla-v2", "--quick"])
    assert [r["batch"] for r in rows] == [1, 2]
    assert all(r["batched_ms"] > 0 and r["one_by_one_ms"] > 0 for r in rows)
    out = capsys.readouterr().out
    assert "RANDOM WEIGHTS" in out and "batched decode on" in out
