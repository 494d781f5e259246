"""``leyline eval robustness``: one embedded server with two tenants, five checks, a report."""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

import httpx

from leyline.evals.common import Report, progress, results_dir

from .checks import Checker, summarize
from .fuzz import Fuzzer, Limits
from .health import health_under_render
from .leaks import Client, cross_tenant, redaction
from .races import lost_updates
from .report import fill, targets, text
from .server import ServerLimits, serve
from .source import RandomSource
from .wire import Wire


@dataclass(frozen=True, slots=True)
class Options:
    mode: str = "default"
    """``fast`` (CI), ``default`` or ``full`` (the issue's targets); sizes below."""
    requests: int = 2000
    clients: int = 8
    turns: int = 20
    trials: int = 3
    renders: int = 3
    messages: int = 1600
    seed: int = 0
    model: str = "smollm2"
    out: Path | None = None
    progress: bool = True


def run_robustness(options: Options, out: TextIO | None = None) -> dict[str, Any]:
    out = out or sys.stdout
    folder = results_dir("robustness", options.out)
    limits = ServerLimits()
    t0 = time.perf_counter()
    print(f"Starting leyline serve ({options.model}, CPU, two tenants) ...", file=out)
    with serve(folder, limits, options.model) as served:
        alpha, bravo = served.keys["alpha"], served.keys["bravo"]
        _warm(served.base_url, alpha)
        stamp = time.strftime("rb%H%M%S")
        phases: dict[str, Any] = {}
        phases["fuzz"] = _fuzz(served.base_url, alpha, limits, options)
        with _bar(options.clients * options.turns, "lost-update writes", options.progress) as tick:
            phases["lost_updates"] = lost_updates(
                served.base_url, alpha, options.clients, options.turns, tick, stamp
            )
        phases["redaction"], phases["cross_tenant"] = _leaks(
            served.base_url, alpha, bravo, stamp, options
        )
        print("Measuring /health while long chats render ...", file=out)
        phases["health"] = health_under_render(
            served.base_url, alpha, options.messages, options.renders
        )
        internal = served.log.read_text(errors="replace").count("internal error on")
    wall = time.perf_counter() - t0
    config = {
        "command": "leyline eval robustness"
        + ("" if options.mode == "default" else f" --{options.mode}"),
        **{k: v for k, v in asdict(options).items() if k not in ("out", "progress")},
        "server": asdict(limits) | {"tenants": 2, "prefix_cache": "1 GiB (default)"},
    }
    report = Report("robustness", "leyline eval robustness", config, folder)
    report.data = {
        "wall_s": wall,
        "machine": {"cpus": os.cpu_count(), "loadavg_after": os.getloadavg()},
        "internal_errors_logged": internal,
        "targets": targets(phases, options.mode),
        **phases,
    }
    fill(report, report.data)
    written = report.write()
    print(text(report.data), file=out)
    print(f"\n{wall:.0f} s wall -> {', '.join(str(p) for p in written)}", file=out)
    return report.data


def _fuzz(base_url: str, key: str, limits: ServerLimits, options: Options) -> dict[str, Any]:
    wire = Wire(base_url, key)
    checker = Checker(wire)
    fuzz_limits = Limits(
        limits.max_directives,
        limits.max_replacement_tokens,
        limits.max_body_bytes,
        limits.max_session_tokens,
    )
    fuzzer = Fuzzer(RandomSource(options.seed), fuzz_limits)
    t0 = time.perf_counter()
    for _ in progress(range(options.requests), desc="fuzz requests", enabled=options.progress):
        checker.step(fuzzer)
    seconds = time.perf_counter() - t0
    checker.sweep()
    checker.cleanup()
    wire.close()
    return summarize(checker.tally, seconds)


def _leaks(
    base_url: str, alpha: str, bravo: str, stamp: str, options: Options
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    a, b = Client(base_url, alpha), Client(base_url, bravo)
    redacted: list[dict[str, Any]] = []
    crossed: list[dict[str, Any]] = []
    try:
        trials = progress(range(options.trials), desc="leak trials", enabled=options.progress)
        for trial in trials:
            redacted += redaction(a, trial, stamp)
            crossed += cross_tenant(a, b, trial, stamp)
    finally:
        a.close()
        b.close()
    return redacted, crossed


def _warm(base_url: str, key: str) -> None:
    """One request first: the first forward pass pays one-time setup costs."""
    body = {"prompt": "Hello", "max_tokens": 1}
    headers = {"Authorization": f"Bearer {key}"}
    httpx.post(f"{base_url}/v1/completions", json=body, headers=headers, timeout=300)


@contextmanager
def _bar(total: int, desc: str, enabled: bool) -> Iterator[Callable[[], None]]:
    if not enabled or importlib.util.find_spec("tqdm") is None:
        yield lambda: None
        return
    from tqdm import tqdm

    with tqdm(total=total, desc=desc, dynamic_ncols=True, leave=False) as bar:
        yield lambda: bar.update(1)
