"""Page arithmetic of a paged KV pool: a token at position ``i`` lives at in-page offset
``i % page``, so a splice can reuse whole pages only and the radix tree holds whole pages."""

from __future__ import annotations


def floor_page(n: int, page: int) -> int:
    return n - n % page


def ceil_page(n: int, page: int) -> int:
    return -(-n // page) * page


def tail_after_full_pages(length: int, page: int) -> int:
    """Tokens past the last full page: the tree cannot hold them, so a generate re-prefills."""
    return length % page
