"""`leyline eval mechanism`: trajectory sources, statistics, and a fast end-to-end run."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import openai
import pytest

from leyline.evals.mechanism import cli
from leyline.evals.mechanism.metrics import (
    CounterError,
    Selector,
    SelectorError,
    ServerCounter,
    counter_sum,
    metrics_url,
    parse_selector,
)
from leyline.evals.mechanism.replay import Sample, Settings, reusable_tokens, run_level
from leyline.evals.mechanism.report import concurrency_note, counter_table
from leyline.evals.mechanism.stats import agreement, overall, pct, summarize
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


LOCAL = 'vllm:prompt_tokens_by_source_total{source="local_compute"}'

# What vLLM's /metrics looks like (prometheus_client's text format): HELP/TYPE lines, the
# engine and model_name labels on every series, a _created series beside each counter.
VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="lm"} 0.0
vllm:num_requests_running{engine="1",model_name="lm"} 2.0 1733558400000
# HELP vllm:prompt_tokens_by_source_total Number of prompt tokens by source.
# TYPE vllm:prompt_tokens_by_source_total counter
vllm:prompt_tokens_by_source_total{engine="0",model_name="lm",source="local_compute"} 5.5717e+04
vllm:prompt_tokens_by_source_total{engine="0",model_name="lm",source="local_cache_hit"} 8473.0
vllm:prompt_tokens_by_source_total{engine="1",model_name="lm",source="local_compute"} 1283.0
vllm:prompt_tokens_by_source_total{engine="1",model_name="lm",source="external_kv_transfer"} 0.0
# HELP vllm:prompt_tokens_by_source_created Number of prompt tokens by source.
# TYPE vllm:prompt_tokens_by_source_created gauge
vllm:prompt_tokens_by_source_created{engine="0",model_name="lm",source="local_compute"} 1.73e+09

# HELP http_requests_total Total number of requests by method, status and handler.
# TYPE http_requests_total counter
http_requests_total{handler="/a,\\"b\\"",method="POST",status="2xx"} 96.0
http_requests_total{handler="/v1/chat/completions",method="POST",status="2xx"} 4.0
"""


def test_selectors_parse_with_and_without_labels() -> None:
    assert parse_selector("vllm:num_requests_running") == Selector("vllm:num_requests_running")
    assert parse_selector(LOCAL).labels == (("source", "local_compute"),)
    assert str(parse_selector(LOCAL)) == LOCAL
    spaced = parse_selector(' m{a = "x" , b="y",} ')  # blanks and a trailing comma
    assert spaced == Selector("m", (("a", "x"), ("b", "y")))
    assert parse_selector("m{}") == Selector("m")
    # Escaped backslash, quote and newline; a comma and a brace inside the quotes.
    escaped = parse_selector(r'm{path="a\\b \"q\", {x}",nl="1\n2"}')
    assert escaped.labels == (("path", 'a\\b "q", {x}'), ("nl", "1\n2"))
    assert parse_selector(str(escaped)) == escaped


@pytest.mark.parametrize(
    "text",
    [
        "",
        '{a="b"}',  # no name
        "m{",
        'm{a="b"',  # no closing brace
        "m{a=b}",  # value not quoted
        'm{a="b}',  # unterminated value
        'm{a="b" c="d"}',  # no comma
        'm{a="1",a="2"}',  # a label twice
        'm{1a="b"}',
        r'm{a="\x"}',  # no such escape
        'm{a="b"} 1',  # a sample line, not a selector
        "m-x",
    ],
)
def test_malformed_selectors_are_rejected(text: str) -> None:
    with pytest.raises(SelectorError):
        parse_selector(text)
    assert issubclass(SelectorError, ValueError)


def test_counter_sums_the_series_that_carry_the_selectors_labels() -> None:
    assert counter_sum(VLLM_METRICS, parse_selector(LOCAL)) == 55717 + 1283
    every_source = parse_selector("vllm:prompt_tokens_by_source_total")
    assert counter_sum(VLLM_METRICS, every_source) == 55717 + 8473 + 1283
    engine = 'vllm:prompt_tokens_by_source_total{engine="1",source="local_compute"}'
    assert counter_sum(VLLM_METRICS, parse_selector(engine)) == 1283
    assert counter_sum(VLLM_METRICS, parse_selector("vllm:num_requests_running")) == 2.0
    quoted = parse_selector(r'http_requests_total{handler="/a,\"b\""}')
    assert counter_sum(VLLM_METRICS, quoted) == 96.0


def test_a_selector_matching_nothing_names_what_is_there() -> None:
    other = 'vllm:prompt_tokens_by_source_total{source="remote"}'
    with pytest.raises(CounterError, match=r'source="remote"') as caught:
        counter_sum(VLLM_METRICS, parse_selector(other))
    assert 'source="local_cache_hit"' in str(caught.value)  # the series of that name
    with pytest.raises(CounterError, match="vllm:num_requests_running") as caught:
        counter_sum(VLLM_METRICS, parse_selector("vllm:prompt_tokens_total"))
    assert "http_requests_total" not in str(caught.value)  # only the vllm: ones
    with pytest.raises(CounterError, match="http_requests_total"):
        counter_sum(VLLM_METRICS, parse_selector("http_request_total"))  # the nearest


@pytest.mark.parametrize("line", ["m", 'm{a="b"}', "m 1 2 3", "m x", "m{a=1} 2", "m-1 2"])
def test_malformed_exposition_lines_are_rejected(line: str) -> None:
    with pytest.raises(ValueError, match="exposition line 2"):
        counter_sum("# TYPE m counter\n" + line + "\n", Selector("m"))


def _cli_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_cli_takes_a_server_counter_only_with_a_base_url(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.run(_cli_args("--server-counter", LOCAL)) == 2
    assert "--server-counter needs --base-url" in capsys.readouterr().err
    malformed = _cli_args("--base-url", "http://127.0.0.1:9/v1", "--server-counter", "m{a=b}")
    assert cli.run(malformed) == 2
    assert "not quoted" in capsys.readouterr().err


@pytest.fixture
def metrics_server() -> Iterator[tuple[str, list[str], list[float]]]:
    """A stdlib HTTP server whose /metrics gives the next of ``values`` on each GET (the
    last one again when they run out): (its OpenAI base URL, the paths asked, values)."""
    paths: list[str] = []
    values: list[float] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            paths.append(self.path)
            value = values[min(len(paths), len(values)) - 1]
            body = VLLM_METRICS.replace("5.5717e+04", repr(value)).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1", paths, values
    finally:
        server.shutdown()
        server.server_close()


def test_run_level_reads_the_counter_around_each_arms_clients(
    metrics_server: tuple[str, list[str], list[float]],
) -> None:
    base_url, paths, values = metrics_server
    # Zero turns: each arm's clients start and finish without a chat request, so the only
    # traffic is the counter's; each arm's growth is its own pair of reads.
    settings = Settings(levels=(2,), turns=0, arms_apart=True)
    pool = synthetic_trajectories(1, seed=0)
    base = openai.OpenAI(base_url=base_url, api_key="-", max_retries=0)
    values += [100.0, 130.0, 130.0, 210.5]
    counter = ServerCounter(metrics_url(base_url), parse_selector(LOCAL))
    samples, grown = run_level(base, settings, pool, 2, lambda: None, "t", counter)
    assert samples == [] and paths == ["/metrics"] * 4
    assert grown == {"splice": 30.0, "reprefill": 80.5}  # plus engine 1's 1283, both reads
    # Without a counter: nothing read; with one and the arms together: refused.
    assert run_level(base, settings, pool, 2, lambda: None, "t") == ([], {})
    assert len(paths) == 4
    together = dataclasses.replace(settings, arms_apart=False)
    with pytest.raises(ValueError, match="arms apart"):
        run_level(base, together, pool, 2, lambda: None, "t", counter)
    with pytest.raises(CounterError, match="no series matches"):
        ServerCounter(metrics_url(base_url), parse_selector("vllm:nope_total"))()


def test_counter_growth_in_the_summary_and_its_table() -> None:
    samples = [
        _sample("splice", 1, token="a", reused=0, prefilled=100, e2e=1.0),
        _sample("reprefill", 1, token="a", reused=0, prefilled=100, e2e=1.0),
        _sample("splice", 2, token="b", reused=180, prefilled=20, e2e=1.0),
        _sample("reprefill", 2, token="c", reused=100, prefilled=100, e2e=3.0),
    ]
    assert "server_counter" not in summarize(samples)["1"]["splice"]  # none asked
    grown = {1: {"splice": 150.0, "reprefill": 200.5}}
    table, facts = summarize(samples, grown), overall(samples, grown)
    row = table["1"]
    assert row["splice"]["server_counter"] == 150.0
    assert row["reprefill"]["server_counter"] == 200.5
    assert row["ratio_server_counter"] == pytest.approx(150 / 200.5)
    assert facts["server_counter"] == {"splice": 150.0, "reprefill": 200.5}
    assert facts["ratio_server_counter"] == pytest.approx(150 / 200.5)
    text = counter_table(table, facts, LOCAL)
    # Integral counts print as integers; next to them the report's prefilled 120 / 200.
    assert f"| 1 | `{LOCAL}` | 150 | 200.5 | 0.75 | 0.60 |" in text
    assert f"| all | `{LOCAL}` | 150 | 200.5 | 0.75 | 0.60 |" in text
    assert "implies --arms-apart" in concurrency_note("http://h/v1", True, counter=True)
    assert "implies" not in concurrency_note("http://h/v1", True)


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
