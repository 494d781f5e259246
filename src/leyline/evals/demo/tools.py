"""The demo's tools, which really run: list, read and grep the files of a project folder.

The bundled project (``sample_project/``, package data) is a small order-pricing library
with a bug report; the tools never leave its folder.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from importlib.resources import as_file, files
from pathlib import Path
from typing import Any

MAX_OUTPUT_CHARS = 4000
"""A tool output longer than this is cut (and says so)."""


def sample_project() -> Path:
    """The bundled sample project's folder (installed as package data)."""
    resource = files("leyline.evals.demo") / "sample_project"
    with as_file(resource) as path:  # a real folder for a regular install
        return Path(path)


class ProjectTools:
    """``list_files``, ``read_file`` and ``grep`` over one folder; outputs are text."""

    def __init__(self, root: Path) -> None:
        self.root = root.resolve()
        self._tools: dict[str, Callable[..., str]] = {
            "list_files": self.list_files,
            "read_file": self.read_file,
            "grep": self.grep,
        }

    def run(self, name: str, arguments: str) -> str:
        """Run a tool call as the model would send it (JSON arguments); errors are text."""
        try:
            args: Any = json.loads(arguments or "{}")
            return _cut(self._tools[name](**args))
        except KeyError:
            return f"error: no tool named {name!r}"
        except (TypeError, ValueError, OSError) as exc:
            return f"error: {exc}"

    def list_files(self, path: str = ".") -> str:
        folder = self._inside(path)
        names = sorted(
            str(p.relative_to(self.root))
            for p in folder.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts
        )
        return "\n".join(f"{n}  ({(self.root / n).stat().st_size} bytes)" for n in names)

    def read_file(self, path: str) -> str:
        lines = self._inside(path).read_text(encoding="utf-8").splitlines()
        numbered = (f"{i:>3} | {line}" for i, line in enumerate(lines, start=1))
        return "\n".join([f"{path} ({len(lines)} lines)", *numbered])

    def grep(self, pattern: str, path: str = ".") -> str:
        regex = re.compile(pattern)
        folder = self._inside(path)
        hits = []
        for file in sorted(p for p in folder.rglob("*") if p.is_file()):
            if "__pycache__" in file.parts:
                continue
            text = file.read_text(encoding="utf-8", errors="replace")
            for number, line in enumerate(text.splitlines(), start=1):
                if regex.search(line):
                    hits.append(f"{file.relative_to(self.root)}:{number}: {line.strip()}")
        return "\n".join(hits) if hits else f"no match for {pattern!r}"

    def _inside(self, path: str) -> Path:
        target = (self.root / path).resolve()
        if target != self.root and self.root not in target.parents:
            raise ValueError(f"{path!r} is outside the project")
        if not target.exists():
            raise ValueError(f"{path!r} does not exist")
        return target


def _cut(text: str) -> str:
    if len(text) <= MAX_OUTPUT_CHARS:
        return text
    return text[:MAX_OUTPUT_CHARS] + f"\n[... cut at {MAX_OUTPUT_CHARS} characters]"


def _spec(name: str, description: str, properties: Mapping[str, str], required: list[str]) -> Any:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {
                    k: {"type": "string", "description": v} for k, v in properties.items()
                },
                "required": required,
            },
        },
    }


TOOL_SPECS: list[Any] = [
    _spec("list_files", "List the files of the project.", {"path": "folder"}, []),
    _spec("read_file", "Read a file, with line numbers.", {"path": "file path"}, ["path"]),
    _spec(
        "grep",
        "Search the project's files for a regular expression.",
        {"pattern": "regular expression", "path": "folder"},
        ["pattern"],
    ),
]
"""The OpenAI tool list sent with every request (the server renders it into the prompt)."""
