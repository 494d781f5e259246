"""Every linear layer of a model: torch's default ``F.linear`` vs oneDNN's packed weights
vs ``linear_kernel`` reading the packed weights.

The matrix products of one forward: each linear layer of the model once, on ``rows`` rows
(the output head on one row, as ``logits_to_keep=1`` runs it), from fresh weights in both
arms (two copies of the model's linear weights, one plain and one packed, so neither arm
finds the other's weights in cache). Arms interleaved, medians; ``GB/s`` is weight bytes
over time, ``GFLOP/s`` the products' arithmetic. The ``kernel`` arm runs every row count on
``linear_kernel`` (the engine sends it at most ``KERNEL_MAX_ROWS`` rows), bound to the
``packed@64`` arm's buffers.

Run: ``.venv/bin/python -m leyline.evals.bench_packed_linear`` (``--quick`` for a smoke run);
``--hints`` compares the row counts oneDNN is told to pack for.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from torch import nn

from leyline.engine.cpu import linear_kernel, switches
from leyline.engine.cpu.linear_kernel import DirectLinear
from leyline.engine.cpu.packed_linear import ROWS_HINT, PackedLinear, packing_refusal
from leyline.engine.models import load_model
from leyline.evals.bench_common import DTYPES, interleaved_medians


def plain_layers(model: nn.Module) -> list[nn.Linear]:
    """The model's linear layers, head last."""
    head = model.get_output_embeddings()  # type: ignore[operator]
    layers = [m for m in model.modules() if type(m) is nn.Linear and m is not head]
    return [*layers, head]


def kernel_layers(layers: list[nn.Linear], packed: list[PackedLinear]) -> list[DirectLinear]:
    """The layers bound to ``linear_kernel`` on ``packed``'s buffers; empty when the kernel
    is unusable or oneDNN packed a layer in another layout."""
    kernel = linear_kernel.load()
    if kernel is None:
        return []
    pairs = zip(layers, packed, strict=True)
    bound = [kernel.bind(p.packed, m.weight.detach(), p.bias) for m, p in pairs]
    return [] if any(b is None for b in bound) else [b for b in bound if b is not None]


def run_all(calls: list[tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor]]) -> None:
    with torch.no_grad():
        for fn, x in calls:
            fn(x)


def bench_dtype(args: argparse.Namespace, name: str) -> list[dict[str, float | int | str]]:
    model = load_model(args.model, dtype=DTYPES[name]).model
    with switches.override(packed_linear="on"):  # wherever oneDNN packs, AVX-512 or not
        refusal = packing_refusal(model)
    if refusal:
        print(f"# {name}: not packed ({refusal})")
        return []
    layers = plain_layers(model)
    weight_bytes = sum(m.weight.numel() * m.weight.element_size() for m in layers)
    packed = {h: [PackedLinear(m, h) for m in layers] for h in {*args.hints, ROWS_HINT}}
    direct = kernel_layers(layers, packed[ROWS_HINT])
    if not direct:
        print(f"# {name}: no kernel arm ({linear_kernel.status().detail})")
    macs = sum(m.in_features * m.out_features for m in layers[:-1])
    head_macs = layers[-1].in_features * layers[-1].out_features
    print(f"# {name}: {len(layers)} linear layers, {weight_bytes / 1e6:.0f} MB of weights")
    kernel_head = " | kernel_ms x" if direct else ""
    print(
        "rows | plain_ms GB/s GFLOP/s | "
        + " | ".join(f"packed@{h}_ms x" for h in args.hints)
        + kernel_head
    )
    rows_out: list[dict[str, float | int | str]] = []
    for rows in args.rows:
        last = len(layers) - 1
        xs = [
            torch.randn(1, 1 if i == last else rows, m.in_features).to(DTYPES[name])
            for i, m in enumerate(layers)
        ]
        arms = {"plain": lambda xs=xs: run_all(list(zip(layers, xs, strict=True)))}
        for h, mods in packed.items():
            if h in args.hints:
                arms[f"packed@{h}"] = lambda mods=mods, xs=xs: run_all(
                    list(zip(mods, xs, strict=True))
                )
        if direct:
            arms["kernel"] = lambda xs=xs: run_all(list(zip(direct, xs, strict=True)))
        med = interleaved_medians(arms, args.runs)
        flops = 2 * (rows * macs + head_macs)
        plain = med["plain"]
        cells = " | ".join(
            f"{med[arm]:9.1f} {plain / med[arm]:4.2f}x"
            for arm in [*(f"packed@{h}" for h in args.hints), *(["kernel"] if direct else [])]
        )
        print(
            f"{rows:4d} | {plain:8.1f} {weight_bytes / plain / 1e6:5.1f} "
            f"{flops / plain / 1e6:7.1f} | {cells}"
        )
        rows_out.append({"dtype": name, "rows": rows, **{f"{k}_ms": v for k, v in med.items()}})
    return rows_out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", default="smollm2", help="smollm2, tiny-mla-v2/v3, .gguf, HF dir")
    p.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    p.add_argument("--rows", nargs="+", type=int, default=[1, 4, 17, 64, 512])
    p.add_argument("--hints", nargs="+", type=int, default=[ROWS_HINT])
    p.add_argument("--runs", type=int, default=7, help="rounds of every arm (medians)")
    p.add_argument("--threads", type=int, default=None, help="torch threads")
    p.add_argument("--quick", action="store_true", help="smoke run: rows 1 17, 2 runs")
    args = p.parse_args(argv)
    if args.quick:
        args.rows, args.runs = [1, 17], 2
    return args


def main(argv: list[str] | None = None) -> list[dict[str, float | int | str]]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads, {args.model}")
    return [row for name in args.dtypes for row in bench_dtype(args, name)]


if __name__ == "__main__":
    main()
