"""`evals/bench_server.py` end to end on the embedded SmolLM2, smallest settings."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")
pytest.importorskip("tqdm")

SCRIPT = Path(__file__).resolve().parents[2] / "evals" / "bench_server.py"


@pytest.mark.slow
@pytest.mark.model
def test_bench_server_quick_writes_both_arms(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    raw = tmp_path / "raw.json"
    argv = ["--quick", "--levels", "2", "--turns", "3", "--max-tokens", "1"]
    argv += ["--overhead-reps", "2", "--out", str(tmp_path / "out"), "--json", str(raw)]
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "re-prefill / splice" in done.stdout and "ONE worker thread" in done.stdout
    document = json.loads(raw.read_text())
    assert (tmp_path / "out" / "bench_server.png").read_bytes()[:4] == b"\x89PNG"
    row = document["summary"]["2"]
    for arm in ("splice", "reprefill"):
        stats = row[arm]
        assert stats["requests"] == 2 * 3
        assert 0 < stats["ttft_p50_ms"] <= stats["e2e_p50_ms"] * 1.01 < 120_000
        assert stats["e2e_p50_ms"] <= stats["e2e_p90_ms"]
        assert 0 < stats["hit_rate"] < 1
    # Turn 3 is the first the policy edits: the splice arm runs it as a splice, and so reuses
    # more of its prompt than the re-prefill arm, which recomputes from the stub.
    assert row["splice"]["splice_paths"] >= 1 and row["reprefill"]["splice_paths"] == 0
    assert row["splice"]["hit_rate"] > row["reprefill"]["hit_rate"]
    assert row["ratio_e2e_p50_ms"] > 0
    samples = document["samples"]
    assert {s["arm"] for s in samples} == {"splice", "reprefill"} and len(samples) == 12
    overhead = document["overhead"]
    for name in ("session_info", "tokenize", "chat_max_tokens_1", "splice_directive"):
        assert overhead[name]["http_ms"] and overhead[name]["http_p50_ms"] > 0
