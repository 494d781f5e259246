"""What the attention-kernel A/B benchmarks (``bench_decode_attention``,
``bench_run_attention``) share: SmolLM2-135M's attention inputs, the options, the header."""

from __future__ import annotations

import argparse

import torch

from leyline.engine.cpu import attention_kernel

HEADS, KV_HEADS, DIM = 9, 3, 64
"""SmolLM2-135M's query heads, key/value heads and head dim."""


def attention_inputs(
    n: int, m: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Query (``m`` positions), keys and values (``n``), seeded; keys and values are views
    of a longer buffer, as the engine's cache is."""
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(1, KV_HEADS, n + 64, DIM, generator=g).to(dtype)[:, :, :n]
    values = torch.randn(1, KV_HEADS, n + 64, DIM, generator=g).to(dtype)[:, :, :n]
    query = torch.randn(1, HEADS, m, DIM, generator=g).to(dtype)
    return query, keys, values


def add_attention_ab_options(parser: argparse.ArgumentParser, *, runs: int, quick: str) -> None:
    """The options the attention-kernel A/B benchmarks end with (``quick``: what --quick
    runs); --in-model times the same A/B inside the engine."""
    parser.add_argument("--runs", type=int, default=runs, help="calls per arm (medians)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--quick", action="store_true", help=f"smoke run: {quick}")
    parser.add_argument(
        "--in-model", type=int, default=None, metavar="N", help="also A/B the engine at N tokens"
    )
    parser.add_argument("--model-runs", type=int, default=7, help="engine runs per arm")


def start_attention_ab(args: argparse.Namespace) -> None:
    """Threads as asked, and the header lines: torch, and whether the attention kernel loads."""
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads, medians of {args.runs}")
    print(f"# attention kernel: {attention_kernel.status().detail}")
