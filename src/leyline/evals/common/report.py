"""The results folder of one eval run: ``report.json``, ``report.md`` and PNG plots."""

from __future__ import annotations

import json
import math
import platform
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any


def results_dir(name: str, out: Path | None) -> Path:
    """``out`` if given, else ``results/<name>-<UTC time>`` under the current folder."""
    if out is None:
        stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
        out = Path("results") / f"{name}-{stamp}"
    out.mkdir(parents=True, exist_ok=True)
    return out


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub Markdown table; floats get 4 significant digits, None prints as a dash."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(value) for value in row) + " |" for row in rows]
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.4g}"
    return str(value)


def json_fields(obj: Any, *names: str, **extra: Any) -> dict[str, Any]:
    """``obj``'s attributes ``names`` as a JSON object, in that order, then ``extra``: tuples
    become lists, and values with a ``to_json`` (alone or in a tuple) their JSON."""
    return {name: _plain(getattr(obj, name)) for name in names} | extra


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_plain(item) for item in value]
    return value.to_json() if hasattr(value, "to_json") else value


def environment() -> dict[str, Any]:
    """What a reader needs to compare two reports: interpreter, platform, package versions."""
    versions: dict[str, str] = {}
    for name in ("torch", "transformers", "leyline"):
        try:
            versions[name] = version(name)
        except PackageNotFoundError:  # not installed: not reported
            continue
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "machine": platform.machine(),
        "packages": versions,
    }


@dataclass(slots=True)
class Report:
    """Collects one run's figures; ``write`` puts JSON, Markdown and plots in ``folder``.

    ``data`` is the machine-readable result (``report.json``, plus ``config`` and
    ``environment``); ``sections`` are Markdown blocks in order (``report.md``); ``plots``
    are callables that draw one PNG each, given its path (run only when matplotlib is
    installed, so a base install still gets JSON and Markdown).
    """

    name: str
    title: str
    config: dict[str, Any]
    folder: Path
    data: dict[str, Any] = field(default_factory=dict)
    sections: list[str] = field(default_factory=list)
    plots: dict[str, Callable[[Path], None]] = field(default_factory=dict)

    def section(self, heading: str, body: str) -> None:
        self.sections.append(f"## {heading}\n\n{body.strip()}\n")

    def write(self) -> list[Path]:
        written = [self.folder / "report.json", self.folder / "report.md"]
        payload = {
            "eval": self.name,
            "created": datetime.now(UTC).isoformat(timespec="seconds"),
            "config": self.config,
            "environment": environment(),
            **self.data,
        }
        written[0].write_text(json.dumps(payload, indent=2, default=_json_default) + "\n")
        head = f"# {self.title}\n\n" + "\n".join(f"- {k}: `{v}`" for k, v in self.config.items())
        written[1].write_text(head + "\n\n" + "\n".join(self.sections))
        if self.plots and _have_matplotlib():
            import matplotlib

            matplotlib.use("Agg")
            for file_name, draw in self.plots.items():
                path = self.folder / file_name
                draw(path)
                written.append(path)
        return written


def _have_matplotlib() -> bool:
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def _json_default(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")
