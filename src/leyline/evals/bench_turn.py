"""A chat turn with room for its reply in the prefill's buffers, against one without.

A turn prefills its prompt (the session's KV copied into a new buffer, the new tokens run
after it) and then generates. Without room, the generation copies the whole KV once more
into a buffer sized for the reply (``generation.Decoder``); with ``prefill(...,
reserve=max_tokens)`` (what the server does) it decodes into the room the prefill left.
One engine, one prefilled session per context (the prompt minus its last ``--prompt``
tokens, as after the previous turn); each arm runs the same turn on a private copy of it,
interleaved so the machine's noise hits both alike. Figures are medians; ``x`` is
copy / room.

Run: ``.venv/bin/python -m leyline.evals.bench_turn`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import statistics
import time

from leyline.core.turns import SamplingParams
from leyline.engine.engine import Engine
from leyline.engine.session import SessionCache
from leyline.evals.bench_common import DTYPES, document, engine_bench_args, start_engine_bench

PHASES = ("prefill", "begin", "generate", "turn")
"""``begin``: the generation's setup (``begin_generation``: where the copy goes); ``generate``
includes it."""


def one_turn(
    base: SessionCache, tokens: list[int], params: SamplingParams, reserve: int
) -> dict[str, float]:
    """Milliseconds of each phase (``PHASES``), on a private copy of ``base``."""
    session = base.fork(copy_kv=True)
    try:
        t0 = time.perf_counter()
        session.prefill(tokens, reserve=reserve)
        t1 = time.perf_counter()
        pending = session.begin_generation(params)
        tb = time.perf_counter()
        session.generate_pending(pending)
        t2 = time.perf_counter()
    finally:
        session.release()
    ms = {"prefill": t1 - t0, "begin": tb - t1, "generate": t2 - t1, "turn": t2 - t0}
    return {phase: s * 1e3 for phase, s in ms.items()}


def bench_context(
    engine: Engine, n: int, prompt: int, max_tokens: int, runs: int
) -> dict[str, dict[str, float]]:
    """Per arm (``room``, ``copy``), the median of each phase."""
    tokens = document(engine, n)
    base = SessionCache(engine)
    base.prefill(tokens[: n - prompt])
    params = SamplingParams(max_new_tokens=max_tokens, stop_token_ids=(-1,))
    reserves = {"room": max_tokens, "copy": 0}
    times: dict[str, list[dict[str, float]]] = {arm: [] for arm in reserves}
    for reserve in reserves.values():  # warm-up
        one_turn(base, tokens, params, reserve)
    for i in range(runs):
        order = list(reserves) if i % 2 == 0 else list(reversed(reserves))
        for arm in order:
            times[arm].append(one_turn(base, tokens, params, reserves[arm]))
    base.release()
    return {
        arm: {p: statistics.median(t[p] for t in rows) for p in PHASES}
        for arm, rows in times.items()
    }


def main(argv: list[str] | None = None) -> dict[str, dict[int, dict[str, dict[str, float]]]]:
    def turn(p: argparse.ArgumentParser) -> None:
        p.add_argument("--prompt", type=int, default=32, help="new prompt tokens of the turn")
        p.add_argument("--max-tokens", type=int, default=16, help="tokens generated")

    args = engine_bench_args(__doc__ or "", [4096, 8000], 7, turn).parse_args(argv)
    if args.quick:
        args.contexts, args.runs, args.max_tokens = [512], 2, 4
    start_engine_bench(args)
    print(f"# a turn: {args.prompt} new prompt tokens, {args.max_tokens} generated (greedy)")
    out: dict[str, dict[int, dict[str, dict[str, float]]]] = {}
    for name in args.dtypes:
        engine = Engine.load(args.model, dtype=DTYPES[name])
        print(f"# {name}: medians of {args.runs}; x = copy / room")
        print("context | phase | room_ms | copy_ms | x")
        out[name] = {}
        for n in args.contexts:
            med = bench_context(engine, n, args.prompt, args.max_tokens, args.runs)
            out[name][n] = med
            for phase in PHASES:
                a, b = med["room"][phase], med["copy"][phase]
                print(f"{n} | {phase} | {a:.1f} | {b:.1f} | {b / a:.2f}x")
    return out


if __name__ == "__main__":
    main()
