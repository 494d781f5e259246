"""What the ``leyline eval`` command lines share: list arguments, the usual options, torch threads.

Imports nothing heavy: the CLI builds every eval's parser without torch, and the debug-gym
harness (Python 3.12, no torch) uses it too.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T")
D = TypeVar("D", bound="DataclassInstance")

THREADS_HELP = "torch CPU threads (default 1: on a shared machine more threads ran slower)"


def comma_list(
    convert: Callable[[str], T],
    valid: Callable[[T], bool],
    *,
    unparsable: str,
    invalid: str,
    skip_blank: bool = True,
    dedupe: bool = False,
) -> Callable[[str], tuple[T, ...]]:
    """An argparse ``type``: a comma list of ``convert``-ed values, each ``valid``.

    ``unparsable`` and ``invalid`` are the error messages (``{text!r}`` is the argument);
    ``skip_blank`` ignores empty items (``1,,2``), ``dedupe`` drops repeats (first kept).
    """

    def parse(text: str) -> tuple[T, ...]:
        try:
            values = tuple(convert(v) for v in text.split(",") if v.strip() or not skip_blank)
        except ValueError:
            raise argparse.ArgumentTypeError(unparsable.format(text=text)) from None
        if not values or not all(valid(v) for v in values):
            raise argparse.ArgumentTypeError(invalid.format(text=text))
        return tuple(dict.fromkeys(values)) if dedupe else values

    return parse


def int_list(
    minimum: int = 0,
    unparsable: str = "expected comma-separated integers, got {text!r}",
    invalid: str = "expected non-negative integers, got {text!r}",
    *,
    skip_blank: bool = True,
    dedupe: bool = False,
) -> Callable[[str], tuple[int, ...]]:
    """``comma_list`` of integers >= ``minimum``."""
    return comma_list(
        int,
        lambda v: v >= minimum,
        unparsable=unparsable,
        invalid=invalid,
        skip_blank=skip_blank,
        dedupe=dedupe,
    )


def add_endpoint(
    parser: argparse.ArgumentParser, *, base_url: str, model: str, model_help: str
) -> None:
    """--base-url (help ``base_url``), --api-key and --model (default ``model``): the
    OpenAI-compatible server an eval may use instead of its embedded one."""
    parser.add_argument("--base-url", help=base_url)
    parser.add_argument("--api-key", help="API key for --base-url")
    parser.add_argument("--model", default=model, help=model_help)


def add_run_options(
    parser: argparse.ArgumentParser,
    *,
    seed: str | None = None,
    threads: bool = False,
    out: str = "results folder",
    fast: str | None = None,
    progress: str = "no progress bar",
    full: str | None = None,
) -> None:
    """The options most evals end with, in this order: --seed, --threads, --out, --full,
    --fast, --no-progress (each text is the option's help; None leaves the option out).
    --full and --fast exclude each other."""
    if seed is not None:
        parser.add_argument("--seed", type=int, default=0, help=seed)
    if threads:
        parser.add_argument("--threads", type=int, default=1, help=THREADS_HELP)
    parser.add_argument("--out", type=Path, help=out)
    modes = parser.add_mutually_exclusive_group()
    if full is not None:
        modes.add_argument("--full", action="store_true", help=full)
    if fast is not None:
        modes.add_argument("--fast", action="store_true", help=fast)
    parser.add_argument("--no-progress", action="store_true", help=progress)


def from_args(cls: type[D], args: object, **given: Any) -> D:
    """``cls`` with ``given`` fields, and every other field that ``args`` (parsed arguments,
    or a configuration) has by name."""
    taken = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(cls)
        if f.name not in given and hasattr(args, f.name)
    }
    return cls(**taken, **given)


@contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """Run the block with ``count`` torch CPU threads (at least 1), then restore the caller's
    setting (tests run the evals in-process)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(max(1, count))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def print_summary(folder: Path) -> int:
    """Print the report's first section and where the report is; exit status 0."""
    print((folder / "report.md").read_text().split("## ", 2)[1].strip())
    print(f"\nreport: {folder}/report.md")
    return 0
