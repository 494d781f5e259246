"""Edits in place against edits by copy, in one process: latency and the move's cost.

One engine, one prefilled session per context; each arm edits a private copy of it
(``timed_edit``), once in place (``in_place_edit``: forward into a side buffer, then move
inside the session's buffers) and once by copy (a new buffer, the path of shared KV),
interleaved so the machine's noise hits both alike. Arms: a splice (300 tokens -> 16 at
25% of the context) and a delete of the same span, both with next-token logits. Then the
keys' move alone: ``in_place_edit._move_keys`` on the session's downstream against one
``rotate_many_into`` of the same keys into another buffer (what the copy path's rotation
costs). Figures are medians; ``x`` is copy / in place. Peak memory: ``bench_splice``.

Run: ``.venv/bin/python -m leyline.evals.bench_in_place`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from leyline.engine.edits.in_place_edit import _move_keys
from leyline.engine.engine import Engine
from leyline.engine.rope import rotate_many_into
from leyline.engine.session import SessionCache
from leyline.evals.bench_common import (
    DTYPES,
    document,
    engine_bench_args,
    start_engine_bench,
    stub_tokens,
    timed_edit,
)
from leyline.evals.bench_linear_kernel import Arm, interleaved
from leyline.protocol.algebra import Edit, Run
from leyline.protocol.directives import Mode


def _ms(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def bench_context(engine: Engine, n: int, runs: int, span: int) -> dict[str, float]:
    base = SessionCache(engine)
    base.prefill(document(engine, n))
    start = n // 4
    end = min(start + span, n - 1)
    stub = stub_tokens(engine, 16)
    arms: dict[str, Arm] = {}
    for name, replacement in (("splice", stub), ("delete", ())):
        for in_place in (True, False):
            edit = Edit(start, end, replacement, Mode.amortize)
            key = f"{name}_{'in_place' if in_place else 'copy'}"
            arms[key] = lambda e=edit, p=in_place: timed_edit(
                base, e, want_logits=True, in_place=p
            )[0]
    assert engine.layout is not None and engine.rope is not None
    layout, rope = engine.layout, engine.rope
    kv = base.fork(copy_kv=True).kv  # a private copy the move may scramble
    moved = Run("kept", start + len(stub), n - (end - start) + len(stub), end)
    target = [torch.empty_like(layer[layout.slot]) for layer in kv]
    pairs = [
        (dst[:, :, moved.new_start : moved.new_end], layer[layout.slot][:, :, end:n])
        for dst, layer in zip(target, kv, strict=True)
    ]
    arms["keys_move_in_place"] = lambda: _ms(lambda: _move_keys(kv, moved, layout, rope))
    arms["keys_rotate_into_buffer"] = lambda: _ms(
        lambda: rotate_many_into(
            pairs, moved.delta, rope.inv_freq, layout.pairing, offset=layout.offset
        )
    )
    med = interleaved(arms, runs)
    base.release()
    return med


def main(argv: list[str] | None = None) -> dict[str, dict[int, dict[str, float]]]:
    def span(p: argparse.ArgumentParser) -> None:
        p.add_argument("--span", type=int, default=300, help="tokens replaced by the 16-token stub")

    args = engine_bench_args(__doc__ or "", [4096, 8192], 7, span).parse_args(argv)
    if args.quick:
        args.contexts, args.runs, args.span = [512], 2, 100
    start_engine_bench(args)
    out: dict[str, dict[int, dict[str, float]]] = {}
    for name in args.dtypes:
        engine = Engine.load(args.model, dtype=DTYPES[name])
        if not engine.can_edit_in_place:
            print(f"# {name}: {engine.loaded.label} edits by copy only (not a GQA model)")
            out[name] = {}
            continue
        print(f"# {name}: medians of {args.runs}; x = copy / in place")
        print("context | arm | in_place_ms | copy_ms | x")
        out[name] = {}
        for n in args.contexts:
            med = bench_context(engine, n, args.runs, args.span)
            out[name][n] = med
            for arm in ("splice", "delete"):
                a, b = med[f"{arm}_in_place"], med[f"{arm}_copy"]
                print(f"{n} | {arm} + logits | {a:.1f} | {b:.1f} | {b / a:.2f}x")
            a, b = med["keys_move_in_place"], med["keys_rotate_into_buffer"]
            print(f"{n} | keys' move (rotate into a buffer) | {a:.1f} | {b:.1f} | {b / a:.2f}x")
    return out


if __name__ == "__main__":
    main()
