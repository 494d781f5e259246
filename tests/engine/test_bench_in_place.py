"""The in-place A/B benchmark runs end to end (SmolLM2 at 512 tokens: a smoke test, no
timing claims); a model that cannot edit in place says so."""

from __future__ import annotations

import pytest

from leyline.evals.bench_in_place import main

pytestmark = pytest.mark.slow  # runs the whole benchmark: minutes, not seconds


def test_bench_in_place_times_both_paths(capsys: pytest.CaptureFixture[str]) -> None:
    result = main(["--quick", "--dtypes", "float32"])
    med = result["float32"][512]
    for arm in ("splice", "delete"):
        assert med[f"{arm}_in_place"] > 0 and med[f"{arm}_copy"] > 0
    assert med["keys_move_in_place"] > 0 and med["keys_rotate_into_buffer"] > 0
    assert "keys' move" in capsys.readouterr().out


def test_bench_in_place_reports_a_copy_only_model(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", "tiny-mla-v2", "--quick", "--dtypes", "float32"]) == {"float32": {}}
    assert "edits by copy only" in capsys.readouterr().out
