"""Every Python package folder of a layer ships in the wheel (setuptools lists them by hand)."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAYERS = {
    "cli": "cli",
    "protocol": "protocol",
    "policies": "policies",
    "server_adapter": "server_adapter",
    "evals": "evals",
}


def test_every_package_folder_is_listed_in_pyproject() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    found = {
        "leyline." + ".".join((layer, *init.parent.relative_to(ROOT / folder).parts))
        for layer, folder in LAYERS.items()
        for init in (ROOT / folder).rglob("__init__.py")
    }
    assert found - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"
    assert listed - found == set(), "pyproject lists packages that do not exist"
