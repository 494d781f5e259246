"""A run of queries over a cache: torch's masked SDPA vs the compiled kernel's query runs.

A splice's replacement (16 tokens in bench_splice's edit) attends, in every layer, with
``m`` queries at consecutive positions over the prefix and causally over itself. The engine
used to give that to torch's CPU flash kernel with an explicit mask
(``attention._by_runs``); where ``AttentionKernel.takes_run`` says so it now goes to
``AttentionKernel.attend_runs``. Arms, interleaved call by call, medians:

* ``sdpa``: ``F.scaled_dot_product_attention(q, k, v, attn_mask=causal, enable_gqa=True)``;
* ``kernel``: ``kernel.attend_runs([(q, k, v, causal limits)])``.

Shapes are SmolLM2-135M's (9 query heads, 3 key/value heads, head dim 64); the keys are
the ``context`` positions the run sees (the run's own last).

``--in-model N`` also times the engine at an ``N``-token session (SmolLM2 in each of
``--dtypes``): bench_splice's splice with logits by copy and in place, with the runs on
torch's flash kernel (``old``) and on the kernel (``new``) run by run
(``run_choice`` modes ``torch`` and ``kernel``), medians, and which of the two the engine's
own measurement (mode ``auto``, the default) picked for the replacement's shape.

Run: ``.venv/bin/python -m leyline.evals.bench_run_attention`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F

from leyline.engine.cpu import attention_kernel
from leyline.evals.bench_attention_ab import (
    add_attention_ab_options,
    attention_inputs,
    start_attention_ab,
)
from leyline.evals.bench_common import DTYPES, bench_parser, interleaved_medians


def bench(n: int, m: int, dtype: torch.dtype, runs: int) -> dict[str, float]:
    """Median ms of each arm: ``m`` queries at the last ``m`` of ``n`` positions."""
    query, keys, values = attention_inputs(n, m, dtype)
    hidden = torch.arange(n)[None] > torch.arange(n - m, n)[:, None]
    mask = torch.zeros(m, n, dtype=dtype).masked_fill_(hidden, torch.finfo(dtype).min)[None, None]
    causal = [n - m + 1 + j for j in range(m)]
    arms: dict[str, Callable[[], object]] = {
        "sdpa": lambda: F.scaled_dot_product_attention(
            query, keys, values, attn_mask=mask, enable_gqa=True
        )
    }
    kernel = attention_kernel.load()
    if kernel is not None:
        arms["kernel"] = lambda: kernel.attend_runs([(query, keys, values, causal)], None)
    ms = interleaved_medians(arms, runs)
    return {arm: t * 1e3 for arm, t in ms.items()}  # interleaved_medians times in ms


def bench_in_model(n: int, runs: int, dtype: torch.dtype) -> dict[str, float]:
    """Engine arms with the kernel's runs on (``new``) and off (``old``); ms medians."""
    from leyline.engine.engine import Engine
    from leyline.engine.session import SessionCache
    from leyline.evals.bench_common import document, stub_tokens, timed_edit
    from leyline.protocol.algebra import Edit
    from leyline.protocol.directives import Mode

    kernel = attention_kernel.load()
    if kernel is None:
        return {}
    engine = Engine.load("smollm2", dtype=dtype)
    base = SessionCache(engine)
    base.prefill(document(engine, n))
    start = n // 4
    edit = Edit(start, start + 300, stub_tokens(engine, 16), Mode.amortize)
    was = kernel.run_choice.mode
    times: dict[str, list[float]] = {}
    try:
        for i in range(runs + 1):
            for mode, arm in (("torch", "old"), ("kernel", "new")):
                kernel.run_choice.mode = mode
                for path, in_place in (("copy", False), ("in_place", True)):
                    ms = timed_edit(base, edit, want_logits=True, in_place=in_place)[0]
                    if i:  # the first round warms up
                        times.setdefault(f"{path}_{arm}", []).append(ms)
        kernel.run_choice.mode = "auto"
        timed_edit(base, edit, want_logits=True)  # the engine's own choice, measured once
    finally:
        kernel.run_choice.mode = was
        base.release()
    return {k: statistics.median(v) for k, v in times.items()}


def engine_pick(dtype: torch.dtype) -> str:
    """Which path the engine's measurement chose for ``dtype``'s run shapes so far."""
    kernel = attention_kernel.load()
    measured = {} if kernel is None else kernel.run_choice.measured
    picks = {"kernel" if k < t else "torch" for s, (k, t) in measured.items() if s[0] == dtype}
    return picks.pop() if len(picks) == 1 else "mixed" if picks else "-"


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__ or "")
    parser.add_argument(
        "--contexts",
        type=int,
        nargs="+",
        default=[300, 1040, 2064, 4096],
        help="keys the run's last query sees",
    )
    parser.add_argument(
        "--queries", type=int, nargs="+", default=[4, 16, 64], help="queries in the run"
    )
    parser.add_argument(
        "--dtypes", nargs="+", choices=sorted(DTYPES), default=["float32"], help="cache dtypes"
    )
    add_attention_ab_options(parser, runs=100, quick="one shape, 10 calls")
    args = parser.parse_args(argv)
    if args.quick:
        args.contexts, args.queries, args.runs = [300], [16], 10
    start_attention_ab(args)
    kernel = attention_kernel.load()
    if kernel is not None and not kernel.runs_vectorised:
        print("# this build has no vectorised query runs: the engine keeps SDPA for them")
    print("dtype     context queries | sdpa_us kernel_us | sdpa/kernel")
    nan = float("nan")
    for name in args.dtypes:
        for n in args.contexts:
            for m in args.queries:
                if m > n:
                    continue
                us = bench(n, m, DTYPES[name], args.runs)
                k_us = us.get("kernel", nan)
                print(
                    f"{name:9} {n:7} {m:7} | {us['sdpa']:7.0f} {k_us:9.0f} | "
                    f"{us['sdpa'] / k_us:10.2f}x",
                    flush=True,
                )
    if args.in_model is not None:
        print(f"# in the engine, {args.in_model} tokens, splice with logits (ms, medians)")
        print("dtype     | copy: old new x | in place: old new x | auto picks")
        for name in args.dtypes:
            r = bench_in_model(args.in_model, args.model_runs, DTYPES[name])
            if not r:
                print(f"{name:9} | no attention kernel")
                continue
            print(
                f"{name:9} | {r['copy_old']:6.1f} {r['copy_new']:6.1f} "
                f"{r['copy_old'] / r['copy_new']:5.2f}x | {r['in_place_old']:6.1f} "
                f"{r['in_place_new']:6.1f} {r['in_place_old'] / r['in_place_new']:5.2f}x | "
                f"{engine_pick(DTYPES[name])}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
