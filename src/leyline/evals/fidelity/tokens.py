"""Prompts to token ids: the model's tokenizer, or hashed words for tokenizer-less models.

The three parts are encoded separately and concatenated, so the span's token boundaries
are exact by construction: full context = prefix + span + suffix, the edited sequence =
prefix + stub + suffix, and the splice replaces exactly ``[start, end)``.

The tiny MLA models have no tokenizer; there each word or punctuation mark becomes a
stable hash into the vocabulary, so repeated words repeat as ids (copying structure
survives) and nothing depends on a download.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from .prompts import Prompt

_WORD = re.compile(r"\w+|[^\w\s]|\n")


@dataclass(frozen=True, slots=True)
class TokenizedPrompt:
    prompt: Prompt
    tokens: tuple[int, ...]
    start: int
    end: int
    stub: tuple[int, ...]
    answer_token: int | None
    """First token of ``" " + answer`` (tokenizer models only; None when that token is a bare
    space, as for numbers): the start of the fact the question asks for."""

    @property
    def edited(self) -> tuple[int, ...]:
        return self.tokens[: self.start] + self.stub + self.tokens[self.end :]

    @property
    def delta(self) -> int:
        """How far every downstream token moves."""
        return len(self.stub) - (self.end - self.start)


def hashed_ids(text: str, vocab_size: int) -> tuple[int, ...]:
    """One id per word / punctuation mark / newline, ids 3.. (0-2 left to specials)."""
    ids = []
    for word in _WORD.findall(text):
        digest = hashlib.blake2b(word.encode(), digest_size=4).digest()
        ids.append(3 + int.from_bytes(digest, "little") % (vocab_size - 3))
    return tuple(ids)


def tokenize(prompt: Prompt, tokenizer: object | None, vocab_size: int) -> TokenizedPrompt:
    def enc(text: str) -> tuple[int, ...]:
        if tokenizer is None:
            return hashed_ids(text, vocab_size)
        return tuple(int(t) for t in tokenizer.encode(text, add_special_tokens=False))  # type: ignore[attr-defined]

    prefix, span, suffix, stub = (
        enc(p) for p in (prompt.prefix, prompt.span, prompt.suffix, prompt.stub)
    )
    answer = None
    if prompt.answer is not None and tokenizer is not None:
        answer = enc(" " + prompt.answer)[0]
        # Numbers start with a bare space token here (' ', '8', '4', ...): not the fact.
        if not tokenizer.decode([answer]).strip():  # type: ignore[attr-defined]
            answer = None
    tokens = prefix + span + suffix
    return TokenizedPrompt(prompt, tokens, len(prefix), len(prefix) + len(span), stub, answer)
