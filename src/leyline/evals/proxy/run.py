"""The eval: a server (embedded or ``base_url``), the tasks in three arms, the report."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

import openai

from leyline.evals.common import Report, progress, results_dir
from leyline.policies import LeylineOpenAI
from leyline.protocol.client import LeylineClient

from .report import fill
from .runner import ProxyRunner, RunSettings
from .summary import summarize
from .tasks import make_tasks


@dataclass(frozen=True, slots=True)
class ProxyOptions:
    tasks: int = 60
    stale: tuple[int, ...] = (1, 2, 4)
    keep_last: int = 2
    seed: int = 0
    base_url: str | None = None
    """An OpenAI-compatible endpoint (``http://host:port/v1``); None: the embedded server."""
    api_key: str | None = None
    model: str = ""
    """The model name sent; "": the embedded SmolLM2 / the endpoint's first model."""
    out: Path | None = None
    fast: bool = False
    progress: bool = True
    summarize: bool = False
    """Also run the Summarize arm (the server writes each summary: one more request)."""


def run_proxy(options: ProxyOptions, out: TextIO | None = None) -> dict[str, Any]:
    """Run the eval, write ``report.json``, ``report.md``, ``proxy.png``; return report data."""
    out = out or sys.stdout
    folder = results_dir("proxy", options.out)
    tasks = make_tasks(options.seed, options.tasks, options.stale)
    t0 = time.perf_counter()
    with _endpoint(options, out) as (base_url, label):
        client = openai.OpenAI(base_url=base_url, api_key=options.api_key or "EMPTY", timeout=300)
        model = options.model or (client.models.list().data[0].id if options.base_url else "")
        model = model or "smollm2"
        support = LeylineOpenAI(client).probe()
        print(f"Server: {base_url} ({label}): {support.note}", file=out)
        leyline = None
        if support.leyline:
            root = base_url.rstrip("/").removesuffix("/v1")
            leyline = LeylineClient(root, api_key=options.api_key, timeout=300)
        else:
            print(
                "No Leyline: the splice arm runs as re-prefill, and answers are scored from "
                "the first token of the chat reply.",
                file=out,
            )
        client.chat.completions.create(  # warm-up: lazy initialisation off the first task
            model=model, messages=[{"role": "user", "content": "Hello"}], max_tokens=1
        )
        stamp = datetime.now(UTC).strftime("%Y%m%d%H%M%S%f")
        settings = RunSettings(
            model=model,
            keep_last=options.keep_last,
            session_prefix=stamp,
            summarize=options.summarize,
        )
        runner = ProxyRunner(client, settings, leyline=leyline)
        try:
            results = [
                runner.run(task)
                for task in progress(tasks, desc="proxy tasks", enabled=options.progress)
            ]
        finally:
            if leyline is not None:
                leyline.close()
    elapsed = time.perf_counter() - t0
    records = [r.to_json() for r in results]
    summary = summarize(records)
    config = {
        "command": "leyline eval proxy" + (" --fast" if options.fast else ""),
        **{k: v for k, v in asdict(options).items() if k not in ("progress", "out", "api_key")},
        "model": model,
        "policy": f"TruncateOldToolOutputs(keep_last={options.keep_last})",
    }
    report = Report("proxy", "leyline eval proxy: stale tool outputs", config, folder)
    report.data = {
        "server": {"base_url": base_url, "label": label, "leyline": support.leyline},
        "support": support.note,
        "scripted": "the agent's tool calls and the tools' outputs (generated from the seed)",
        "real": "the model, the server, the policy, the cache edits, the scoring logprobs",
        "elapsed_s": elapsed,
        "summary": summary,
        "tasks": records,
    }
    fill(report, summary, options.keep_last)
    written = report.write()
    print(_text(summary), file=out)
    print(f"Wrote {', '.join(str(p) for p in written)} ({elapsed:.0f} s)", file=out)
    return report.data


@contextlib.contextmanager
def _endpoint(options: ProxyOptions, out: TextIO) -> Iterator[tuple[str, str]]:
    """The base URL to talk to, and a label for the model behind it."""
    if options.base_url is not None:
        yield options.base_url, options.model or "the served model"
        return
    from leyline.evals.demo.server import EmbeddedServer

    print("Starting the embedded server (SmolLM2, CPU) ...", file=out)
    with EmbeddedServer(options.model or "smollm2") as server:
        yield server.base_url, f"{server.label}, embedded, CPU"


def _text(summary: dict[str, Any]) -> str:
    lines = [f"{summary['tasks']} tasks; chance {summary['chance']:.1%}"]
    lines.append(f"  {'arm':<10} {'accuracy [95% CI]':<26} {'prefilled':>10} {'reused':>10}")
    for arm, facts in summary["arms"].items():
        acc = facts["accuracy"]
        low, high = acc["ci95"]
        cell = f"{acc['successes']}/{acc['trials']} {acc['rate']:.1%} [{low:.0%}, {high:.0%}]"
        lines.append(f"  {arm:<10} {cell:<26} {facts['prefilled']:>10,} {facts['reused']:>10,}")
    agree = summary["agreement"]["same_choice"]
    lines.append(f"  splice vs re-prefill: same choice in {agree['successes']}/{agree['trials']}")
    return "\n".join(lines)
