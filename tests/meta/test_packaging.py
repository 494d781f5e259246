"""Every folder of Python code under src/leyline ships in the wheel: setuptools finds only
folders with an ``__init__.py``, so one without it would silently be left out."""

from __future__ import annotations

import tomllib
from pathlib import Path

from setuptools import find_packages

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"


def test_every_code_folder_is_a_package_setuptools_finds() -> None:
    found = set(find_packages(str(SRC)))
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    data_dirs = {
        f"{package}.{pattern.split('/')[0]}"
        for package, patterns in data["package-data"].items()
        for pattern in patterns
        if "/" in pattern
    }
    code = {
        ".".join(py.parent.relative_to(SRC).parts)
        for py in SRC.rglob("*.py")
        if "__pycache__" not in py.parts
    }
    missing = {
        folder
        for folder in code - found
        if not any(folder == d or folder.startswith(d + ".") for d in data_dirs)
    }
    assert missing == set(), "add an __init__.py to these folders"
    assert {"leyline.engine.cpu", "leyline.sglang", "leyline.serve"} <= found
