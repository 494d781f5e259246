"""Splice vs re-prefill on the reference engine: latency, rotation throughput, peak memory.

For each context length a span is replaced by a stub (AMORTIZE splice), against
re-prefilling everything from the edit; a delete-only splice compares with engines that
delete and shift (llama.cpp). Arms run interleaved on forks of one prefilled session,
medians reported; ``floor``, ``cfloor``, ``pfloor`` and ``kvfloor`` are the bounds of
``bench_floors``. The columns and how to read them: docs/perf.md.

Run: ``.venv/bin/python -m leyline.evals.bench_splice`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from leyline.engine.engine import Engine
from leyline.engine.kv.allocator import retain_freed_memory
from leyline.engine.kv.kv_blocks import kv_nbytes
from leyline.engine.rope import rotate_many_into
from leyline.engine.session import SessionCache
from leyline.evals.bench_common import (
    DTYPES,
    RssSampler,
    bench_parser,
    document,
    finish_bench,
    interleaved_medians,
    kl,
    stub_tokens,
    timed_edit,
)
from leyline.evals.bench_floors import GEMM_SIZE, Bandwidth, key_bytes_per_token, measure_bandwidth
from leyline.protocol.algebra import Edit
from leyline.protocol.directives import Mode


@dataclass
class ContextRow:
    context: int
    edit_start: int
    span: int
    stub: int
    prefill_s: float
    splice_ms: float
    splice_logits_ms: float
    splice_logits_in_place_ms: float
    floor_ms: float
    compute_floor_ms: float
    reprefill_ms: float
    delete_ms: float
    delete_logits_ms: float
    delete_reprefill_ms: float
    kl_splice_vs_reprefill: float
    peak_compute_floor_ms: float = 0.0
    kv_floor_ms: float = 0.0
    """The floor plus the last query's read of the new KV and the downstream values moved."""

    @property
    def floor_target_attainable(self) -> bool:
        """Whether "within 1.5x of the floor" lies above what the matrix products need at
        this machine's best matrix-product rate (``pfloor``)."""
        return 1.5 * self.floor_ms >= self.peak_compute_floor_ms

    @property
    def floor_target_within_traffic(self) -> bool:
        """Whether "within 1.5x of the floor" lies above the memory traffic of an exact
        splice with logits in this cache (``kvfloor``)."""
        return 1.5 * self.floor_ms >= self.kv_floor_ms

    @property
    def ratio(self) -> float:
        return self.reprefill_ms / self.splice_ms

    @property
    def ratio_logits(self) -> float:
        return self.reprefill_ms / self.splice_logits_ms

    @property
    def delete_ratio(self) -> float:
        return self.delete_reprefill_ms / self.delete_ms

    @property
    def over_floor(self) -> float:
        return self.splice_logits_ms / self.floor_ms

    @property
    def over_compute_floor(self) -> float:
        return self.splice_logits_ms / self.compute_floor_ms


def bench_context(
    engine: Engine, n: int, args: argparse.Namespace, bandwidth: Bandwidth
) -> ContextRow:
    tokens = document(engine, n)
    start = int(n * args.edit_at)
    end = min(start + args.span, n - 1)
    stub = stub_tokens(engine, args.stub)
    base = SessionCache(engine)
    t0 = time.perf_counter()
    base.prefill(tokens)
    prefill_s = time.perf_counter() - t0
    arms: dict[str, list[float]] = {
        k: []
        for k in (
            "splice",
            "splice_logits",
            "splice_logits_in_place",
            "reprefill",
            "delete",
            "delete_logits",
            "delete_reprefill",
        )
    }
    kls: list[float] = []

    def run(edit: Edit, name: str, want_logits: bool = False) -> torch.Tensor:
        ms, logits = timed_edit(base, edit, want_logits=want_logits, in_place=True)
        arms[name].append(ms)
        return logits

    splice, forget = Edit(start, end, stub, Mode.amortize), Edit(start, end, stub, Mode.forget)
    delete, delete_forget = Edit(start, end, (), Mode.amortize), Edit(start, end, (), Mode.forget)
    steps: dict[str, Callable[[], torch.Tensor]] = {
        "splice": lambda: run(splice, "splice"),
        "splice_logits": lambda: run(splice, "splice_logits", want_logits=True),
        "splice_logits_in_place": lambda: run(splice, "splice_logits_in_place", True),
        "reprefill": lambda: run(forget, "reprefill"),
        "delete": lambda: run(delete, "delete"),
        "delete_logits": lambda: run(delete, "delete_logits", want_logits=True),
        "delete_reprefill": lambda: run(delete_forget, "delete_reprefill"),
    }
    order = list(steps)
    for round_ in range(args.runs):
        # each round starts one arm later, so no arm always follows the same one (the arm
        # before leaves the caches warm or cold for the next)
        shift = round_ % len(order)
        got = {name: steps[name]() for name in order[shift:] + order[:shift]}
        kls.append(kl(got["reprefill"], got["splice_logits"]))
    downstream = n - end
    rotated = downstream * key_bytes_per_token(engine, base.kv)
    per_token = kv_nbytes(base.kv) // n
    attended = (n - (end - start) + len(stub)) * per_token
    moved = downstream * per_token - rotated
    base.release()
    med = {k: statistics.median(v) for k, v in arms.items()}
    return ContextRow(
        n,
        start,
        end - start,
        len(stub),
        prefill_s,
        med["splice"],
        med["splice_logits"],
        med["splice_logits_in_place"],
        bandwidth.floor_ms(rotated),
        bandwidth.compute_floor_ms(rotated),
        med["reprefill"],
        med["delete"],
        med["delete_logits"],
        med["delete_reprefill"],
        statistics.median(kls),
        bandwidth.peak_compute_floor_ms(rotated),
        bandwidth.kv_floor_ms(rotated, attended, moved),
    )


def bench_rotation(engine: Engine, n: int, runs: int) -> dict[str, float]:
    """Rotating the cached keys of ``n`` tokens (all layers) vs copying the same bytes.

    Two pairs, each interleaved run by run: into preallocated buffers (the arithmetic alone)
    and into fresh tensors (what a splice pays: allocation and first-touch page faults too).
    The rotation is one ``rotate_many_into`` over every layer, as a splice calls it
    (``run_executor._place``).
    """
    assert engine.layout is not None and engine.rope is not None
    layout, rope = engine.layout, engine.rope
    session = SessionCache(engine)
    session.prefill(document(engine, n))
    src = [layer[layout.slot].contiguous() for layer in session.kv]
    session.release()
    dst = [torch.empty_like(t) for t in src]
    nbytes = sum(t.numel() * t.element_size() for t in src)

    def rotate(out: list[torch.Tensor]) -> None:
        pairs = list(zip(out, src, strict=True))
        rotate_many_into(pairs, -284, rope.inv_freq, layout.pairing, offset=layout.offset)

    arms: dict[str, Callable[[], object]] = {
        "copy": lambda: [d.copy_(s) for d, s in zip(dst, src, strict=True)],
        "rotate": lambda: rotate(dst),
        "clone": lambda: [s.clone() for s in src],
        "rotate_alloc": lambda: rotate([torch.empty_like(s) for s in src]),
    }
    med = interleaved_medians(arms, runs)
    return {
        "tokens": n,
        "bytes": nbytes,
        "copy_ms": med["copy"],
        "rotate_ms": med["rotate"],
        "copy_GBps": nbytes / med["copy"] / 1e6,
        "rotate_GBps": nbytes / med["rotate"] / 1e6,
        "ratio": med["copy"] / med["rotate"],
        "clone_ms": med["clone"],
        "rotate_alloc_ms": med["rotate_alloc"],
        "ratio_alloc": med["clone"] / med["rotate_alloc"],
    }


def memory_child(model: str, n: int, span: int, stub: int) -> None:
    """In a fresh process: resident memory over the loaded model, sampled during a prefill
    of ``n`` tokens and a splice of that session (the session's own KV included)."""
    engine = Engine.load(model)
    warm = SessionCache(engine)
    warm.prefill(document(engine, 64))
    warm.release()
    tokens = document(engine, n)
    gc.collect()
    sampler = RssSampler()
    base = sampler.rss()
    session = SessionCache(engine)
    with sampler:
        session.prefill(tokens)
    prefill_peak, held = sampler.peak, sampler.rss()
    start = n // 4
    edit = Edit(start, start + span, stub_tokens(engine, stub), Mode.amortize)
    engine.edits_in_place = engine.can_edit_in_place
    with RssSampler() as splice:
        session.apply_edits([edit], want_logits=True)  # in place: the session owns its KV
    kv_mb = kv_nbytes(session.kv) / 1e6
    del session
    gc.collect()
    copy = SessionCache(engine)
    copy.prefill(tokens)
    engine.edits_in_place = False
    with RssSampler() as copied:
        copy.apply_edits([edit], want_logits=True)
    mb = 1e6
    print(
        json.dumps(
            {
                "tokens": n,
                "kv_MB": kv_mb,
                "rss_loaded_MB": base / mb,
                "prefill_peak_MB": (prefill_peak - base) / mb,
                "session_held_MB": (held - base) / mb,
                "splice_peak_MB": (splice.peak - base) / mb,
                "splice_copy_peak_MB": (copied.peak - base) / mb,
            }
        )
    )


def bench_memory(args: argparse.Namespace, n: int) -> dict[str, float]:
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--model",
        args.model,
        "--memory-child",
        str(n),
        "--span",
        str(args.span),
        "--stub",
        str(args.stub),
        "--release-freed-memory",  # resident memory then tracks what is in use
    ]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = bench_parser(__doc__ or "")
    p.add_argument("--model", default="smollm2", help="smollm2, tiny-mla-v2/v3, .gguf or HF dir")
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--runs", type=int, default=5, help="runs per arm (medians)")
    p.add_argument(
        "--dtypes",
        nargs="+",
        choices=sorted(DTYPES),
        default=["float32"],
        help="weights and cache dtypes, each benchmarked in turn (rotation math is fp32)",
    )
    p.add_argument("--span", type=int, default=300, help="tokens replaced")
    p.add_argument("--stub", type=int, default=16, help="replacement tokens")
    p.add_argument("--edit-at", type=float, default=0.25, help="edit start, fraction of context")
    p.add_argument("--rotation-runs", type=int, default=20)
    p.add_argument("--memory-context", type=int, default=4096)
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocess")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument(
        "--release-freed-memory",
        action="store_true",
        help="leave glibc's default of returning freed buffers to the kernel "
        "(every new KV buffer then pays page faults)",
    )
    p.add_argument("--json", default=None, help="also write the figures to this file")
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: contexts 512 1024, 3 runs (not the reported figures)",
    )
    p.add_argument("--memory-child", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.contexts, args.runs, args.rotation_runs = [512, 1024], 3, 5
        args.memory_context = 1024
    return args


def bench_dtype(args: argparse.Namespace, dtype_name: str) -> dict[str, object]:
    """Every figure for one dtype of weights and cache (rotation math stays fp32)."""
    engine = Engine.load(args.model, dtype=DTYPES[dtype_name])
    bandwidth = measure_bandwidth(engine, args.rotation_runs, args.stub + 1)
    print(
        f"# {engine.loaded.label} in {dtype_name}, layout {engine.layout}: "
        f"{bandwidth.weight_bytes / 1e6:.0f} MB of weights, read "
        f"{bandwidth.read_GBps:.1f} GB/s, copy {bandwidth.copy_GBps:.1f} GB/s; linear layers "
        f"on {bandwidth.linear_rows} rows {bandwidth.linear_ms:.1f} ms (streaming the "
        f"weights: {bandwidth.weight_bytes / bandwidth.read_GBps / 1e6:.1f} ms), "
        f"{engine.packing.describe()}"
    )
    print(
        "context prefill_s | splice_ms +logits_ms in_place floor_ms x_floor cfloor_ms "
        "x_cfloor reprefill_ms "
        "ratio ratio(+logits) | delete_ms +logits_ms reprefill_ms ratio | KL"
    )
    rows = []
    for n in args.contexts:
        r = bench_context(engine, n, args, bandwidth)
        rows.append(r)
        print(
            f"{n:7d} {r.prefill_s:9.2f} | {r.splice_ms:9.1f} {r.splice_logits_ms:9.1f} "
            f"{r.splice_logits_in_place_ms:8.1f} "
            f"{r.floor_ms:8.1f} {r.over_floor:6.2f}x "
            f"{r.compute_floor_ms:9.1f} {r.over_compute_floor:7.2f}x "
            f"{r.reprefill_ms:12.1f} {r.ratio:5.1f}x {r.ratio_logits:8.1f}x | "
            f"{r.delete_ms:9.1f} {r.delete_logits_ms:9.1f} {r.delete_reprefill_ms:12.1f} "
            f"{r.delete_ratio:5.1f}x | {r.kl_splice_vs_reprefill:.4f}",
            flush=True,
        )
        print(
            f"#   {n}: target 1.5 x floor = {1.5 * r.floor_ms:.1f} ms; pfloor (the pass's "
            f"{bandwidth.linear_flops / 1e9:.2f} GFLOP at {bandwidth.gemm_GFLOPs:.0f} GFLOP/s, "
            f"the best {GEMM_SIZE}^3 product here) {r.peak_compute_floor_ms:.1f} ms: "
            + ("attainable" if r.floor_target_attainable else "below what the products need")
            + f"; kvfloor (+ the new KV read once, + the values moved) {r.kv_floor_ms:.1f} ms: "
            + ("attainable" if r.floor_target_within_traffic else "below this cache's traffic"),
            flush=True,
        )
    results: dict[str, object] = {
        "model": engine.loaded.label,
        "dtype": dtype_name,
        "bandwidth": asdict(bandwidth),
        "rows": [
            asdict(r)
            | {
                "ratio": r.ratio,
                "ratio_logits": r.ratio_logits,
                "x_floor": r.over_floor,
                "x_compute_floor": r.over_compute_floor,
                "floor_target_attainable": r.floor_target_attainable,
                "floor_target_within_traffic": r.floor_target_within_traffic,
            }
            for r in rows
        ],
    }
    if engine.layout is not None:
        rot = bench_rotation(engine, max(args.contexts), args.rotation_runs)
        results["rotation"] = rot
        print(
            f"# rotation of {rot['bytes'] / 1e6:.0f} MB of keys ({rot['tokens']} tokens): "
            f"{rot['rotate_ms']:.1f} ms vs copy {rot['copy_ms']:.1f} ms into a buffer = "
            f"{rot['ratio']:.0%} of copy throughput ({rot['rotate_GBps']:.1f} vs "
            f"{rot['copy_GBps']:.1f} GB/s); with allocation {rot['rotate_alloc_ms']:.1f} vs "
            f"clone {rot['clone_ms']:.1f} ms = {rot['ratio_alloc']:.0%}"
        )
    return results


def main(argv: list[str] | None = None) -> dict[str, object]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    retained = not args.release_freed_memory and retain_freed_memory()
    if args.memory_child is not None:
        memory_child(args.model, args.memory_child, args.span, args.stub)
        return {}
    print(
        f"# {args.model}, torch {torch.__version__}, {torch.get_num_threads()} threads, load "
        f"avg {os.getloadavg()[0]:.2f}, freed memory retained: {retained}"
    )
    print(
        f"# edit at {args.edit_at:.0%}: span {args.span} -> stub {args.stub} tokens; medians of "
        f"{args.runs} runs, arms interleaved{' (QUICK: smoke figures only)' if args.quick else ''}"
    )
    by_dtype = {name: bench_dtype(args, name) for name in args.dtypes}
    first = by_dtype[args.dtypes[0]]
    results: dict[str, object] = {**first, "dtypes": by_dtype}
    if not args.no_memory:
        mem = bench_memory(args, args.memory_context)
        results["memory"] = mem
        print(
            f"# {mem['tokens']}-token session, resident memory above the loaded model "
            f"({mem['rss_loaded_MB']:.0f} MB): peak +{mem['prefill_peak_MB']:.0f} MB during "
            f"prefill, +{mem['session_held_MB']:.0f} MB held after it (KV "
            f"{mem['kv_MB']:.0f} MB), peak +{mem['splice_peak_MB']:.0f} MB during a splice with "
            f"logits in place (+{mem['splice_copy_peak_MB']:.0f} MB by copy)"
        )
    finish_bench(results, args.json)
    return results


if __name__ == "__main__":
    main()
