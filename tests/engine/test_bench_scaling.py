"""The scaling benchmark runs end to end and draws its plot (tiny random model: no timing)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from leyline.evals.bench_scaling import main

pytestmark = pytest.mark.slow  # runs the whole benchmark: minutes, not seconds


def test_scaling_runs_end_to_end_and_writes_the_plot(tmp_path: Path) -> None:
    args = (
        "--model tiny-mla-v2 --contexts 64 128 8192 --position-context 128 --fractions 0.25 0.75 "
        "--runs 1 --span 20 --stub 4 --bandwidth-runs 1"
    )
    results = main([*args.split(), "--out", str(tmp_path)])
    assert [p["context"] for p in results["by_context"]] == [64, 128]
    assert [p["edit_at"] for p in results["by_position"]] == [0.25, 0.75]
    for point in results["by_context"] + results["by_position"]:
        assert point["splice_logits_ms"] > 0 and point["reprefill_ms"] > 0
        assert point["floor_ms"] > 0 and math.isfinite(point["x_floor"])
    assert "8192" in results["notes"][0]  # past tiny-mla-v2's 4096 positions: skipped, said so
    png = tmp_path / "scaling.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["eval"] == "bench-scaling" and len(report["by_position"]) == 2
    assert "vs edit position" in (tmp_path / "report.md").read_text()


def test_scaling_has_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    out = capsys.readouterr().out
    assert info.value.code == 0 and "--quick" in out and "--past-max-positions" in out
