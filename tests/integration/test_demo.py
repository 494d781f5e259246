"""`leyline demo` end to end: the embedded SmolLM2 (slow), and a server without Leyline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from leyline.cli.main import main
from tests.policies.plain_server import plain_server

pytest.importorskip("matplotlib")
pytest.importorskip("tqdm")


@pytest.mark.slow
@pytest.mark.model
def test_demo_runs_end_to_end_on_the_embedded_server(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("torch")
    argv = ["demo", "--turns", "3", "--max-tokens", "2", "--top-logprobs", "5"]
    assert main([*argv, "--out", str(tmp_path), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "scripted: the agent's 3 tool-call decisions" in printed
    assert "Leyline 1.0" in printed and "Summary over 3 turns" in printed
    document = json.loads((tmp_path / "demo.json").read_text())
    assert (tmp_path / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    turns = document["turns"]
    assert [t["turn"] for t in turns] == [1, 2, 3]
    # keep_last=2: the first output is stubbed at turn 3, as a splice in the splice arm only.
    assert turns[2]["edits"] == ["stub out#1"]
    spliced, reprefilled = (turns[2]["arms"][arm]["record"] for arm in ("splice", "reprefill"))
    assert spliced["path"] == "splice" and spliced["fallback_reason"] is None
    assert reprefilled["path"] == "reprefill" and reprefilled["directives"] == 0
    assert spliced["prefilled_tokens"] < reprefilled["prefilled_tokens"]
    assert spliced["prompt_tokens"] == reprefilled["prompt_tokens"]
    summary = document["summary"]
    assert summary["prefill_saved_fraction"] > 0 and summary["top1_scored"] == 3


def test_demo_against_a_server_without_leyline_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with plain_server() as server:
        argv = ["demo", "--turns", "2", "--base-url", server.base_url, "--out", str(tmp_path)]
        assert main([*argv, "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "does not speak Leyline" in printed
    assert "not scored: the server sent no logprobs" in printed
    document = json.loads((tmp_path / "demo.json").read_text())
    assert document["server"]["leyline"] is False
    assert all("leyline" not in body for body in server.requests)
    assert len(server.requests) == 1 + 2 * 2  # warm-up, then two arms for two turns
