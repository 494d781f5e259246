"""Rendering cost by conversation length: message spans by pieces (linear) vs by prefixes.

Run: ``.venv/bin/python -m leyline.evals.bench_render [--sizes 400 800 1600] [--repeats 3]``.
Prints the median seconds of ``ChatRenderer.render`` (SmolLM2's template, one-word
messages, as a client that sends many small turns) for both methods, interleaved.
"""

from __future__ import annotations

import argparse
import statistics
import time

from leyline.core.chat.render import ChatRenderer
from leyline.core.openai_types import parse_chat
from leyline.engine.models import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[400, 800, 1600])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    tokenizer = load_model("smollm2").tokenizer
    assert tokenizer is not None
    renderer = ChatRenderer(tokenizer)
    by_prefixes = ChatRenderer(tokenizer)
    by_prefixes._bounds_by_pieces = lambda plain, text: None  # type: ignore[method-assign]
    print(f"{'messages':>8}  {'pieces (s)':>10}  {'prefixes (s)':>12}  ratio")
    for n in args.sizes:
        raw = [{"role": "user" if i % 2 else "assistant", "content": f"w{i}"} for i in range(n)]
        messages, _ = parse_chat(raw)
        times: dict[str, list[float]] = {"pieces": [], "prefixes": []}
        for _ in range(args.repeats):
            for name, r in (("pieces", renderer), ("prefixes", by_prefixes)):
                t0 = time.perf_counter()
                r.render(messages, add_generation_prompt=True)
                times[name].append(time.perf_counter() - t0)
        fast, slow = (statistics.median(times[k]) for k in ("pieces", "prefixes"))
        print(f"{n:>8}  {fast:>10.3f}  {slow:>12.3f}  {slow / fast:5.1f}x")


if __name__ == "__main__":
    main()
