"""A reply sent back unchanged keeps the token ids the model generated.

The model may generate a text as ids its tokenizer would not choose (``[1141, 4326]`` for a
tool name that encodes as ``[100, 25414]``). When the client sends that reply back as an
assistant message, rendering re-tokenizes it, the prompt diverges from the cache inside the
reply, and everything after it would be prefilled again. If the cached ids decode to the
same text as the rendered reply, the prompt takes the cached ids instead: same text, same
model input as when it was generated.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

from leyline.core.batch import common_prefix
from leyline.protocol.spans import MessageSpan, TokenSpan

Decode = Callable[[Sequence[int]], str]


def adopt_generated_ids(
    cached: Sequence[int],
    prompt: Sequence[int],
    spans: Sequence[MessageSpan],
    decode: Decode,
    stop_ids: Collection[int],
) -> tuple[tuple[int, ...], tuple[MessageSpan, ...]] | None:
    """The prompt (and its spans) with the diverging assistant reply's body replaced by the
    cached ids of the same text; None when the divergence is not such a reply."""
    cached, prompt = tuple(cached), tuple(prompt)
    d = common_prefix(cached, prompt)
    if d >= len(cached) or d >= len(prompt):
        return None
    for span in spans:
        parts = [p for p in (span.content, span.tool_calls) if p is not None]
        if span.role != "assistant" or not parts:
            continue
        lo, hi = min(p.start for p in parts), max(p.end for p in parts)
        if not lo <= d <= hi:
            continue
        stop = next((i for i in range(lo, len(cached)) if cached[i] in stop_ids), len(cached))
        generated = cached[lo:stop]
        if generated == prompt[lo:hi] or decode(generated) != decode(prompt[lo:hi]):
            return None
        moved = _boundary_map(prompt, lo, hi, generated, decode, parts)
        if moved is None:
            return None
        return prompt[:lo] + generated + prompt[hi:], tuple(_remap(s, moved) for s in spans)
    return None


def _boundary_map(
    prompt: tuple[int, ...],
    lo: int,
    hi: int,
    generated: tuple[int, ...],
    decode: Decode,
    parts: Sequence[TokenSpan],
) -> Callable[[int], int] | None:
    """Position map of the substitution; part boundaries inside the body are found by text
    (None when one falls inside a generated token)."""
    inner: dict[int, int] = {}
    for b in {p.start for p in parts} | {p.end for p in parts}:
        if lo < b < hi:
            text = decode(prompt[lo:b])
            j = next((j for j in range(len(generated) + 1) if decode(generated[:j]) == text), None)
            if j is None:
                return None
            inner[b] = lo + j
    delta = len(generated) - (hi - lo)

    def moved(p: int) -> int:
        if p <= lo:
            return p
        if p >= hi:
            return p + delta
        return inner[p]

    return moved


def _remap(span: MessageSpan, moved: Callable[[int], int]) -> MessageSpan:
    def part(p: TokenSpan | None) -> TokenSpan | None:
        return None if p is None else TokenSpan(start=moved(p.start), end=moved(p.end))

    return span.model_copy(
        update={
            "start": moved(span.start),
            "end": moved(span.end),
            "content": part(span.content),
            "tool_calls": part(span.tool_calls),
        }
    )
