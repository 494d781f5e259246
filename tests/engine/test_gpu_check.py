"""The SGLang plugin's device check runs in CPU mode without SGLang (main venv)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from leyline.sglang import gpu_check


def test_gpu_check_cpu_mode_passes_its_numerical_checks(capsys: pytest.CaptureFixture[str]) -> None:
    assert gpu_check.main(["--device", "cpu", "--small"]) == 0
    report = json.loads(capsys.readouterr().out)
    rope = report["rope"]
    assert rope["within_1_ulp"] and rope["latent_bitwise"] and report["ok"]
    assert rope["max_error_pair_ulps"] <= 1.0
    assert report["engine"]["kl_finite"]
    assert rope["rotate_ms"] > 0 and rope["plain_copy_ms"] > 0


def test_gpu_check_refuses_cuda_without_a_device(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on a CPU-only host
    assert gpu_check.main([]) == 2
    assert "no CUDA device" in capsys.readouterr().out


def test_importing_the_plugin_package_does_not_import_sglang() -> None:
    # A fresh interpreter: holds whether or not sglang is installed in this venv.
    code = "import sys, leyline.sglang; print('sglang' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
