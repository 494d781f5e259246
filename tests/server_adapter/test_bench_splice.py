"""The splice benchmark script runs end to end (tiny random model: a smoke test, no timing)."""

from __future__ import annotations

import pytest

from leyline.evals.bench_splice import main


def test_bench_runs_end_to_end_on_a_tiny_model(capsys: pytest.CaptureFixture[str]) -> None:
    args = "--model tiny-mla-v2 --contexts 96 --runs 1 --span 20 --stub 4 --rotation-runs 1"
    results = main([*args.split(), "--no-memory"])
    row = results["rows"][0]  # type: ignore[index]
    assert row["context"] == 96 and row["span"] == 20 and row["stub"] == 4
    assert results["rotation"]["ratio"] > 0  # type: ignore[index]
    assert "RANDOM WEIGHTS" in capsys.readouterr().out


def test_bench_has_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0 and "--quick" in capsys.readouterr().out
