"""Progress bars on stderr: tqdm when installed, nothing otherwise (never required)."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


def progress(
    items: Iterable[T], *, desc: str, total: int | None = None, enabled: bool = True
) -> Iterator[T]:
    """Iterate ``items`` with a bar named ``desc`` (unit-less; ``total`` when not sized)."""
    if not enabled or importlib.util.find_spec("tqdm") is None:
        yield from items
        return
    from tqdm import tqdm

    with tqdm(items, desc=desc, total=total, dynamic_ncols=True, leave=False) as bar:
        yield from bar
