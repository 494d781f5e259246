"""Next-token choice (greedy or sampled) and the conditions that end a generation."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

FinishReason = Literal["stop", "length"]
"""``stop`` also covers a generation cancelled by its ``on_token`` callback."""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """``temperature == 0`` is greedy; otherwise softmax sampling with optional top-k/top-p.

    ``stop_token_ids=None`` means the model's end-of-sequence ids. A stop token is kept in
    the session's tokens (it is part of the rendered turn) but not in the returned text.
    ``stop`` strings end the generation once the decoded text contains one; the text is
    cut before it. ``logprobs=n`` reports, per generated token, its log-probability under
    the model's distribution (before temperature and truncation) and the ``n`` most likely
    alternatives (``0``: the chosen token's only).
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop_token_ids: tuple[int, ...] | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")

    def generator(self) -> torch.Generator | None:
        if self.seed is None:
            return None
        return torch.Generator().manual_seed(self.seed)


def choose_token(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> int:
    """One token id from fp32 next-token ``logits`` ``[vocab]``."""
    if params.temperature == 0:
        return int(torch.argmax(logits))
    scores = logits.float() / params.temperature
    if params.top_k is not None and params.top_k < scores.numel():
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p is not None and params.top_p < 1:
        sorted_scores, order = torch.sort(scores, descending=True)
        cumulative = torch.softmax(sorted_scores, dim=-1).cumsum(-1)
        # Drop a token when the mass before it already reaches top_p (the first always stays).
        drop = (cumulative - torch.softmax(sorted_scores, dim=-1)) >= params.top_p
        scores = scores.scatter(0, order, sorted_scores.masked_fill(drop, float("-inf")))
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


def token_logprobs(
    logits: torch.Tensor, token: int, top: int
) -> tuple[float, tuple[tuple[int, float], ...]]:
    """Log-probability of ``token`` and the ``top`` most likely (token, logprob) pairs."""
    logp = torch.log_softmax(logits.double(), dim=-1)
    best = torch.topk(logp, top) if top else None
    alternatives = (
        ()
        if best is None
        else tuple((int(i), float(v)) for v, i in zip(best.values, best.indices, strict=True))
    )
    return float(logp[token]), alternatives


def find_stop(text: str, stops: tuple[str, ...]) -> int | None:
    """Index in ``text`` where the earliest stop string starts, or None."""
    hits = [i for s in stops if s and (i := text.find(s)) >= 0]
    return min(hits) if hits else None
