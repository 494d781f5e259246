"""The splice benchmark script runs end to end (tiny random model: a smoke test, no timing)."""

from __future__ import annotations

import math

import pytest

from leyline.engine.engine import Engine
from leyline.engine.models import build_tiny_mla
from leyline.evals.bench_floors import Bandwidth, linear_flops
from leyline.evals.bench_splice import main

pytestmark = pytest.mark.slow  # runs the whole benchmark: minutes, not seconds


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
        assert figures["bandwidth"]["gemm_GFLOPs"] > 0 and figures["bandwidth"]["linear_flops"] > 0
        assert math.isfinite(row["peak_compute_floor_ms"]) and row["peak_compute_floor_ms"] > 0
        assert isinstance(row["floor_target_attainable"], bool)
        assert row["kv_floor_ms"] > row["floor_ms"]
        assert row["floor_target_within_traffic"] == (1.5 * row["floor_ms"] >= row["kv_floor_ms"])
    out = capsys.readouterr().out
    assert "in float32" in out and "in bfloat16" in out
    assert out.count("pfloor (the pass's") == 2 and out.count("kvfloor (+ the new KV") == 2


def test_the_peak_compute_floor_is_the_products_at_the_best_rate() -> None:
    # 1 GB of weights at 50 GB/s streams in 20 ms; 6 GFLOP at 200 GFLOP/s take 30 ms; the
    # rotation: 0.1 GB read and written at 10 GB/s of copy, 10 ms.
    bw = Bandwidth(10**9, 50.0, 10.0, 17, 45.0, 6 * 10**9, 200.0)
    assert math.isclose(bw.floor_ms(10**8), 30.0)
    assert math.isclose(bw.compute_floor_ms(10**8), 55.0)
    assert math.isclose(bw.peak_compute_floor_ms(10**8), 40.0)
    assert Bandwidth(10**9, 50.0, 10.0, 17, 45.0).peak_compute_floor_ms(10**8) == 0.0


def test_the_kv_floor_adds_the_new_kv_read_and_the_values_moved() -> None:
    # on the floor's 30 ms: 0.5 GB of K and V read at 50 GB/s (10 ms) and 0.1 GB of values
    # copied at 10 GB/s (10 ms)
    bw = Bandwidth(10**9, 50.0, 10.0, 17, 45.0)
    assert math.isclose(bw.kv_floor_ms(10**8, 5 * 10**8, 10**8), 50.0)
    assert math.isclose(bw.kv_floor_ms(10**8, 0, 0), bw.floor_ms(10**8))


def test_linear_flops_count_every_linear_layer_and_the_head_on_one_row() -> None:
    engine = Engine(build_tiny_mla("v2"))
    head = engine.model.get_output_embeddings()
    layers = [m for m in engine.model.modules() if hasattr(m, "in_features")]
    body = sum(m.in_features * m.out_features for m in layers if m is not head)
    assert linear_flops(engine, 17) == 2 * 17 * body + 2 * head.in_features * head.out_features
