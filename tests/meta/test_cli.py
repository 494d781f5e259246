"""The ``leyline`` command line as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys

from leyline.protocol.schema import build_schema


def leyline(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "leyline.cli.main", *args],
        capture_output=True,
        text=True,
        check=False,
    )


def test_schema_command_prints_the_schema() -> None:
    done = leyline("schema")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == build_schema()


def test_schema_check_passes_on_a_fresh_tree() -> None:
    done = leyline("schema", "--check")
    assert done.returncode == 0, done.stderr


def test_help_names_every_command_and_unknown_ones_fail() -> None:
    assert "schema" in leyline("--help").stdout
    bad = leyline("splice-everything")
    assert bad.returncode == 2 and "invalid choice" in bad.stderr
