"""``leyline.evals.bench_llamacpp``: the peer benchmark against llama.cpp (no timing asserted)."""

from __future__ import annotations

import importlib.util

import pytest

from leyline.evals import bench_llamacpp


def test_without_llama_cpp_it_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llama_cpp" else real(name)
    )
    assert bench_llamacpp.main(["--quick"]) == 2
    assert "pip install llama-cpp-python" in capsys.readouterr().err


@pytest.mark.model
@pytest.mark.slow
def test_both_engines_predict_the_same_token_after_the_delete(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Leyline's delete + logits and llama.cpp's seq_rm + seq_add + decode, on the same GGUF:
    the same next token, so the two arms time the same edit."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is an optional peer")
    assert bench_llamacpp.main(["--quick"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("    512")]
    assert len(rows) == 1 and "| same |" in rows[0]
