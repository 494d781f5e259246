"""One query's attention over a long cache: torch's SDPA vs ``decode_attention``'s paths.

The attention a decode step (and a splice's last token) runs in every layer: one query per
head against every cached key and value, grouped-query heads read in place. Arms,
interleaved repetition by repetition so that machine noise hits them alike; figures are
medians:

* ``sdpa``: ``F.scaled_dot_product_attention(..., enable_gqa=True)``, no mask;
* ``matmul``: ``decode_attention.matmul_attention`` (two batched matrix products over the
  grouped heads), what the engine runs for fp32 without the compiled kernel;
* ``kernel``: ``attention_kernel`` (compiled; fp32 and bf16), what it runs where it loads:
  in bf16 on the tile unit where the kernel has it (``AttentionKernel.amx``).

Shapes are SmolLM2-135M's (9 query heads, 3 key/value heads, head dim 64), keys and values
views of a larger buffer as the engine's are. ``GB/s`` is the K+V bytes read per second.

``--in-model N`` also runs the same A/B inside the engine (SmolLM2 in each ``--dtypes``, an
``N``-token session; ``decode_attention``'s paths switched off and on run by run): a splice
with logits (bench_splice's edit), a delete with logits, and one decode step (8 one-token
extensions), medians.

Run: ``.venv/bin/python -m leyline.evals.bench_decode_attention`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from leyline.engine.cpu import attention_kernel
from leyline.engine.decode_attention import matmul_attention
from leyline.evals.bench_attention_ab import (
    DIM,
    KV_HEADS,
    add_attention_ab_options,
    attention_inputs,
    start_attention_ab,
)
from leyline.evals.bench_common import DTYPES, bench_parser, interleaved_medians


def bench(n: int, dtype: torch.dtype, runs: int) -> dict[str, float]:
    query, keys, values = attention_inputs(n, 1, dtype)
    arms: dict[str, Callable[[], object]] = {
        "sdpa": lambda: F.scaled_dot_product_attention(query, keys, values, enable_gqa=True),
        "matmul": lambda: matmul_attention(query, keys, values, None),
    }
    kernel = attention_kernel.load()
    if kernel is not None:
        arms["kernel"] = lambda: kernel.attend(query, keys, values, None)
    return interleaved_medians(arms, runs)


def bench_in_model(n: int, runs: int, dtype: torch.dtype) -> dict[str, float]:
    """Engine arms with the path on (``new``) and off (``old``), interleaved; ms medians."""
    from leyline.engine import attention
    from leyline.engine.decode_attention import takes_single_query
    from leyline.engine.engine import Engine
    from leyline.engine.session import SessionCache
    from leyline.evals.bench_common import document, stub_tokens, timed_edit
    from leyline.protocol.algebra import Edit
    from leyline.protocol.directives import Mode

    engine = Engine.load("smollm2", dtype=dtype)
    base = SessionCache(engine)
    base.prefill(document(engine, n))
    start, stub = n // 4, stub_tokens(engine, 16)
    edits = {"splice_logits": Edit(start, start + 300, stub, Mode.amortize)}
    edits["delete_logits"] = Edit(start, start + 300, (), Mode.amortize)

    def decode_step() -> float:
        fork = base.fork()
        try:
            t0 = time.perf_counter()
            for _ in range(8):
                fork.prefill([*fork.tokens, 28])
            return (time.perf_counter() - t0) * 1e3 / 8
        finally:
            fork.release()

    def arms(on: bool) -> dict[str, float]:
        attention.takes_single_query = takes_single_query if on else (lambda q, k, v: False)
        try:
            out = {k: timed_edit(base, e, want_logits=True)[0] for k, e in edits.items()}
            return out | {"decode_step": decode_step()}
        finally:
            attention.takes_single_query = takes_single_query

    times: dict[str, list[float]] = {}
    for i in range(runs + 1):
        for on in (False, True):
            for name, ms in arms(on).items():
                if i:  # the first round warms up
                    times.setdefault(f"{name}_{'new' if on else 'old'}", []).append(ms)
    base.release()
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__ or "")
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 8192, 16384])
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["float32"])
    add_attention_ab_options(parser, runs=200, quick="512 tokens, 20 calls")
    args = parser.parse_args(argv)
    if args.quick:
        args.contexts, args.runs = [512], 20
    start_attention_ab(args)
    print(
        "dtype     context | sdpa_ms matmul_ms kernel_ms | matmul/sdpa kernel/sdpa"
        " | GB/s: sdpa matmul kernel"
    )
    nan = float("nan")
    for name in args.dtypes:
        dtype = DTYPES[name]
        for n in args.contexts:
            ms = bench(n, dtype, args.runs)
            nbytes = 2 * KV_HEADS * n * DIM * dtype.itemsize
            rate = {arm: nbytes / t / 1e6 for arm, t in ms.items()}
            k_ms = ms.get("kernel", nan)
            print(
                f"{name:9} {n:7} | {ms['sdpa']:7.3f} {ms['matmul']:9.3f} {k_ms:9.3f} "
                f"| {ms['matmul'] / ms['sdpa']:11.2f} {k_ms / ms['sdpa']:11.2f} | "
                f"{rate['sdpa']:10.1f} {rate['matmul']:6.1f} {rate.get('kernel', nan):6.1f}"
            )
    if args.in_model is not None:
        for name in args.dtypes:
            med = bench_in_model(args.in_model, args.model_runs, DTYPES[name])
            print(
                f"# in the engine, SmolLM2 {name}, {args.in_model} tokens, medians of "
                f"{args.model_runs}; new: decode_attention's paths on"
            )
            for arm in ("splice_logits", "delete_logits", "decode_step"):
                old, new = med[f"{arm}_old"], med[f"{arm}_new"]
                print(f"{arm:14} sdpa {old:7.1f} ms  new {new:7.1f} ms  ratio {new / old:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
