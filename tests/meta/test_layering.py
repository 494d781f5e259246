"""The house rules of the layers, checked on the source: who may import whom."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from .fresh_python import loaded_in_fresh_python

ROOT = Path(__file__).resolve().parents[2]

SRC = ROOT / "src" / "leyline"
LAYERS = ("protocol", "policies", "core", "engine", "serve", "sglang", "vllm", "evals", "cli")
# Each layer and the layers of ours it may import (docs/architecture.md has the picture).
ALLOWED = {
    "protocol": set(),
    "policies": {"protocol"},
    "core": {"protocol"},
    "engine": {"protocol", "core"},
    "serve": {"protocol", "core", "engine"},
    "sglang": {"protocol", "core", "engine", "serve"},
    "vllm": {"protocol", "core", "engine", "serve"},
    "cli": {"protocol", "core", "engine", "serve", "evals"},
    "evals": {"protocol", "policies", "core", "engine", "serve"},
}
# The SDK installs without torch or transformers; the core (which the SGLang server process
# imports beside SGLang) without torch, though its chat rendering uses a tokenizer.
BANNED_PACKAGES = {"protocol": ("torch", "transformers"), "policies": ("torch", "transformers")}
BANNED_PACKAGES["core"] = ("torch",)


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_every_folder_of_src_leyline_is_a_layer() -> None:
    folders = {p.name for p in SRC.iterdir() if (p / "__init__.py").exists()}
    assert folders == set(LAYERS)


@pytest.mark.parametrize("layer", LAYERS)
def test_layer_imports_only_what_it_may(layer: str) -> None:
    banned = [f"leyline.{other}" for other in LAYERS if other not in ALLOWED[layer] | {layer}]
    banned += BANNED_PACKAGES.get(layer, ())
    offences = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in sorted((SRC / layer).rglob("*.py"))
        for name in imported_modules(path)
        if any(name == bad or name.startswith(bad + ".") for bad in banned)
    ]
    assert offences == []


def test_protocol_and_policies_import_without_torch() -> None:
    statement = "import leyline.protocol, leyline.protocol.client, leyline.policies"
    assert loaded_in_fresh_python(statement) == []


def test_the_session_core_and_the_sglang_backend_import_without_torch() -> None:
    """Both backends share the core; the SGLang server process imports it beside SGLang's
    own torch, and ``make test`` runs the SGLang backend's logic without SGLang."""
    statement = "import leyline.core.routes, leyline.core.service, leyline.sglang.backend"
    assert loaded_in_fresh_python(statement) == []


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def eager_imports(path: Path) -> set[str]:
    """Modules of ours imported when ``path`` is: top-level statements only, not the
    ``TYPE_CHECKING`` block nor imports inside functions."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = (
        module_name(path) if path.name == "__init__.py" else module_name(path).rsplit(".", 1)[0]
    )
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    [*package.split(".")[: len(package.split(".")) - node.level + 1], base]
                )
            names.add(base.rstrip("."))
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return {name for name in names if name.startswith("leyline.")}


def test_no_module_imports_itself_back() -> None:
    """An import circle means two modules are one in two files: none may exist."""
    files = {module_name(p): p for p in SRC.rglob("*.py")}
    graph = {name: eager_imports(path) & files.keys() - {name} for name, path in files.items()}
    circles: list[list[str]] = []
    state: dict[str, int] = {}

    def visit(name: str, trail: list[str]) -> None:
        state[name] = 1
        for nxt in sorted(graph[name]):
            if state.get(nxt) == 1:
                circles.append([*trail[trail.index(nxt) :], nxt] if nxt in trail else [name, nxt])
            elif nxt not in state:
                visit(nxt, [*trail, nxt])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert circles == []
