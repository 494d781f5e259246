"""The splice benchmark script runs end to end (tiny random model: a smoke test, no timing)."""

from __future__ import annotations

import math

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


def test_bench_reports_both_dtypes_with_a_floor(capsys: pytest.CaptureFixture[str]) -> None:
    args = "--model tiny-mla-v2 --contexts 96 --runs 1 --span 20 --stub 4 --rotation-runs 1"
    results = main([*args.split(), "--dtypes", "float32", "bfloat16", "--no-memory"])
    by_dtype = results["dtypes"]
    assert set(by_dtype) == {"float32", "bfloat16"}  # type: ignore[arg-type]
    for name, figures in by_dtype.items():  # type: ignore[attr-defined]
        assert figures["dtype"] == name
        (row,) = figures["rows"]
        assert row["floor_ms"] > 0 and math.isfinite(row["x_floor"]) and row["x_floor"] > 0
        assert figures["bandwidth"]["read_GBps"] > 0 and figures["bandwidth"]["copy_GBps"] > 0
    out = capsys.readouterr().out
    assert "in float32" in out and "in bfloat16" in out
