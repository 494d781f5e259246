"""The protocol's JSON Schema, generated from the models and checked in beside them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, RootModel
from pydantic.json_schema import models_json_schema

from .capabilities import PROTOCOL_VERSION, Capabilities
from .directives import Directive
from .envelope import LeylineRequest, LeylineResponse
from .errors import ErrorEnvelope
from .resources import (
    ApplyDirectives,
    DetokenizeRequest,
    DetokenizeResponse,
    SessionCreate,
    SessionInfo,
    SkillCreate,
    SkillInfo,
    SkillList,
    TokenizeRequest,
    TokenizeResponse,
)

SCHEMA_PATH = Path(__file__).parent / "schemas" / "leyline.v1.schema.json"


class DirectiveBatch(RootModel[list[Directive]]):
    """A batch of directives, all addressed to one base revision."""


_MODELS: tuple[type[BaseModel], ...] = (
    DirectiveBatch,
    LeylineRequest,
    LeylineResponse,
    Capabilities,
    ErrorEnvelope,
    SessionCreate,
    SessionInfo,
    ApplyDirectives,
    SkillCreate,
    SkillInfo,
    SkillList,
    TokenizeRequest,
    TokenizeResponse,
    DetokenizeRequest,
    DetokenizeResponse,
)


def build_schema() -> dict[str, Any]:
    """One JSON Schema (draft 2020-12) whose ``$defs`` hold every wire type."""
    _, schema = models_json_schema(
        [(model, "validation") for model in _MODELS],
        title=f"Leyline protocol {PROTOCOL_VERSION}",
        description="Typed KV-cache directives for agentic inference. See docs/protocol.md.",
    )
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": f"leyline.v{PROTOCOL_VERSION.split('.')[0]}.schema.json",
        "x-protocol-version": PROTOCOL_VERSION,
        **schema,
        "anyOf": [{"$ref": f"#/$defs/{model.__name__}"} for model in _MODELS],
    }


def render_schema() -> str:
    return json.dumps(build_schema(), indent=2, sort_keys=True) + "\n"


def checked_in_schema() -> str:
    return SCHEMA_PATH.read_text(encoding="utf-8")
