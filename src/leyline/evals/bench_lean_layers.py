"""The lean decoder-layer forward (``lean_layers``) with its fused few-row layers
(``layer_kernel``), and the loop over them (``fused_forward``), against transformers' own
forward, per operation.

One engine per dtype; for each context a prefilled session, then three operations on a
private copy of it (a decode step, a delete with next-token logits of a 300-token span at a
quarter of the context, and a splice with logits replacing it by 16 tokens), each run with
transformers' layer forward (``plain``), the lean one with the fused layers inside the
model's forward (``fused``: the loop switched off) and with the model's forward replaced by
the loop (``loop``, the engine's default), interleaved. Figures are medians; ``x`` is
plain / fused and fused / loop.

Run: ``.venv/bin/python -m leyline.evals.bench_lean_layers`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable

import torch

from leyline.engine.cpu import layer_kernel, switches
from leyline.engine.engine import Engine
from leyline.engine.forward import buffers_holding
from leyline.engine.kv.allocator import retain_freed_memory
from leyline.engine.lean_layers import drop_lean_layers, fused_layers, use_lean_layers
from leyline.engine.session import SessionCache
from leyline.evals.bench_common import DTYPES, document, stub_tokens
from leyline.protocol.algebra import Edit
from leyline.protocol.directives import Mode

SPAN = 300
STUB = 16


Op = Callable[[], Callable[[], object]]
"""Sets up one run off the clock and returns the call to time."""


def operations(engine: Engine, base: SessionCache) -> dict[str, Op]:
    n = len(base.tokens)
    start = n // 4
    end = min(start + SPAN, n - 1)
    stub = stub_tokens(engine, STUB)

    def decode() -> Callable[[], object]:
        buffers = buffers_holding(base.kv, n + 1)
        return lambda: engine.forward_into(buffers, n, [int(base.tokens[-1])])

    def edit(replacement: tuple[int, ...]) -> Op:
        def setup() -> Callable[[], object]:
            fork = base.fork(copy_kv=True)  # its own buffers: the edit runs in place
            edits = [Edit(start, end, replacement, Mode.amortize)]
            return lambda: fork.apply_edits(edits, want_logits=True)

        return setup

    return {"decode": decode, "delete+logits": edit(()), "splice+logits": edit(stub)}


def timed(op: Op) -> float:
    run = op()
    t0 = time.perf_counter()
    run()
    ms = (time.perf_counter() - t0) * 1e3
    del run
    gc.collect()
    return ms


ARMS = ("plain", "fused", "loop")


def bench(engine: Engine, n: int, runs: int) -> dict[str, tuple[float, ...]]:
    """Per operation: the medians in ms of :data:`ARMS`, in that order."""
    base = SessionCache(engine)
    base.prefill(document(engine, n))
    ops = operations(engine, base)
    times: dict[tuple[str, str], list[float]] = {}

    arms: dict[str, tuple[Callable[[], object], switches.Setting]] = {
        "plain": (lambda: drop_lean_layers(engine.model), "auto"),
        "fused": (lambda: use_lean_layers(engine.model), "off"),
        "loop": (lambda: use_lean_layers(engine.model), "auto"),
    }
    for round_ in range(runs + 1):  # the first round warms up
        for name, op in ops.items():
            for arm, (switch, loop) in arms.items():
                switch()
                with switches.override(fused_forward=loop):
                    ms = timed(op)
                if round_:
                    times.setdefault((name, arm), []).append(ms)
    use_lean_layers(engine.model)
    base.release()
    return {name: tuple(statistics.median(times[name, arm]) for arm in ARMS) for name in ops}


def main(argv: list[str] | None = None) -> dict[str, dict[int, dict[str, tuple[float, ...]]]]:
    """Prints the table; returns per dtype, per context, per operation the :data:`ARMS`' ms."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=DTYPES)
    parser.add_argument("--contexts", nargs="+", type=int, default=[512, 4096])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--quick", action="store_true", help="smoke run: 512 tokens, 2 runs")
    args = parser.parse_args(argv)
    if args.quick:
        args.contexts, args.runs = [512], 2
    if args.threads:
        torch.set_num_threads(args.threads)
    retain_freed_memory()
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads, {args.model}")
    results: dict[str, dict[int, dict[str, tuple[float, ...]]]] = {}
    for dtype in args.dtypes:
        engine = Engine.load(args.model, dtype=DTYPES[dtype])
        if not engine.lean_layers:
            print(f"# {dtype}: the model's layers cannot go lean")
            continue
        fused = fused_layers(engine.model)
        print(
            f"# {dtype}: {engine.lean_layers} lean layers, {fused} fused "
            f"({layer_kernel.status().detail}); {engine.packing.describe()}"
        )
        print("context | operation      | plain_ms fused_ms  loop_ms | plain/fused fused/loop")
        for n in args.contexts:
            figures = results.setdefault(dtype, {})[n] = bench(engine, n, args.runs)
            for name, (plain, fast, loop) in figures.items():
                print(
                    f"{n:7d} | {name:14s} | {plain:8.1f} {fast:8.1f} {loop:8.1f} | "
                    f"{plain / fast:10.2f}x {fast / loop:9.2f}x"
                )
    return results


if __name__ == "__main__":
    main()
