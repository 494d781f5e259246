"""A token's own bytes, for logprobs: what the model emitted, not its decoding on its own.

Byte-level BPE vocabularies (GPT-2 style, SmolLM2's) spell each byte as one printable
character; a token that is part of a multi-byte character then decodes on its own to U+FFFD,
while its bytes are exact. SentencePiece byte-fallback tokens are spelled ``<0xNN>``.
Anything else is the UTF-8 of its decoding.
"""

from __future__ import annotations

import re
from functools import cache
from typing import Any

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@cache
def _byte_level_alphabet() -> dict[str, int]:
    """The GPT-2 byte <-> printable character table, character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:  # the rest are shifted past 255, in order
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def token_bytes(tokenizer: Any, token: int) -> bytes:
    """The bytes of ``token`` in ``tokenizer``'s vocabulary."""
    piece = tokenizer.convert_ids_to_tokens(int(token))
    if isinstance(piece, str):
        if match := _BYTE_FALLBACK.fullmatch(piece):
            return bytes([int(match.group(1), 16)])
        alphabet = _byte_level_alphabet()
        if piece and all(c in alphabet for c in piece) and _is_byte_level(tokenizer):
            return bytes(alphabet[c] for c in piece)
    return str(tokenizer.decode([int(token)], skip_special_tokens=False)).encode()


def _is_byte_level(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    return type(decoder).__name__ == "ByteLevel"
