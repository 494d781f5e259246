"""FORGET purges what was derived from the forgotten span from the server's shared prefix
cache (SGLang's radix tree, vLLM's cached blocks).

Protocol section 3.2: after a forget, no cache entry nobody holds may still serve KV computed
with the forgotten span in context. Measured from outside with the server's own plain route:
after the forget, a generate of the session's *original* tokens (the forgotten span
included) must find at most the prefix before the edit point cached (rounded down to a
page). Whatever it finds past that was left behind. The figure is recorded either way.
Prompts span a few pages past the edit point, so a purge that spares a page can show.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from ._live import (
    edited_session,
    floor_page,
    generate_ids,
    prompt_text,
    record,
    session_tokens,
)

if TYPE_CHECKING:
    from leyline.engine.engine import Engine

CUT = 40


def _forget(server: httpx.Client, tokens: list[int], start: int) -> None:
    forget = {"verb": "forget", "span": {"start": start, "end": start + CUT}}
    session, _, body = edited_session(server, tokens, [forget])
    assert body["path"] == "reprefill", body
    assert session_tokens(server, session)[0] == tokens[:start] + tokens[start + CUT :]


def _prompt(reference: Engine, tag: str, page: int) -> list[int]:
    """A prompt of at least 150 tokens and three pages plus the cut."""
    lines = 6
    while True:
        tokens = list(reference.encode(prompt_text(tag, lines=lines)))
        if len(tokens) >= max(150, 3 * page + CUT):
            return tokens
        lines += 2


def test_forget_leaves_no_kv_of_the_forgotten_span(
    server: httpx.Client, reference: Engine, page: int, report_path: Path | None
) -> None:
    tokens = _prompt(reference, "forget-purge", page)
    start = len(tokens) // 3
    _forget(server, tokens, start)
    _check_purged(server, tokens, start, page, report_path, "original tokens")


def test_forget_purges_what_a_generation_appended(
    server: httpx.Client, reference: Engine, page: int, report_path: Path | None
) -> None:
    """A generation past the session's tokens caches them plus its output (on SGLang one
    more node below the old sequence's path; on vLLM the blocks the output filled). It was
    computed with the forgotten span in context, so it goes too."""
    tokens = _prompt(reference, "forget-purge-extended", page)
    if page > 4:  # end 3 tokens short of a page: the output fills it, and vLLM caches it
        tokens = tokens[: floor_page(len(tokens), page) - 3]
    out, _ = generate_ids(server, tokens, 8)
    extended = tokens + out[:-1]  # what that generate cached
    _, cached = generate_ids(server, extended, 1)
    assert cached >= floor_page(len(extended) - 1, page), "the extension was not cached"
    start = len(tokens) // 3
    _forget(server, tokens, start)
    _check_purged(server, extended, start, page, report_path, "a generation's extension")


def _check_purged(
    server: httpx.Client,
    probe: list[int],
    start: int,
    page: int,
    report_path: Path | None,
    what: str,
) -> None:
    """A generate of ``probe`` finds nothing cached past the forget's edit point (rounded
    down to a page); the figure is recorded either way."""
    _, cached = generate_ids(server, probe, 1)
    leaked = max(0, cached - floor_page(start, page))
    record(
        report_path,
        check=f"forget: {what} still cached past the edit point",
        leaked_tokens=leaked,
        tokens=len(probe),
        edit_point=start,
        page_size=page,
    )
    assert leaked == 0, f"{leaked} tokens past the edit point were still cached"
