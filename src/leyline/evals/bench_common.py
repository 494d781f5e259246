"""What the benchmarks share: a transcript-like document, a stub, timing of interleaved
arms, an edit timed on a fork, the KL between two logits, peak resident memory, and the
command-line pieces (parser, options, header and closing lines, the JSON file).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import threading
import time
from collections.abc import Callable, Mapping

import torch

from leyline.engine.engine import Engine
from leyline.engine.kv.allocator import retain_freed_memory
from leyline.engine.session import SessionCache
from leyline.protocol.algebra import Edit

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
"""The weight and cache dtypes the benchmarks take by name."""
STUB_TEXT = " [tool output elided: 300 tokens of a directory listing, no longer needed] "


def document(engine: Engine, n: int) -> list[int]:
    """``n`` tokens of an agent transcript-like text (random ids for tokenizer-less models)."""
    if engine.tokenizer is None:
        g = torch.Generator().manual_seed(0)
        return torch.randint(3, engine.vocab_size, (n,), generator=g).tolist()
    parts, tokens, i = [], [], 0
    while len(tokens) < n:
        parts.append(
            f"Step {i}: the agent ran `grep -n value_{i} src/module_{i % 7}.py` and got line "
            f"{i * 13 % 97}: value_{i} = compute(value_{i - 1}, {i * 7 % 11}). It then noted "
            f"that module_{i % 7} depends on module_{(i + 3) % 7}.\n"
        )
        i += 1
        if i % 16 == 0:
            tokens = list(engine.encode("".join(parts)))
    return tokens[:n]


def stub_tokens(engine: Engine, n: int) -> tuple[int, ...]:
    if engine.tokenizer is None:
        return tuple(range(5, 5 + n))
    base = engine.encode(STUB_TEXT)
    return tuple((base * (n // len(base) + 1))[:n])


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def interleaved_medians(arms: Mapping[str, Callable[[], object]], runs: int) -> dict[str, float]:
    """Median milliseconds of each arm: every arm run once to warm up, then ``runs`` rounds
    of all arms in turn, so that machine noise hits them alike."""
    times: dict[str, list[float]] = {name: [] for name in arms}
    for fn in arms.values():
        fn()
    for _ in range(runs):
        for name, fn in arms.items():
            times[name].append(timed(fn))
    return {name: statistics.median(t) for name, t in times.items()}


def kl(p: torch.Tensor, q: torch.Tensor) -> float:
    lp, lq = torch.log_softmax(p.double(), -1), torch.log_softmax(q.double(), -1)
    return float((lp.exp() * (lp - lq)).sum())


def timed_edit(
    base: SessionCache,
    edit: Edit,
    *,
    want_logits: bool = False,
    in_place: bool | None = None,
) -> tuple[float, torch.Tensor]:
    """Milliseconds to apply ``edit`` to a fork of ``base`` (the fork's next-token logits are
    computed after the clock stops), and those logits. ``in_place``: None runs the engine's
    default path; True edits inside the fork's own copy of the KV (made before the clock
    starts, ``in_place_edit``) where the model can; False by copy."""
    engine = base.engine
    was = engine.edits_in_place
    path = was if in_place is None else in_place and engine.can_edit_in_place
    fork = base.fork(copy_kv=path)
    engine.edits_in_place = path
    try:
        ms = timed(lambda: fork.apply_edits([edit], want_logits=want_logits))
        return ms, fork.next_token_logits()
    finally:
        engine.edits_in_place = was
        fork.release()
        gc.collect()


class RssSampler:
    """Peak resident memory of this process while a block runs (/proc sampled every 1 ms)."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._page = os.sysconf("SC_PAGE_SIZE")

    def rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self._page

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.rss())
            time.sleep(0.001)

    def __enter__(self) -> RssSampler:
        self.peak = self.rss()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.rss())


def bench_parser(doc: str) -> argparse.ArgumentParser:
    """A benchmark's parser: its docstring's first paragraph as the description, defaults
    shown in ``--help``."""
    return argparse.ArgumentParser(
        description=doc.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )


def engine_bench_args(
    doc: str, contexts: list[int], runs: int, extra: Callable[[argparse.ArgumentParser], None]
) -> argparse.ArgumentParser:
    """The options the per-dtype engine benchmarks share (``extra`` adds a script's own)."""
    p = bench_parser(doc)
    p.add_argument("--model", default="smollm2", help="smollm2, tiny-mla-v2/v3, .gguf, HF dir")
    p.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    p.add_argument("--contexts", type=int, nargs="+", default=contexts)
    extra(p)
    p.add_argument("--runs", type=int, default=runs, help="rounds of every arm (medians)")
    p.add_argument("--threads", type=int, default=None, help="torch threads")
    p.add_argument("--quick", action="store_true", help="smoke run: 512 tokens, 2 runs")
    return p


def start_engine_bench(args: argparse.Namespace) -> None:
    """Threads as asked, freed memory kept (``allocator``), and the run's header line."""
    if args.threads:
        torch.set_num_threads(args.threads)
    retain_freed_memory()
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads, {args.model}")


def finish_bench(results: Mapping[str, object], json_path: str | None) -> None:
    """The closing line (the load average says how busy the machine was while timing) and,
    where asked (--json), the figures as a JSON file."""
    print(f"# load avg at end {os.getloadavg()[0]:.2f}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(results, f, indent=1)
