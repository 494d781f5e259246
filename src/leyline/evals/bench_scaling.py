"""Splice (with next-token logits) and re-prefill from the edit vs context and edit position.

Two sweeps on the reference engine, with the edit of ``bench_splice.py``: a ``--span``-token
span replaced by a ``--stub``-token stub. **vs context**: the edit at ``--edit-at`` of each
of ``--contexts``; **vs edit position**: the edit at each of ``--fractions`` of one
``--position-context``. At every point two arms run interleaved, each on a fork of the same
prefilled session: the splice that also returns the next-token logits (AMORTIZE,
``want_logits=True``, one masked pass) and the re-prefill of everything from the edit
(FORGET, logits included). Figures are medians; ``floor`` is bench_splice's (weight bytes
over the measured read bandwidth plus the rotated keys' bytes over the copy bandwidth).

Contexts above the model's trained positions (``max_position_embeddings``, the engine's
session limit) are skipped unless ``--past-max-positions``: then the limit is lifted and
those points are timing only (the model was never trained there; KL is reported but means
little).

Writes ``report.json``, ``report.md`` and ``scaling.png`` (two panels, log-scale latency) to
``--out`` (default ``results/bench-scaling-<UTC time>/``); progress on stderr.

Run: ``.venv/bin/python -m leyline.evals.bench_scaling`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from leyline.engine.engine import Engine
from leyline.engine.kv.allocator import retain_freed_memory
from leyline.engine.session import SessionCache
from leyline.evals.bench_common import (
    DTYPES,
    bench_parser,
    document,
    kl,
    stub_tokens,
    timed_edit,
)
from leyline.evals.bench_floors import Bandwidth, key_bytes_per_token, measure_bandwidth
from leyline.evals.common import Report, markdown_table, progress, results_dir
from leyline.protocol.algebra import Edit
from leyline.protocol.capabilities import Limits
from leyline.protocol.directives import Mode


@dataclass
class Point:
    """One edit, both arms measured ``runs`` times interleaved."""

    context: int
    edit_at: float
    edit_start: int
    span: int
    stub: int
    runs: int
    past_max_positions: bool
    floor_ms: float
    splice_logits_ms: float = 0.0
    reprefill_ms: float = 0.0
    kl_splice_vs_reprefill: float = 0.0
    splice_logits_runs_ms: list[float] = field(default_factory=list)
    reprefill_runs_ms: list[float] = field(default_factory=list)

    @property
    def downstream(self) -> int:
        return self.context - self.edit_start - self.span

    @property
    def ratio(self) -> float:
        return self.reprefill_ms / self.splice_logits_ms

    @property
    def x_floor(self) -> float:
        return self.splice_logits_ms / self.floor_ms

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {
            "downstream": self.downstream,
            "ratio": self.ratio,
            "x_floor": self.x_floor,
        }


def plan(args: argparse.Namespace, cap: int | None) -> tuple[list[tuple[int, float]], list[str]]:
    """The (context, edit fraction) pairs to measure, context by context (each context is
    prefilled once), and a note per context skipped for the model's position limit."""
    wanted = [(n, args.edit_at) for n in args.contexts]
    wanted += [(args.position_context, f) for f in args.fractions]
    notes: list[str] = []
    pairs: list[tuple[int, float]] = []
    for n in sorted({n for n, _ in wanted}):
        if cap is not None and n > cap:
            notes.append(
                f"context {n} skipped: above the model's {cap} positions "
                "(--past-max-positions times it anyway)"
            )
            continue
        pairs += sorted({(m, f) for m, f in wanted if m == n}, key=lambda p: p[1])
    return pairs, notes


def run_sweeps(
    engine: Engine, args: argparse.Namespace, bandwidth: Bandwidth, trained: int | None
) -> tuple[list[Point], list[str]]:
    pairs, notes = plan(args, None if args.past_max_positions else trained)
    stub = stub_tokens(engine, args.stub)
    points: dict[tuple[int, float], Point] = {}
    for n, fraction in pairs:
        start = int(n * fraction)
        end = min(start + args.span, n - 1)
        past = trained is not None and n > trained
        runs = args.long_runs if n >= args.long_from else args.runs
        points[(n, fraction)] = Point(n, fraction, start, end - start, len(stub), runs, past, 0.0)
    tasks = [(key, i) for key in points for i in range(points[key].runs)]
    base: SessionCache | None = None
    per_token = 0
    kls: dict[tuple[int, float], list[float]] = {key: [] for key in points}
    for key, i in progress(tasks, desc="splice/re-prefill runs", total=len(tasks)):
        point = points[key]
        if base is None or len(base.tokens) != point.context:
            if base is not None:
                base.release()
            base = SessionCache(engine)
            base.prefill(document(engine, point.context))
            per_token = key_bytes_per_token(engine, base.kv)
        if not point.floor_ms:
            rotated = point.downstream * per_token
            point.floor_ms = bandwidth.floor_ms(rotated)
        end = point.edit_start + point.span
        splice = Edit(point.edit_start, end, stub, Mode.amortize)
        forget = Edit(point.edit_start, end, stub, Mode.forget)
        # alternate which arm goes first, so slow drift in the machine hits both alike
        order = [("splice", splice, True), ("reprefill", forget, False)]
        logits: dict[str, torch.Tensor] = {}
        times = {"splice": point.splice_logits_runs_ms, "reprefill": point.reprefill_runs_ms}
        for name, edit, want in order if i % 2 == 0 else order[::-1]:
            ms, logits[name] = timed_edit(base, edit, want_logits=want)
            times[name].append(ms)
        kls[key].append(kl(logits["reprefill"], logits["splice"]))
        if i == point.runs - 1:
            point.splice_logits_ms = statistics.median(point.splice_logits_runs_ms)
            point.reprefill_ms = statistics.median(point.reprefill_runs_ms)
            point.kl_splice_vs_reprefill = statistics.median(kls[key])
            print(line(point), flush=True)
    if base is not None:
        base.release()
    return list(points.values()), notes


HEADER = (
    "context",
    "edit at",
    "edit start",
    "downstream",
    "runs",
    "splice+logits ms",
    "re-prefill ms",
    "ratio",
    "floor ms",
    "x floor",
    "KL",
)


def ms(value: float) -> str:
    return f"{value:,.0f}" if value >= 1000 else f"{value:.1f}"


def row(p: Point) -> list[Any]:
    context = f"{p.context}{' (past trained positions)' if p.past_max_positions else ''}"
    return [
        context,
        f"{p.edit_at:.0%}",
        p.edit_start,
        p.downstream,
        p.runs,
        ms(p.splice_logits_ms),
        ms(p.reprefill_ms),
        f"{p.ratio:.1f}x",
        ms(p.floor_ms),
        f"{p.x_floor:.2f}x",
        f"{p.kl_splice_vs_reprefill:.2e}",
    ]


def line(p: Point) -> str:
    return "  ".join(f"{h}={v}" for h, v in zip(HEADER, row(p), strict=True))


def plot(
    by_context: list[Point], by_position: list[Point], title: str, trained: int | None
) -> Callable[[Path], None]:
    def draw(path: Path) -> None:
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
        panels = [
            (axes[0], by_context, lambda p: p.context, "context (tokens)", "vs context length"),
            (
                axes[1],
                by_position,
                lambda p: p.edit_at,
                f"edit position (fraction of {by_position[0].context if by_position else '-'})",
                "vs edit position",
            ),
        ]
        for ax, points, x_of, xlabel, name in panels:
            xs = [x_of(p) for p in points]
            ax.plot(xs, [p.reprefill_ms for p in points], "o-", label="re-prefill from the edit")
            ax.plot(xs, [p.splice_logits_ms for p in points], "s-", label="splice + logits")
            ax.plot(xs, [p.floor_ms for p in points], "k--", label="floor (bandwidth)")
            for p, x in zip(points, xs, strict=True):
                ax.annotate(
                    f"{p.ratio:.0f}x",
                    (x, p.reprefill_ms),
                    textcoords="offset points",
                    xytext=(0, 6),
                    ha="center",
                    fontsize=8,
                )
            ax.set_yscale("log")
            if points and ax is axes[0]:
                ax.set_xscale("log", base=2)
                ax.set_xticks(xs, [str(x) for x in xs])
                if trained is not None and any(p.past_max_positions for p in points):
                    ax.axvspan(trained, max(xs) * 1.1, color="grey", alpha=0.15)
                    ax.axvline(trained, color="grey", lw=1)
                    ax.text(trained, ax.get_ylim()[0], " past trained\n positions", fontsize=7)
            ax.set_xlabel(xlabel)
            ax.set_ylabel("latency (ms, median)")
            ax.set_title(name)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8, title="Nx: re-prefill / splice", title_fontsize=7)
        fig.suptitle(title, fontsize=10)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)

    return draw


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = bench_parser(__doc__ or "")
    p.add_argument("--model", default="smollm2", help="smollm2, tiny-mla-v2/v3, .gguf or HF dir")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    p.add_argument("--edit-at", type=float, default=0.25, help="edit start in the context sweep")
    p.add_argument("--position-context", type=int, default=4096, help="context of the 2nd sweep")
    p.add_argument("--fractions", type=float, nargs="+", default=[0.1, 0.25, 0.5, 0.75, 0.9])
    p.add_argument("--runs", type=int, default=5, help="runs per arm and point (medians)")
    p.add_argument("--long-runs", type=int, default=2, help="runs at contexts >= --long-from")
    p.add_argument("--long-from", type=int, default=12288)
    p.add_argument("--span", type=int, default=300, help="tokens replaced")
    p.add_argument("--stub", type=int, default=16, help="replacement tokens")
    p.add_argument(
        "--past-max-positions",
        action="store_true",
        help="lift the model's position limit: contexts past it are timed (timing only)",
    )
    p.add_argument("--bandwidth-runs", type=int, default=20)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--out", type=Path, default=None, help="results folder")
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: contexts 256 512 1024, fractions 0.25 0.75 of 512, 2 runs",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.contexts, args.position_context, args.fractions = [256, 512, 1024], 512, [0.25, 0.75]
        args.runs = args.long_runs = 2
        args.bandwidth_runs = 5
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    retained = retain_freed_memory()
    t0 = time.perf_counter()
    load_avg = os.getloadavg()[0]
    kwargs: dict[str, Any] = {"dtype": DTYPES[args.dtype]}
    if args.past_max_positions:
        kwargs["limits"] = Limits(max_session_tokens=None)
    engine = Engine.load(args.model, **kwargs)
    trained = int(getattr(engine.model.config, "max_position_embeddings", 0)) or None
    bandwidth = measure_bandwidth(engine, args.bandwidth_runs, args.stub + 1)
    warm = SessionCache(engine)
    warm.prefill(document(engine, 64))
    warm.release()
    label = engine.loaded.label
    head = (
        f"# {label} in {args.dtype}, torch {torch.__version__}, {torch.get_num_threads()} "
        f"threads, load avg {load_avg:.2f}; {bandwidth.weight_bytes / 1e6:.0f} MB of weights, "
        f"read {bandwidth.read_GBps:.1f} GB/s, copy {bandwidth.copy_GBps:.1f} GB/s; span "
        f"{args.span} -> stub {args.stub}{' (QUICK: smoke figures only)' if args.quick else ''}"
    )
    print(head, flush=True)
    points, notes = run_sweeps(engine, args, bandwidth, trained)
    for note in notes:
        print(f"# {note}", flush=True)
    by_context = [
        p for n in args.contexts for p in points if (p.context, p.edit_at) == (n, args.edit_at)
    ]
    by_position = [
        p
        for f in args.fractions
        for p in points
        if (p.context, p.edit_at) == (args.position_context, f)
    ]
    elapsed = time.perf_counter() - t0
    load_end = os.getloadavg()[0]
    print(f"# {elapsed:.0f} s, load avg at end {load_end:.2f}", flush=True)
    config = {
        "model": label,
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "contexts": args.contexts,
        "edit_at": args.edit_at,
        "position_context": args.position_context,
        "fractions": args.fractions,
        "runs": args.runs,
        "long_runs": args.long_runs,
        "long_from": args.long_from,
        "span": args.span,
        "stub": args.stub,
        "past_max_positions": args.past_max_positions,
        "trained_positions": trained,
        "quick": args.quick,
        "command": " ".join([os.path.basename(sys.argv[0]), *(argv or sys.argv[1:])]),
    }
    data = {
        "bandwidth": asdict(bandwidth),
        "freed_memory_retained": retained,
        "load_avg": {"start": load_avg, "end": load_end},
        "elapsed_s": elapsed,
        "notes": notes,
        "by_context": [p.as_dict() for p in by_context],
        "by_position": [p.as_dict() for p in by_position],
    }
    report = Report(
        "bench-scaling",
        "Splice + logits vs re-prefill: scaling",
        config,
        results_dir("bench-scaling", args.out),
        data,
    )
    report.section(
        f"vs context (edit at {args.edit_at:.0%})",
        markdown_table(HEADER, [row(p) for p in by_context]) + "".join(f"\n\n{n}" for n in notes),
    )
    report.section(
        f"vs edit position (context {args.position_context})",
        markdown_table(HEADER, [row(p) for p in by_position]),
    )
    report.plots["scaling.png"] = plot(
        by_context,
        by_position,
        f"{label}, {args.dtype}, threads={torch.get_num_threads()}: span {args.span} -> "
        f"stub {args.stub}, medians of interleaved runs",
        trained,
    )
    written = report.write()
    for path in written:
        print(f"# wrote {path}", flush=True)
    return {**data, "config": config, "written": [str(p) for p in written]}


if __name__ == "__main__":
    main()
