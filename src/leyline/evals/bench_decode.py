"""Batched decode vs one row at a time: what B concurrent generations cost per token.

B sessions of ``--context`` tokens each (different lengths around it) take decode steps two
ways, interleaved so the machine's noise hits both alike: one ``Engine.forward_rows`` step
for all B rows (the server's scheduler), and B plain decode steps (``forward_into``, one row
each: the server before it had a scheduler). Figures are medians; the ratio is the speed-up
per token at that batch size. Each step writes one new entry per row in place; the buffers
are sized so every run has room.

Run: ``.venv/bin/python -m leyline.evals.bench_decode`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from leyline.engine.batched_decode import Row
from leyline.engine.engine import Engine
from leyline.engine.forward import buffers_holding


def session_rows(engine: Engine, batch: int, context: int, room: int, seed: int) -> list[Row]:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for b in range(batch):
        n = max(1, context - 7 * b)  # lengths differ, as concurrent sessions' do
        tokens = torch.randint(3, engine.vocab_size, (n,), generator=g).tolist()
        kv, _ = engine.forward((), tokens)
        rows.append(Row(buffers_holding(kv, n + room), n, tokens[-1]))
    return rows


def bench(engine: Engine, batch: int, context: int, runs: int) -> dict[str, float]:
    rows = session_rows(engine, batch, context, room=2 * runs + 2, seed=batch)
    times: dict[str, list[float]] = {"batched": [], "one_by_one": []}
    step = 0

    def at(offset: int) -> list[Row]:  # each step writes one position further on
        return [Row(r.buffers, r.length + offset, r.token) for r in rows]

    engine.forward_rows(at(step))  # warm-up
    step += 1
    for _ in range(runs):
        t0 = time.perf_counter()
        engine.forward_rows(at(step))
        times["batched"].append(time.perf_counter() - t0)
        step += 1
        t0 = time.perf_counter()
        for r in at(step):
            engine.forward_into(r.buffers, r.length, [r.token])
        times["one_by_one"].append(time.perf_counter() - t0)
        step += 1
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    return {
        "batch": batch,
        "context": context,
        "batched_ms": med["batched"],
        "one_by_one_ms": med["one_by_one"],
        "ratio": med["one_by_one"] / med["batched"],
        "batched_ms_per_token": med["batched"] / batch,
    }


def main(argv: list[str] | None = None) -> list[dict[str, float]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2", help="smollm2, tiny-mla-v2/v3, .gguf or HF dir")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--context", type=int, default=1024, help="tokens per session (about)")
    p.add_argument("--runs", type=int, default=7, help="interleaved runs per arm (medians)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--quick", action="store_true", help="smoke run: batches 1 2, 64 tokens")
    args = p.parse_args(argv)
    if args.quick:
        args.batches, args.context, args.runs = [1, 2], 64, 2
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    engine = Engine.load(args.model, dtype=dtype)
    print(
        f"# {engine.loaded.label}, {torch.get_num_threads()} threads, ~{args.context} tokens "
        f"per session, medians of {args.runs} interleaved runs; batched decode "
        f"{'on' if engine.batches_decode else 'OFF (row by row)'}"
    )
    print("batch | batched_ms one_by_one_ms ratio | batched ms/token")
    rows = []
    for batch in args.batches:
        r = bench(engine, batch, args.context, args.runs)
        rows.append(r)
        print(
            f"{batch:5d} | {r['batched_ms']:10.1f} {r['one_by_one_ms']:14.1f} {r['ratio']:5.2f}x"
            f" | {r['batched_ms_per_token']:8.1f}",
            flush=True,
        )
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
