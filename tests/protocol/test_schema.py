"""The checked-in JSON Schema matches the models and agrees with them on examples."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from leyline.protocol.schema import build_schema, checked_in_schema, render_schema

from .test_directives import EXAMPLES


def test_checked_in_schema_matches_the_models() -> None:
    assert checked_in_schema() == render_schema(), (
        "src/leyline/protocol/schemas/leyline.v1.schema.json is stale: run `leyline schema --write`"
    )


def _validator(definition: str) -> jsonschema.Draft202012Validator:
    defs = build_schema()["$defs"]
    return jsonschema.Draft202012Validator({"$defs": defs, "$ref": f"#/$defs/{definition}"})


def test_schema_accepts_every_example_directive() -> None:
    _validator("DirectiveBatch").validate(EXAMPLES)


@pytest.mark.parametrize(
    "bad",
    [
        {"verb": "splize", "span": {"start": 0, "end": 1}},
        {"verb": "splice", "span": {"start": 0, "end": 1}, "extra": True},
        {"verb": "splice", "span": {"start": -1, "end": 1}},
        {"verb": "erratum", "text": ""},
        {"verb": "splice", "span": {"start": 0, "end": 1}, "replacement": [1, -1]},
    ],
)
def test_schema_rejects_what_the_models_reject(bad: dict[str, Any]) -> None:
    with pytest.raises(jsonschema.ValidationError):
        _validator("DirectiveBatch").validate([bad])


def test_request_extension_example_validates() -> None:
    request = {
        "session": "agent-1",
        "base_revision": 3,
        "directives": EXAMPLES[:3],
        "options": {"allow_fallback": False},
    }
    _validator("LeylineRequest").validate(request)
    json.dumps(build_schema())  # serialisable as is
