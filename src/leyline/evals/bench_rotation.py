"""Key rotation vs a plain copy of the same bytes: the fused kernel, the eager path, the floor.

A splice rotates every downstream key by one delta (``rope.rotate_into``), reading and
writing each key once, so its floor is a copy: ``dst.copy_(src)`` of the same tensors into
preallocated buffers. Arms, interleaved repetition by repetition (the starting arm rotated)
so that machine noise hits them alike; figures are medians:

* ``copy``: ``dst.copy_(src)`` per layer;
* ``eager``: ``rope.rotate_into_eager`` per layer (the rotation before the fused kernel);
* ``fused``: ``rope.rotate_into`` per layer (the fused kernel, one call per layer, as
  SGLang's row copies call it);
* ``fused_1call``: ``rope.rotate_many_into`` over all layers, what a splice or compose calls
  (``run_executor._place``): one kernel call, one fork-join of the threads.

Layouts at each context length, keys random (throughput does not depend on the values),
frequencies SmolLM2's own (rope_theta 100000, 32 pairs):

* ``gqa-half``: SmolLM2-135M's cache, 30 layers x ``[1, 3, T, 64]``, half-split pairs;
* ``gqa-interleaved``: the same shapes with interleaved pairs (llama.cpp's layout);
* ``mla-band``: an MLA rope band, 27 layers x ``[1, 1, T, 64]``, interleaved (DeepSeek-V2-Lite).

Run: ``.venv/bin/python -m leyline.evals.bench_rotation`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from leyline.engine.cpu import rope_kernel
from leyline.engine.rope import Pairing, rotate_into, rotate_into_eager, rotate_many_into
from leyline.evals.bench_common import bench_parser, finish_bench

DELTA = -284  # the 300-token span -> 16-token stub of bench_splice
SMOLLM2_THETA = 100000.0


@dataclass(frozen=True)
class Layout:
    name: str
    layers: int
    heads: int
    dim: int
    pairing: Pairing


LAYOUTS = {
    "gqa-half": Layout("gqa-half", 30, 3, 64, "half"),
    "gqa-interleaved": Layout("gqa-interleaved", 30, 3, 64, "interleaved"),
    "mla-band": Layout("mla-band", 27, 1, 64, "interleaved"),
}


@dataclass
class Row:
    context: int
    layout: str
    dtype: str
    bytes: int
    copy_ms: float
    eager_ms: float
    fused_ms: float
    fused_1call_ms: float

    def gbps(self, ms: float) -> float:
        return self.bytes / ms / 1e6

    @property
    def eager_ratio(self) -> float:
        return self.copy_ms / self.eager_ms

    @property
    def fused_ratio(self) -> float:
        return self.copy_ms / self.fused_ms


CLOCK: Callable[[], float] = time.perf_counter


def timed(fn: Callable[[], object]) -> float:
    t0 = CLOCK()
    fn()
    return (CLOCK() - t0) * 1e3


def bench(layout: Layout, n: int, dtype: torch.dtype, runs: int) -> Row:
    g = torch.Generator().manual_seed(n)
    shape = (1, layout.heads, n, layout.dim)
    src = [torch.randn(shape, generator=g).mul_(4).to(dtype) for _ in range(layout.layers)]
    dst = [torch.empty_like(t) for t in src]
    half = layout.dim // 2
    inv_freq = (SMOLLM2_THETA ** (-torch.arange(half, dtype=torch.float64) / half)).float()
    nbytes = sum(t.numel() * t.element_size() for t in src)
    pairs = list(zip(dst, src, strict=True))

    def rotate(fn: Callable[..., torch.Tensor]) -> None:
        for d, s in pairs:
            fn(d, s, DELTA, inv_freq, layout.pairing)

    arms: dict[str, Callable[[], object]] = {
        "copy": lambda: [d.copy_(s) for d, s in pairs],
        "eager": lambda: rotate(rotate_into_eager),
        "fused": lambda: rotate(rotate_into),
    }
    arms["fused_1call"] = lambda: rotate_many_into(pairs, DELTA, inv_freq, layout.pairing)
    times: dict[str, list[float]] = {k: [] for k in arms}
    names = list(arms)
    for fn in arms.values():
        fn()  # warm: pages touched, kernel built and calibrated
    for i in range(runs):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            times[name].append(timed(arms[name]))
    med = {k: statistics.median(v) for k, v in times.items()}
    return Row(
        n,
        layout.name,
        str(dtype).removeprefix("torch."),
        nbytes,
        med["copy"],
        med["eager"],
        med["fused"],
        med["fused_1call"],
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = bench_parser(__doc__ or "")
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--layouts", nargs="+", choices=sorted(LAYOUTS), default=list(LAYOUTS))
    p.add_argument("--dtypes", nargs="+", choices=["fp32", "bf16"], default=["fp32", "bf16"])
    p.add_argument("--runs", type=int, default=21, help="repetitions per arm (medians)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument(
        "--clock",
        choices=["wall", "thread"],
        default="wall",
        help="thread: this thread's CPU time, robust to a busy machine but only meaningful "
        "with --threads 1 (other threads' work is not counted)",
    )
    p.add_argument("--json", default=None, help="also write the figures to this file")
    p.add_argument("--quick", action="store_true", help="smoke run: 256 tokens, 3 runs")
    args = p.parse_args(argv)
    if args.quick:
        args.contexts, args.runs = [256], 3
    return args


def main(argv: list[str] | None = None) -> dict[str, object]:
    args = parse_args(argv)
    global CLOCK
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "thread":
        if torch.get_num_threads() != 1:
            raise SystemExit("--clock thread needs --threads 1")
        CLOCK = time.thread_time
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    status = rope_kernel.status()
    print(
        f"# torch {torch.__version__}, {torch.get_num_threads()} threads, CPU capability "
        f"{torch.backends.cpu.get_cpu_capability()}, load avg {os.getloadavg()[0]:.2f}; "
        f"kernel: {status.detail if status.available else 'UNAVAILABLE: ' + status.detail}"
    )
    print(
        f"# delta {DELTA}; {args.clock} clock; medians of {args.runs} interleaved runs; "
        "GB/s = bytes rotated (or copied) / time; floor = a plain copy of the same bytes "
        "into preallocated buffers (read once, write once); "
        "ratio = throughput / copy throughput = floor / time"
        + (" (QUICK: smoke figures only)" if args.quick else "")
    )
    print(
        f"{'context':>7} {'layout':15} {'dtype':8} {'MB':>6} | {'floor=copy':>16} | "
        f"{'eager (before)':>22} | {'fused, per layer':>22} | {'fused, one call':>22}"
    )
    print(
        f"{'':7} {'':15} {'':8} {'':6} | {'ms':>6} {'GB/s':>9} | {'ms':>6} {'GB/s':>6} "
        f"{'ratio':>8} | {'ms':>6} {'GB/s':>6} {'ratio':>8} | {'ms':>6} {'GB/s':>6} {'ratio':>8}"
    )
    rows = []
    for n in args.contexts:
        for name in args.layouts:
            for dt in args.dtypes:
                r = bench(LAYOUTS[name], n, dtypes[dt], args.runs)
                rows.append(r)
                arms = [r.eager_ms, r.fused_ms, r.fused_1call_ms]
                cells = " | ".join(
                    f"{ms:6.1f} {r.gbps(ms):6.2f} {r.copy_ms / ms:7.0%}" for ms in arms
                )
                print(
                    f"{n:7d} {name:15} {r.dtype:8} {r.bytes / 1e6:6.1f} | {r.copy_ms:6.1f} "
                    f"{r.gbps(r.copy_ms):9.2f} | {cells}",
                    flush=True,
                )
    results: dict[str, object] = {
        "kernel": asdict(status),
        "clock": args.clock,
        "threads": torch.get_num_threads(),
        "rows": [
            asdict(r) | {"eager_ratio": r.eager_ratio, "fused_ratio": r.fused_ratio} for r in rows
        ],
    }
    finish_bench(results, args.json)
    return results


if __name__ == "__main__":
    main()
