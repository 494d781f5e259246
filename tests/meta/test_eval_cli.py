"""``leyline eval``: every eval is registered, documented, and fails clearly on bad input."""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from leyline.cli.eval_command import EVALS
from leyline.evals.debug_gym import launcher

from .fresh_python import loaded_in_fresh_python


def leyline(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "leyline.cli.main", *args], capture_output=True, text=True
    )


@pytest.mark.parametrize("name", list(EVALS))
def test_every_eval_has_the_interface_and_a_fast_mode(name: str) -> None:
    module = importlib.import_module(EVALS[name])
    assert module.HELP and module.DESCRIPTION and callable(module.run)
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    args = parser.parse_args(["--fast", "--out", "x"])
    assert args.fast is True and str(args.out) == "x"


def test_eval_help_lists_every_eval() -> None:
    done = leyline("eval", "--help")
    assert done.returncode == 0, done.stderr
    for name in EVALS:
        assert name in done.stdout


def test_no_eval_imports_torch_at_parse_time() -> None:
    statement = "from leyline.cli.main import build_parser; build_parser()"
    assert "torch" not in loaded_in_fresh_python(statement)


def test_debug_gym_launcher_passes_on_only_the_options_set() -> None:
    parser = argparse.ArgumentParser()
    launcher.add_arguments(parser)
    args = parser.parse_args(["--runs", "5", "--scripted", "--base-url", "http://h:1/v1"])
    argv = launcher.harness_argv(args)
    assert argv == ["--base-url", "http://h:1/v1", "--runs", "5", "--scripted"]
    # What the harness parses from it is what the user asked for.
    again = launcher.harness.build_parser().parse_args(argv)
    assert again.runs == 5 and again.scripted and again.base_url == "http://h:1/v1"


def test_debug_gym_without_its_venv_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(launcher, "in_debug_gym_venv", lambda: False)  # as in the main venv
    parser = argparse.ArgumentParser()
    launcher.add_arguments(parser)
    args = parser.parse_args(["--fast", "--python", str(tmp_path / "missing")])
    assert launcher.run(args) == 2
    err = capsys.readouterr().err
    assert "setup_env.sh" in err and "missing" in err
