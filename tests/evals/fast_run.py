"""``leyline eval <name> --fast`` as the eval tests run it."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from leyline.cli.main import main


def fast_run(name: str, out: Path, files: Iterable[str], *extra: str) -> dict[str, Any]:
    """Run the eval's fast mode into ``out`` (``extra``: more options); each of ``files``
    must be written and not empty. Its ``report.json``."""
    assert main(["eval", name, "--fast", "--no-progress", "--out", str(out), *extra]) == 0
    for file in files:
        assert (out / file).stat().st_size > 0, file
    report: dict[str, Any] = json.loads((out / "report.json").read_text())
    return report
