"""``leyline eval erratum``: field refresh vs erratum vs full recompute on decision prompts.

Imports nothing heavy at import time (the CLI lists every eval without loading torch).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict
from typing import Any

from ..common.cli import add_run_options

HELP = "erratum vs field-only KV refresh vs recompute: decision recovery, prefix-cache hits"
DESCRIPTION = """\
"Models Take Notes at Prefill": a decision read after a record whose field changed
(order status -> refund, role -> access, stock -> shipping, risk -> approval). Arms on the
reference engine: field-only KV refresh (splice of the field's tokens, downstream KV kept),
erratum appended (the protocol's ERRATUM directive), the same note restating the old value
(control), and the oracle (the record recomputed with the new value). Decision recovery =
agreement with the oracle on cases where the oracle's decision flips. Also the shared
prefix cache's hit rate for the updated prompt sent as erratum vs as an in-prefix edit, in
the decision prompts (field late) and with the record first in a long static prompt (field
early, hit rates only).
Writes report.json, report.md and erratum.png; see docs/evals-erratum.md.
"""

DEFAULT_CASES = 12
FAST_CASES = 2
# Field-early cases per template: two ~1,000-token prefills each, the slow part;
# the hit rate is set by the layout's geometry, so a few cases show it.
EARLY_CASES = 3
FAST_EARLY_CASES = 1
PREFIX_CACHE_BYTES = 256 << 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2", help="smollm2, a .gguf, or an HF dir")
    parser.add_argument(
        "--cases",
        type=int,
        default=None,
        help=f"cases per template (default {DEFAULT_CASES}; {FAST_CASES} with --fast)",
    )
    parser.add_argument(
        "--early-cases",
        type=int,
        default=None,
        help=f"field-early cases per template (default {EARLY_CASES}; {FAST_EARLY_CASES} "
        "with --fast; 0 skips the layout)",
    )
    parser.add_argument("--templates", default=None, help="comma list (default: all four)")
    parser.add_argument("--device", default="cpu", help="torch device (e.g. cuda)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    add_run_options(parser, seed="seed of the case draw", threads=True, fast="short mode (CI)")


def run(args: argparse.Namespace) -> int:
    import torch

    from leyline.engine.engine import Engine
    from leyline.engine.kv.prefix_cache import PrefixCache
    from leyline.engine.models import load_model
    from leyline.evals.common import Report, progress, results_dir

    from .arms import Runner
    from .body import FAST_SECTIONS, body
    from .early import run_early, summarize_early
    from .report import add_sections, plot, records
    from .stats import summarize
    from .templates import TEMPLATES, draw_cases

    torch.set_num_threads(args.threads)
    count = args.cases if args.cases is not None else FAST_CASES if args.fast else DEFAULT_CASES
    chosen = [t for t in TEMPLATES if args.templates is None or t.name in args.templates.split(",")]
    early_count = args.early_cases
    if early_count is None:
        early_count = FAST_EARLY_CASES if args.fast else EARLY_CASES
    if not chosen or count < 1 or early_count < 0:
        print("erratum: nothing to run (check --templates / --cases)", file=sys.stderr)
        return 2
    out = results_dir("erratum", args.out)

    t0 = time.perf_counter()
    loaded = load_model(args.model, dtype=getattr(torch, args.dtype))
    loaded.model.to(args.device)
    # Two engines on one model: the arms reuse only their own sessions' KV; the other holds
    # the shared prefix cache whose hits are measured.
    runner = Runner(Engine(loaded), Engine(loaded, prefix_cache=PrefixCache(PREFIX_CACHE_BYTES)))
    sections = FAST_SECTIONS if args.fast else None
    cases = [case for t in chosen for case in draw_cases(t, count, args.seed)]
    # The field-early layout reuses the first cases' records (same field changes).
    early_cases = [c for t in chosen for c in draw_cases(t, early_count, args.seed)]
    results, early = [], []
    try:
        for case in progress(cases, desc="erratum cases", enabled=not args.no_progress):
            results.append(runner.run(case))
        for case in progress(early_cases, desc="field early", enabled=not args.no_progress):
            early.append(run_early(runner, case, body(sections)))
    finally:
        runner.close()
    summary = summarize(results)
    summary["field_early"] = summarize_early(early)

    config = {
        "model": loaded.label,
        "model_source": loaded.source,
        "device": args.device,
        "cases_per_template": count,
        "templates": [t.name for t in chosen],
        "seed": args.seed,
        "fast": args.fast,
        "threads": args.threads,
        "field_early_cases_per_template": early_count,
        "field_early_body_sections": sections,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    report = Report("erratum", "Erratum vs field-only refresh vs recompute", config, out)
    report.data = {
        "summary": summary,
        "records": records(results, summary),
        "field_early_records": [asdict(r) for r in early],
    }
    add_sections(report, summary, results)
    report.plots["erratum.png"] = plot(summary)
    written = report.write()

    overall = summary["overall"]
    rec = overall["recovery"]
    hits, early_hits = overall["hit_rate"], summary["field_early"]["overall"]["hit_rate"]
    print(
        f"erratum: {overall['qualifying']}/{overall['cases']} cases qualify; recovery "
        f"field-only {rec['field_only']['rate']}, erratum {rec['erratum']['rate']}, "
        f"control {rec['erratum_control']['rate']}; prefix-cache hit rate erratum "
        f"{hits['erratum']['hit_rate']:.3f} vs in-prefix edit "
        f"{hits['in_prefix_edit']['hit_rate']:.3f}; field early: erratum "
        f"{_rate(early_hits['erratum'])} vs in-prefix edit {_rate(early_hits['in_prefix_edit'])} "
        f"({config['seconds']} s)"
    )
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


def _rate(entry: dict[str, Any]) -> str:
    return "-" if entry["hit_rate"] is None else f"{entry['hit_rate']:.3f}"
