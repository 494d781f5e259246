"""A client of this version reads a newer minor server's responses (spec section 9): unknown
response fields are ignored, while requests stay strict."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from leyline.protocol import Capabilities, LeylineResponse
from leyline.protocol.resources import SessionCreate, SessionInfo


def test_responses_from_a_newer_minor_version_parse() -> None:
    caps = Capabilities.model_validate(
        {"protocol_version": "1.7", "verbs": ["splice"], "limits": {"max_new_thing": 3},
         "a_later_flag": True}
    )  # fmt: skip
    assert caps.verbs[0].value == "splice"
    info = SessionInfo.model_validate(
        {"session": "s", "revision": 1, "num_tokens": 0,
         "spans": [{"message": 0, "role": "user", "start": 0, "end": 4, "later": 1}],
         "later": {}}
    )  # fmt: skip
    assert info.spans[0].end == 4
    reply = LeylineResponse.model_validate(
        {"session": "s", "revision": 2, "path": "splice", "reused_tokens": 1,
         "prefilled_tokens": 0, "rotated_tokens": 0, "a_later_count": 9}
    )  # fmt: skip
    assert reply.revision == 2


def test_requests_stay_strict() -> None:
    with pytest.raises(ValidationError):
        SessionCreate.model_validate({"tokens": [1], "cache_salty": "typo"})
