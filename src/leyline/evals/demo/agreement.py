"""Next-token agreement between the two arms, from the first generated token's logprobs.

The re-prefill arm's cache is what a fresh prefill of the edited messages gives: it is the
reference. The splice arm's downstream KV still carries the influence of what was cut
(AMORTIZE), so its distribution may drift; these numbers say how far.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from openai.types.chat import ChatCompletion

TopLogprobs = list[tuple[str, float]]
"""(token text, logprob) of the first generated token's top candidates, best first."""


def first_token_top(completion: ChatCompletion) -> TopLogprobs:
    """The top candidates for the first generated token (empty if the server sent none)."""
    choice = completion.choices[0] if completion.choices else None
    content = choice.logprobs.content if choice and choice.logprobs else None
    if not content:
        return []
    first = content[0]
    merged: dict[str, float] = {}
    for entry in first.top_logprobs or []:
        # Two token ids may decode to one text: add their probabilities.
        old = merged.get(entry.token)
        merged[entry.token] = entry.logprob if old is None else _logaddexp(old, entry.logprob)
    if not merged:
        merged[first.token] = first.logprob
    return sorted(merged.items(), key=lambda item: -item[1])


def top1_agrees(reference: TopLogprobs, other: TopLogprobs) -> bool | None:
    if not reference or not other:
        return None
    return reference[0][0] == other[0][0]


def approx_kl(reference: TopLogprobs, other: TopLogprobs) -> float | None:
    """KL(reference || other) in nats over the reference's top-k tokens.

    A token missing from ``other``'s top-k gets ``other``'s k-th logprob (an upper bound of
    its probability there). The sum leaves out the mass outside the reference's top-k, so it
    is an approximation; it is clamped at 0.
    """
    if not reference or not other:
        return None
    floor = min(lp for _, lp in other)
    found = dict(other)
    kl = sum(math.exp(lp) * (lp - found.get(tok, floor)) for tok, lp in reference)
    return max(0.0, kl)


def _logaddexp(a: float, b: float) -> float:
    high, low = max(a, b), min(a, b)
    return high + math.log1p(math.exp(low - high))


def mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None
