"""The house rules of the layers, checked on the source: who may import whom."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

FORBIDDEN = {
    "protocol": (
        "leyline.policies",
        "leyline.server_adapter",
        "leyline.evals",
        "leyline.cli",
        "torch",
        "transformers",
    ),
    "policies": ("leyline.server_adapter", "leyline.evals", "torch", "transformers"),
    "server_adapter": ("leyline.policies", "leyline.evals"),
}


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layer_imports_only_what_it_may(layer: str) -> None:
    offences = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in sorted((ROOT / layer).rglob("*.py"))
        for name in imported_modules(path)
        if any(name == bad or name.startswith(bad + ".") for bad in FORBIDDEN[layer])
    ]
    assert offences == []


def test_protocol_and_policies_import_without_torch() -> None:
    code = (
        "import sys; import leyline.protocol, leyline.protocol.client, leyline.policies; "
        "bad = [m for m in ('torch', 'transformers') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_session_core_and_the_sglang_backend_import_without_torch() -> None:
    """Both backends share the core; the SGLang server process imports it beside SGLang's
    own torch, and ``make test`` runs the SGLang backend's logic without SGLang."""
    code = (
        "import sys; import leyline.server_adapter.core.routes, "
        "leyline.server_adapter.core.service, leyline.server_adapter.sglang.backend; "
        "bad = [m for m in ('torch', 'transformers', 'sglang') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_engine_does_not_import_its_sessions() -> None:
    """Sessions use the engine, never the other way round (no import circle)."""
    assert "leyline.server_adapter.session" not in imported_modules(
        ROOT / "server_adapter" / "engine.py"
    )
    assert not any(
        node.module == "session"
        for node in ast.walk(ast.parse((ROOT / "server_adapter" / "engine.py").read_text()))
        if isinstance(node, ast.ImportFrom) and node.level == 1
    )
