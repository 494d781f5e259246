"""The engine with and without ``linear_kernel``, in one process: what few-row products on
the packed weights buy a whole operation.

One engine, one prefilled session; each arm is timed with every packed layer's kernel
binding switched on, then off (oneDNN's product for every row count), interleaved so the
machine's noise hits both alike. Arms: a delete with next-token logits (one row through
the model), a splice with logits (17 rows: on the kernel in fp32 and in bf16 with the tile
unit or a bf16 dot product, else the control), and batched decode steps of 1, 4 and 8
sessions (``Engine.forward_rows``). With the kernel on, a layer whose products all run on it
runs fused (``layer_kernel``); off, every product is oneDNN's and every layer lean. Figures are
medians; ``x`` is off / on. The logits of both settings are compared too (the products
differ only in summation order).

Run: ``.venv/bin/python -m leyline.evals.bench_linear_kernel`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from leyline.engine.cpu.linear_kernel import DirectLinear
from leyline.engine.cpu.packed_linear import PackedLinear
from leyline.engine.engine import Engine
from leyline.engine.kv.allocator import retain_freed_memory
from leyline.engine.lean_layers import drop_lean_layers, use_lean_layers
from leyline.engine.session import SessionCache
from leyline.evals.bench_common import DTYPES, document, stub_tokens, timed_edit
from leyline.evals.bench_decode import session_rows
from leyline.protocol.algebra import Edit
from leyline.protocol.directives import Mode


class KernelSwitch:
    """Turns every packed layer's kernel binding on or off (and with it the fused few-row
    layers, whose products run on the kernel: ``layer_kernel``)."""

    def __init__(self, engine: Engine) -> None:
        self.model = engine.model
        self.layers = [m for m in engine.model.modules() if isinstance(m, PackedLinear)]
        self.bound: list[DirectLinear | None] = [m.direct for m in self.layers]

    @property
    def bound_layers(self) -> int:
        return sum(b is not None for b in self.bound)

    def set(self, on: bool) -> None:
        for layer, direct in zip(self.layers, self.bound, strict=True):
            layer.direct = direct if on else None
        drop_lean_layers(self.model)
        use_lean_layers(self.model)  # binds the fused layers where the products allow


Arm = Callable[[], float]
"""Runs once and returns the milliseconds of its timed part."""


def edit_arm(base: SessionCache, edit: Edit, out: dict[str, torch.Tensor], key: str) -> float:
    """Milliseconds of ``edit`` with logits on a fork of ``base``; keeps the logits."""
    ms, out[key] = timed_edit(base, edit, want_logits=True)
    return ms


def interleaved(arms: dict[str, Arm], runs: int) -> dict[str, float]:
    """Median milliseconds per arm: one warm-up each, then ``runs`` rounds of all arms."""
    for arm in arms.values():
        arm()
    times: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(runs):
        for name, arm in arms.items():
            times[name].append(arm())
    return {name: statistics.median(t) for name, t in times.items()}


def bench_dtype(args: argparse.Namespace, name: str) -> dict[str, float]:
    engine = Engine.load(args.model, dtype=DTYPES[name])
    switch = KernelSwitch(engine)
    print(f"# {name}: {len(switch.layers)} packed layers, {switch.bound_layers} on linear_kernel")
    if not switch.bound_layers:
        print(f"# {name}: nothing to compare ({engine.packing.reason or engine.packing.kernel})")
        return {}
    n = args.context
    base = SessionCache(engine)
    base.prefill(document(engine, n))
    start = n // 4
    end = min(start + 300, n - 1)
    stub = stub_tokens(engine, 16)
    logits: dict[str, torch.Tensor] = {}
    decode_rows = {
        b: session_rows(engine, b, args.decode_context, 4 * args.runs + 8, b) for b in args.batches
    }
    steps = dict.fromkeys(args.batches, 0)

    def decode(b: int) -> float:
        rows = [type(r)(r.buffers, r.length + steps[b], r.token) for r in decode_rows[b]]
        steps[b] += 1
        t0 = time.perf_counter()
        engine.forward_rows(rows)
        return (time.perf_counter() - t0) * 1e3

    def arms_for(on: bool) -> dict[str, Arm]:
        tag = "on" if on else "off"

        def run(fn: Arm) -> Arm:
            def switched() -> float:
                switch.set(on)
                return fn()

            return switched

        arms: dict[str, Arm] = {
            f"delete_{tag}": run(
                lambda: edit_arm(base, Edit(start, end, (), Mode.amortize), logits, f"d{tag}")
            ),
            f"splice_{tag}": run(
                lambda: edit_arm(base, Edit(start, end, stub, Mode.amortize), logits, f"s{tag}")
            ),
        }
        for b in args.batches:
            arms[f"decode{b}_{tag}"] = run(lambda b=b: decode(b))
        return arms

    med = interleaved({**arms_for(True), **arms_for(False)}, args.runs)
    switch.set(True)
    base.release()
    labels = [("delete", f"delete + logits at {n}"), ("splice", f"splice + logits at {n}")]
    labels += [(f"decode{b}", f"decode step, {b} sessions") for b in args.batches]
    print("arm | kernel_ms | onednn_ms | x")
    for key, label in labels:
        on, off = med[f"{key}_on"], med[f"{key}_off"]
        print(f"{label} | {on:.1f} | {off:.1f} | {off / on:.2f}x")
    for key, label in (("d", "delete"), ("s", "splice")):
        a, b = logits[f"{key}on"], logits[f"{key}off"]
        same = int(a.argmax()) == int(b.argmax())
        print(
            f"# {label}: max |logit on - off| {float((a - b).abs().max()):.2e}, argmax same: {same}"
        )
    return med


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--model", default="smollm2", help="smollm2, tiny-mla-v2/v3, .gguf, HF dir")
    p.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    p.add_argument("--context", type=int, default=4096, help="the edited session's tokens")
    p.add_argument("--decode-context", type=int, default=1024, help="each decoding session's")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--runs", type=int, default=7, help="rounds of every arm (medians)")
    p.add_argument("--threads", type=int, default=None, help="torch threads")
    p.add_argument("--quick", action="store_true", help="smoke run: 1024 tokens, 2 runs")
    args = p.parse_args(argv)
    if args.quick:
        args.context, args.decode_context, args.runs, args.batches = 1024, 64, 2, [1, 2]
    if args.threads:
        torch.set_num_threads(args.threads)
    retain_freed_memory()
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads, {args.model}")
    return {name: bench_dtype(args, name) for name in args.dtypes}


if __name__ == "__main__":
    main()
