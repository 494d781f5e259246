"""`leyline eval mechanism`: trajectory sources, statistics, and a fast end-to-end run."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from leyline.evals.mechanism.replay import Sample, reusable_tokens
from leyline.evals.mechanism.stats import agreement, pct, summarize
from leyline.evals.mechanism.synthetic import synthetic_trajectories
from leyline.evals.mechanism.trajectories import bundled_debug_gym, from_debug_gym_run, load


def test_synthetic_trajectories_are_seeded_and_realistic() -> None:
    first, again = synthetic_trajectories(3, seed=5), synthetic_trajectories(3, seed=5)
    assert first == again and first != synthetic_trajectories(3, seed=6)
    for t in first:
        assert len(t.calls) == 10 and t.calls[1].tool == "eval"
        assert "test session starts" in t.calls[1].output and "FAILED" in t.calls[1].output
        sizes = [len(c.output) for c in t.calls]
        assert max(sizes) > 1000 and min(sizes) < max(sizes) / 2  # varied, some long


def test_turn_messages_are_a_tool_call_and_its_output() -> None:
    t = synthetic_trajectories(1, seed=0)[0]
    call, output = t.turn(3)
    assert call["tool_calls"][0]["function"]["name"] == t.calls[2].tool
    assert output == {"role": "tool", "tool_call_id": "call_3", "content": t.calls[2].output}
    assert {s["function"]["name"] for s in t.tool_specs()} == {c.tool for c in t.calls}


def test_bundled_debug_gym_recordings_load_and_round_trip(tmp_path: Path) -> None:
    recorded = bundled_debug_gym()
    assert len(recorded) == 10 and all(t.source == "debug-gym" for t in recorded)
    cart = next(t for t in recorded if "shopping_cart" in t.name)
    assert "test session starts" in cart.calls[0].output
    # The same conversion from a debug-gym results folder.
    steps = [
        {"action": {"name": "eval", "arguments": {}}, "observation": "1 failed"},
        {"action": None, "observation": "no tool call"},
        {"action": {"name": "view", "arguments": {"path": "a.py"}}, "observation": "code"},
    ]
    folder = tmp_path / "trajectories" / "none"
    folder.mkdir(parents=True)
    episode = {"episode": {"task": "purr"}, "steps": steps}
    (folder / "purr-run0.json").write_text(json.dumps(episode))
    [loaded] = from_debug_gym_run(tmp_path)
    assert [c.tool for c in loaded.calls] == ["eval", "view"] and "purr" in loaded.task
    pool = load([str(tmp_path), "synthetic", "demo"], synthetic_count=2, seed=0)
    assert [t.source for t in pool] == ["debug-gym", "synthetic", "demo", "synthetic"]


def test_unknown_source_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown trajectory source 'nope'"):
        load(["nope"], synthetic_count=1, seed=0)


def _sample(arm: str, turn: int, *, token: str, reused: int, prefilled: int, e2e: float) -> Sample:
    path = "splice" if arm == "splice" and turn > 1 else "reprefill"
    return Sample(
        1, 0, "t", turn, arm, e2e, e2e / 2, path, reused + prefilled, reused, prefilled, 0, 0, token
    )


def test_statistics_against_hand_computed_values() -> None:
    assert pct([4.0, 1.0, 3.0, 2.0], 50) == 2.5 and pct([1.0, 2.0], 90) == pytest.approx(1.9)
    samples = [
        _sample("splice", 1, token="a", reused=0, prefilled=100, e2e=1.0),
        _sample("reprefill", 1, token="a", reused=0, prefilled=100, e2e=1.0),
        _sample("splice", 2, token="b", reused=180, prefilled=20, e2e=1.0),
        _sample("reprefill", 2, token="c", reused=100, prefilled=100, e2e=3.0),
    ]
    row = summarize(samples)["1"]
    assert row["splice"]["hit_rate"] == pytest.approx(180 / 300)
    assert row["reprefill"]["hit_rate"] == pytest.approx(100 / 300)
    assert row["ratio_e2e_p50_ms"] == pytest.approx(2.0 / 1.0)
    assert row["reprefill"]["e2e_mean_ms"] == pytest.approx(2000.0)
    assert row["e2e_mean_all_ms"] == pytest.approx(1500.0)
    assert agreement(samples) == {"pairs": 2, "agree": 1, "spliced_pairs": 1, "spliced_agree": 0}
    # Reuse against what was reusable counts only requests that had a cached revision.
    edited = [dataclasses.replace(x, reusable=190) if x.turn == 2 else x for x in samples]
    row = summarize(edited)["1"]
    assert row["splice"]["reusable_tokens"] == 190
    assert row["splice"]["reuse_of_reusable"] == pytest.approx(180 / 190)
    assert row["reprefill"]["reuse_of_reusable"] == pytest.approx(100 / 190)
    # Server timings where reported; throughput over the span from first sent to last done.
    timed = [
        dataclasses.replace(x, started_s=float(i), queued_s=0.1 * i, service_s=0.5, decode_s=0.2)
        for i, x in enumerate(samples)
    ]
    row = summarize(timed)["1"]
    assert row["splice"]["queued_p50_ms"] == pytest.approx(100.0)  # samples 0 and 2
    assert row["reprefill"]["service_p50_ms"] == pytest.approx(500.0)
    assert row["throughput_rps"] == pytest.approx(4 / (3 + 3.0))  # last: sent at 3, took 3 s
    assert math.isnan(summarize(samples)["1"]["splice"]["queued_p50_ms"])  # none reported


def test_reusable_tokens_are_the_prompt_tokens_found_in_order_in_the_revision() -> None:
    assert reusable_tokens([1, 2, 3, 4, 5, 6], [1, 2, 9, 9, 5, 6, 7]) == 4
    assert reusable_tokens([], [1, 2]) == 0
    assert reusable_tokens([1, 2, 3], [3, 2, 1]) == 1  # order matters: one can be kept


def run_cli(argv: list[str]) -> subprocess.CompletedProcess[str]:
    """``leyline`` with ``argv`` in a subprocess; it must succeed."""
    done = subprocess.run(
        [sys.executable, "-m", "leyline.cli.main", *argv],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.mark.slow
@pytest.mark.model
def test_fast_run_against_the_embedded_server(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("matplotlib")
    argv = ["eval", "mechanism", "--fast", "--levels", "2", "--max-tokens", "1"]
    argv += ["--trajectories", "synthetic,debug-gym", "--no-progress", "--out", str(tmp_path)]
    done = run_cli(argv)
    assert "batches the decode steps" in done.stdout and "argmax agreement" in done.stdout
    report = json.loads((tmp_path / "report.json").read_text())
    assert (tmp_path / "latency_and_hits.png").read_bytes()[:4] == b"\x89PNG"
    assert "| c | arm |" in (tmp_path / "report.md").read_text()
    row = report["summary"]["2"]
    samples = report["samples"]
    # Two clients (a synthetic and the longest debug-gym trajectory), three turns, two arms.
    assert len(samples) == 2 * 3 * 2 == row["splice"]["requests"] + row["reprefill"]["requests"]
    for arm in ("splice", "reprefill"):
        stats = row[arm]
        assert 0 < stats["ttft_p50_ms"] <= stats["e2e_p50_ms"] * 1.01
        mine = [s for s in samples if s["arm"] == arm]
        assert stats["prefilled_tokens"] == sum(s["prefilled"] for s in mine)
    # Turn 3 is the first the policy (keep_last=2) edits: it runs as a splice in that arm
    # only, so that arm reuses more of its prompt.
    assert row["splice"]["splice_paths"] >= 1 and row["reprefill"]["splice_paths"] == 0
    assert row["splice"]["hit_rate"] > row["reprefill"]["hit_rate"]
    # Every request after a session's first knows what its cached revision could give.
    assert all((s["reusable"] is None) == (s["turn"] == 1) for s in samples)
    splice, reprefill = row["splice"]["reuse_of_reusable"], row["reprefill"]["reuse_of_reusable"]
    assert 0.9 <= splice <= 1.0 and reprefill < splice
    agree = row["agreement"]
    assert agree["pairs"] == 6 and 0 <= agree["agree"] <= agree["pairs"]
    assert all(s["first_token"] for s in samples)
    # The server says where each request's time went; service is part of the wall time.
    for s in samples:
        assert s["queued_s"] >= 0 and s["service_s"] > 0 and s["decode_s"] >= 0
        assert s["queued_s"] + s["service_s"] <= s["e2e_s"]
    assert row["throughput_rps"] > 0
    # One token a reply: it is sampled from the prefill's logits, so no decode step runs.
    scheduler = report["scheduler"]
    assert scheduler["jobs"] >= len(samples) and scheduler["slices"] >= scheduler["jobs"]
    assert scheduler["decode_steps"] == 0 and scheduler["max_batch"] == 0
    for name in ("session_info", "tokenize", "chat_max_tokens_1", "splice_directive"):
        assert report["overhead"][name]["http_p50_ms"] > 0


@pytest.mark.slow
@pytest.mark.model
def test_arms_apart_run_one_arm_after_the_other(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("matplotlib")
    argv = ["eval", "mechanism", "--levels", "2", "--turns", "3", "--max-tokens", "1"]
    argv += ["--trajectories", "synthetic", "--synthetic", "2", "--overhead-reps", "0"]
    argv += ["--arms-apart", "--no-progress", "--out", str(tmp_path)]
    done = run_cli(argv)
    assert "Arms apart" in done.stdout and "interleaved turn by turn" not in done.stdout
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["config"]["arms_apart"] is True
    samples = report["samples"]
    splice = [s for s in samples if s["arm"] == "splice"]
    reprefill = [s for s in samples if s["arm"] == "reprefill"]
    assert len(splice) == len(reprefill) == 2 * 3
    # Every splice-arm request was done before the first re-prefill request was sent.
    assert max(s["started_s"] + s["e2e_s"] for s in splice) <= min(
        s["started_s"] for s in reprefill
    )
    row = report["summary"]["2"]
    assert row["splice"]["splice_paths"] >= 1 and row["reprefill"]["splice_paths"] == 0
    assert row["agreement"]["pairs"] == 6  # the arms still pair up turn by turn
    assert all(rate > 0 for rate in row["throughput_rps_by_arm"].values())
