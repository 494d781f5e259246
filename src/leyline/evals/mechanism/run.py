"""``leyline eval mechanism``: the server (embedded or ``--base-url``), the replay, the report."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import openai

from leyline.evals.common import Report, results_dir

from .metrics import Selector, ServerCounter, metrics_url
from .replay import Sample, Settings, requests_in, run_level
from .report import (
    COUNTER_TEXT,
    concurrency_note,
    counter_table,
    latency_table,
    overhead_table,
    plot_latency,
    pool_table,
    ratio_table,
)
from .stats import overall, summarize
from .trajectories import Trajectory

if TYPE_CHECKING:
    from leyline.engine.work_estimates import SchedulePolicy


@dataclass(frozen=True, slots=True)
class Options:
    settings: Settings
    pool: tuple[Trajectory, ...]
    base_url: str | None = None
    api_key: str | None = None
    overhead_reps: int = 15
    out: Path | None = None
    progress: bool = True
    serial: bool = False
    """Embedded server: one request's model work after another (one job at a time, each
    turn's generation inside it), the server as it was before its scheduler: the baseline."""
    decode_share: float | None = None
    """Embedded server: ``leyline serve --decode-share`` (None: its default)."""
    schedule: SchedulePolicy | None = None
    """Embedded server: ``leyline serve --schedule`` (None: its default, ``srpt``)."""
    server_counter: Selector | None = None
    """A counter on the server's /metrics, read before and after each arm's clients of each
    level; implies ``arms_apart`` (a whole server's count is one arm's only then)."""


@contextmanager
def _server(options: Options) -> Iterator[tuple[str, Any]]:
    """(base URL, the app or None): the embedded `leyline serve`, or ``--base-url``."""
    if options.base_url:
        yield options.base_url, None
        return
    from leyline.evals.demo.server import EmbeddedServer

    # Sessions only, no shared prefix cache: each arm reuses what its own session holds.
    model = options.settings.model
    scheduling: dict[str, Any] = {"max_running_jobs": 1} if options.serial else {}
    if options.decode_share is not None:
        scheduling["decode_share"] = options.decode_share
    if options.schedule is not None:
        scheduling["schedule"] = options.schedule
    tokens = options.settings.max_tokens
    with EmbeddedServer(model, max_new_tokens=tokens, **scheduling) as embedded:
        yield embedded.base_url, embedded.app


def run_mechanism(options: Options, out: Any = None) -> dict[str, Any]:
    out = out or sys.stdout
    settings, pool = options.settings, list(options.pool)
    selector = options.server_counter
    if selector is not None:
        settings = replace(settings, arms_apart=True)
    folder = results_dir("mechanism", options.out)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    samples: list[Sample] = []
    grown: dict[int, dict[str, float]] = {}
    overhead = None
    with _server(options) as (base_url, app):
        base = openai.OpenAI(
            base_url=base_url, api_key=options.api_key or "-", timeout=900, max_retries=0
        )
        counter = None
        if selector is not None:
            counter = ServerCounter(metrics_url(base_url), selector, options.api_key)
            counter()  # a selector that matches nothing fails now, not after the replay
        _warm(base, settings.model)
        total = requests_in(settings, pool)
        run_id = f"mech-{stamp}"
        with _bar(total, options.progress) as tick:
            for level in settings.levels:
                done, grown[level] = run_level(base, settings, pool, level, tick, run_id, counter)
                samples += done
        scheduler = _scheduler_facts(app)
        if app is not None and options.overhead_reps > 0:
            from .overhead import measure_overhead

            reps, show = options.overhead_reps, options.progress
            overhead = measure_overhead(app, base_url, reps, f"mech-{stamp}", show_progress=show)
    by_level = grown if selector is not None else None
    table = summarize(samples, by_level)
    facts = overall(samples, by_level)
    pool_facts = _pool_facts(pool)
    wall = time.perf_counter() - t0
    report = Report(
        name="mechanism",
        title="Mechanism: splice vs prefix-cache re-prefill on replayed trajectories",
        config=asdict(settings)
        | {
            "server": options.base_url
            or f"embedded leyline serve{' --serial' if options.serial else ''}",
            "trajectories": len(pool),
            "decode_share": options.decode_share,
            "schedule": options.schedule,
            "server_counter": None if selector is None else str(selector),
        },
        folder=folder,
    )
    report.data = {
        "machine": {
            "cpus": os.cpu_count(),
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
        },
        "wall_s": wall,
        "pool": pool_facts,
        "overall": facts,
        "summary": table,
        "overhead": overhead,
        "scheduler": scheduler,
        "samples": [asdict(s) for s in samples],
    }
    report.section("Trajectories replayed", pool_table(pool_facts))
    note = concurrency_note(options.base_url, settings.arms_apart, selector is not None)
    report.section("Per concurrency level", note + "\n\n" + latency_table(table))
    ratios = ratio_table(table) + "\n\n" + _overall_text(facts) + _scheduler_text(scheduler)
    report.section("Ratios and agreement", ratios)
    counters = None if selector is None else counter_table(table, facts, str(selector))
    if counters is not None:
        report.section("Server counter", COUNTER_TEXT + "\n\n" + counters)
    if overhead is not None:
        report.section(
            "HTTP + protocol overhead (paired medians)",
            f"{overhead['prompt_tokens']} prompt tokens.\n\n" + overhead_table(overhead),
        )
    report.plots["latency_and_hits.png"] = lambda path: plot_latency(table, path)
    written = report.write()
    print(note, file=out)
    print(latency_table(table), file=out)
    print(ratio_table(table), file=out)
    print(_overall_text(facts) + _scheduler_text(scheduler), file=out)
    if counters is not None:
        print(counters, file=out)
    if overhead is not None:
        print(overhead_table(overhead), file=out)
    print(f"\n{wall:.0f} s wall -> {', '.join(str(p) for p in written)}", file=out)
    return report.data


def _scheduler_facts(app: Any) -> dict[str, Any] | None:
    """The embedded server's scheduler counters after the replay (None for --base-url)."""
    if app is None:
        return None
    stats = app.state.service.backend.scheduler.stats()
    return asdict(stats) | {
        "mean_decode_batch": stats.decoded_rows / stats.decode_steps if stats.decode_steps else 0
    }


def _scheduler_text(scheduler: dict[str, Any] | None) -> str:
    if scheduler is None:
        return ""
    return (
        f" Server scheduler: {scheduler['jobs']} jobs in {scheduler['slices']} slices; "
        f"{scheduler['decode_steps']} decode steps, mean batch "
        f"{scheduler['mean_decode_batch']:.2f} rows, largest {scheduler['max_batch']}."
    )


def _overall_text(facts: dict[str, Any]) -> str:
    hit, agree = facts["hit_rate"], facts["agreement"]
    return (
        f"All levels: replay cache-hit rate splice {hit['splice']:.1%} vs re-prefill "
        f"{hit['reprefill']:.1%} ({facts['hit_rate_gain_pp']:+.1f} pp); of the reusable "
        f"tokens (the prompt's tokens found in the cached revision) splice reused "
        f"{facts['reuse_of_reusable']['splice']:.1%}, re-prefill "
        f"{facts['reuse_of_reusable']['reprefill']:.1%}; prefilled tokens "
        f"{facts['prefilled_tokens']['splice']} vs {facts['prefilled_tokens']['reprefill']}; "
        f"first-token argmax agreement with the warm-prefix path {agree['agree']}/"
        f"{agree['pairs']} turns ({agree['spliced_agree']}/{agree['spliced_pairs']} of the "
        "turns that ran as a splice)."
    )


def _pool_facts(pool: Sequence[Trajectory]) -> list[dict[str, Any]]:
    sources: dict[str, dict[str, Any]] = {}
    for t in pool:
        empty = {"source": t.source, "count": 0, "turns": 0, "chars": 0}
        entry = sources.setdefault(t.source, empty)
        entry["count"] += 1
        entry["turns"] += len(t.calls)
        entry["chars"] += sum(len(c.output) for c in t.calls)
    return list(sources.values())


@contextmanager
def _bar(total: int, enabled: bool) -> Iterator[Any]:
    if not enabled:
        yield lambda: None
        return
    from tqdm import tqdm

    with tqdm(total=total, desc="requests", unit="req", dynamic_ncols=True) as bar:
        yield lambda: bar.update(1)


def _warm(base: openai.OpenAI, model: str) -> None:
    """One stateless request first: the first forward pays one-time setup costs."""
    messages = [{"role": "user", "content": "Hello"}]
    base.chat.completions.create(model=model, messages=messages, max_tokens=1, temperature=0)  # type: ignore[arg-type]
