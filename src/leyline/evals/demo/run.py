"""``leyline demo``: the embedded server (or ``--base-url``), the episode, the report."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any, TextIO

import openai

from leyline.policies import CallRecord, LeylineOpenAI

from .episode import ARMS, EpisodeSettings, TurnResult, TwoArmEpisode
from .report import plot, summary, summary_text, table, write_json
from .tools import ProjectTools, sample_project


@dataclass(frozen=True, slots=True)
class DemoOptions:
    episode: EpisodeSettings
    base_url: str | None = None
    """An OpenAI-compatible endpoint (``http://host:port/v1``); None: the embedded server."""
    api_key: str | None = None
    out: Path | None = None
    """Results folder; None: ``results/demo-<timestamp>`` under the current folder."""
    progress: bool = True


def what_is_real(settings: EpisodeSettings, server: str) -> str:
    return "\n".join(
        [
            "What is real and what is scripted in this demo:",
            f"  scripted: the agent's {settings.turns} tool-call decisions (a fixed list, the "
            "same in both arms; a 135M model is not a reliable tool caller)",
            "  real:     the tools (list_files, read_file, grep run on the bundled sample "
            "project),",
            f"            the model ({server}): it generates after every tool output, "
            f"greedy, {settings.max_tokens} tokens,",
            f"            the policy (TruncateOldToolOutputs, keep_last={settings.keep_last}) and "
            "the cache edits the server makes:",
            "            splice arm: the policy's stubs go as Leyline splice directives, the "
            "downstream KV is kept and re-rotated;",
            "            re-prefill arm: the same edited messages without directives, the server "
            "re-prefills from the first change.",
            "  not kept: the model's replies; each is scored, then replaced by the next scripted "
            "call.",
        ]
    )


def run_demo(options: DemoOptions, out: TextIO | None = None) -> dict[str, Any]:
    """Run the demo, print its table and summary, write JSON and PNG; return the summary."""
    out = out or sys.stdout
    settings = options.episode
    folder = options.out or Path("results") / f"demo-{datetime.now():%Y%m%d-%H%M%S}"
    folder.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with _endpoint(options, settings.model, out) as (base_url, label):
        client = openai.OpenAI(base_url=base_url, api_key=options.api_key or "EMPTY", timeout=300)
        if not settings.model:
            served = client.models.list().data[0].id if options.base_url else "smollm2"
            settings = replace(settings, model=served)
        support = LeylineOpenAI(client).probe()
        print(what_is_real(settings, label), file=out)
        print(f"Server: {base_url}: {support.note}", file=out)
        if not support.leyline:
            print(
                "This server does not speak Leyline: both arms send edited messages and "
                "re-prefill, so they should look alike.",
                file=out,
            )
        _warm_up(client, settings.model)
        turns = _run_episode(client, settings, options.progress)
    elapsed = time.perf_counter() - t0
    facts = summary(turns)
    print("\n" + table(turns) + "\n", file=out)
    print(summary_text(facts, settings.top_logprobs), file=out)
    header = {
        "command": "leyline demo",
        "settings": asdict(settings),
        "server": {"base_url": base_url, "model": label, "leyline": support.leyline},
        "support": support.note,
        "scripted": "the agent's tool-call decisions",
        "real": "tools, model generation, policy edits, cache edits",
        "elapsed_s": elapsed,
    }
    write_json(folder / "demo.json", header, turns)
    title = f"leyline demo: TruncateOldToolOutputs(keep_last={settings.keep_last}), {label}"
    plot(folder / "demo.png", turns, title)
    print(f"\nWrote {folder / 'demo.json'} and {folder / 'demo.png'} ({elapsed:.0f} s)", file=out)
    return facts


@contextlib.contextmanager
def _endpoint(options: DemoOptions, model: str, out: TextIO) -> Iterator[tuple[str, str]]:
    """The base URL to talk to, and a label for the model behind it."""
    if options.base_url is not None:
        yield options.base_url, f"{model or 'the served model'} at {options.base_url}"
        return
    from .server import EmbeddedServer

    model = model or "smollm2"
    print(f"Starting the embedded server ({model}, CPU) ...", file=out)
    with EmbeddedServer(model) as server:
        print(f"  {server.label} loaded in {server.load_s:.1f} s", file=out)
        yield server.base_url, f"{server.label}, embedded, CPU"


def _warm_up(client: openai.OpenAI, model: str) -> None:
    """One throwaway request, so that the first turn does not pay for lazy initialisation."""
    client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hello"}], max_tokens=1
    )


def _run_episode(
    client: openai.OpenAI, settings: EpisodeSettings, progress: bool
) -> list[TurnResult]:
    from tqdm import tqdm

    bar = tqdm(
        total=settings.turns * len(ARMS),
        desc="episode",
        unit="call",
        file=sys.stderr,
        disable=not progress,
    )

    def on_call(arm: str, record: CallRecord) -> None:
        bar.set_postfix_str(f"{arm}: {record.path}, {record.latency_s * 1000:.0f} ms")
        bar.update()

    prefix = f"demo-{datetime.now():%H%M%S%f}"
    tools = ProjectTools(sample_project())
    try:
        return TwoArmEpisode(client, settings, tools, session_prefix=prefix, on_call=on_call).run()
    finally:
        bar.close()
