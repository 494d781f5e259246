"""adopt_generated_ids on toy vocabularies: when a re-sent reply keeps its generated ids."""

from __future__ import annotations

from collections.abc import Sequence

from leyline.protocol.spans import MessageSpan, TokenSpan
from leyline.serve.retokenize import adopt_generated_ids

VOCAB = {1: "<s>", 2: "<e>", 10: "ab", 11: "a", 12: "b", 13: "c", 14: "\n", 15: "x"}
STOP = {2}


def decode(ids: Sequence[int]) -> str:
    return "".join(VOCAB[i] for i in ids)


def assistant(index: int, start: int, end: int, *parts: tuple[int, int]) -> MessageSpan:
    content = TokenSpan(start=parts[0][0], end=parts[0][1])
    calls = TokenSpan(start=parts[1][0], end=parts[1][1]) if len(parts) > 1 else None
    return MessageSpan(
        message=index, role="assistant", start=start, end=end, content=content, tool_calls=calls
    )


def test_same_text_other_ids_takes_the_cached_ids_and_shifts_what_follows() -> None:
    cached = [1, 11, 12, 2]  # generated "ab" as "a" + "b", then the stop token
    prompt = [1, 10, 2, 15]  # rendered "ab" canonically, then a new message
    spans = [assistant(0, 0, 3, (1, 2)), MessageSpan(message=1, role="user", start=3, end=4)]
    adopted = adopt_generated_ids(cached, prompt, spans, decode, STOP)
    assert adopted is not None
    tokens, moved = adopted
    assert tokens == (1, 11, 12, 2, 15)
    assert moved[0].content == TokenSpan(start=1, end=3) and moved[0].end == 4
    assert (moved[1].start, moved[1].end) == (4, 5)


def test_a_boundary_between_content_and_tool_calls_is_found_by_text() -> None:
    cached = [1, 11, 12, 14, 13, 2]  # "a" "b" "\n" "c"
    prompt = [1, 10, 14, 13, 2]  # "ab" "\n" "c": content "ab", tool calls "c"
    spans = [assistant(0, 0, 5, (1, 2), (3, 4))]
    adopted = adopt_generated_ids(cached, prompt, spans, decode, STOP)
    assert adopted is not None
    assert adopted[1][0].content == TokenSpan(start=1, end=3)
    assert adopted[1][0].tool_calls == TokenSpan(start=4, end=5)


def test_a_different_text_or_a_user_message_is_left_alone() -> None:
    spans = [assistant(0, 0, 3, (1, 2))]
    assert adopt_generated_ids([1, 11, 13, 2], [1, 10, 2], spans, decode, STOP) is None
    user = [MessageSpan(message=0, role="user", start=0, end=3, content=TokenSpan(start=1, end=2))]
    assert adopt_generated_ids([1, 11, 12, 2], [1, 10, 2], user, decode, STOP) is None
    assert adopt_generated_ids([1, 10, 2], [1, 10, 2, 15], spans, decode, STOP) is None
