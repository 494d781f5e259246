"""Parse wire data into protocol models, turning schema violations into typed errors."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from pydantic import BaseModel, TypeAdapter, ValidationError

from .directives import DIRECTIVE_LIST_ADAPTER, Directive
from .errors import ErrorCode, LeylineError

M = TypeVar("M", bound=BaseModel)


def _field_path(loc: tuple[int | str, ...]) -> str:
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += f".{part}" if path else part
    return path


def _as_leyline_error(exc: ValidationError, prefix: str = "") -> LeylineError:
    return error_from_details(exc.errors(include_url=False), prefix)


def error_from_details(errors: Sequence[Mapping[str, Any]], prefix: str = "") -> LeylineError:
    """A typed error from pydantic's error details (also what FastAPI reports)."""
    # The most specific problem (longest path) explains a failed union best.
    first = max(errors, key=lambda e: len(e["loc"]))
    loc = tuple(first["loc"])
    # Drop the union-member tags pydantic adds (e.g. "splice", "tokens") from the path.
    loc = tuple(p for p in loc if not (isinstance(p, str) and _is_union_tag(p)))
    field = _field_path(loc)
    if prefix:
        field = f"{prefix}{'' if not field or field.startswith('[') else '.'}{field}"
    message = str(first["msg"]).removeprefix("Value error, ")
    code = ErrorCode.invalid_directive
    if _SPAN_FIELDS & {str(p) for p in loc} and first["type"] in _RANGE_ERRORS:
        code = ErrorCode.invalid_span
    if first["type"] == "too_short" and loc and loc[-1] == "directives":
        code = ErrorCode.empty_batch
        message = "the batch is empty; send at least one directive"
    elif first["type"] == "union_tag_invalid" and first.get("ctx", {}).get("discriminator") in (
        None,
        "'verb'",
    ):
        message = f"unknown verb; expected one of {_VERBS}"
    elif first["type"] == "union_tag_invalid":  # another tagged union, e.g. recompute's mode
        ctx = first["ctx"]
        name = str(ctx["discriminator"]).strip("'")
        message = f"unknown {name} {ctx['tag']!r}; expected one of {ctx['expected_tags']}"
    elif first["type"] == "extra_forbidden":
        message = "unexpected field; remove it (extra fields are forbidden)"
    count = len(errors)
    if count > 1:
        message += f" (and {count - 1} more problem{'s' if count > 2 else ''})"
    return LeylineError(code, message, field or None)


_VERBS = "splice, forget, erratum, compose, pin, decay, scratch"
_UNION_TAGS = frozenset(_VERBS.split(", ")) | {
    "token_span",
    "message_anchor",
    "str",
    "token_position",  # compose's insertion point
    "message_point",
    "end_of_sequence",
    "none",  # compose's recompute modes
    "deviation",
    "attention",
}
_SPAN_FIELDS = frozenset({"span", "corrects", "at"})
_RANGE_ERRORS = frozenset({"value_error", "greater_than_equal"})


def _is_union_tag(part: str) -> bool:
    return part in _UNION_TAGS or part.startswith("list[")


def parse_model(model: type[M], data: Any, prefix: str = "") -> M:
    """``model.model_validate(data)``, raising ``invalid_directive`` naming the field."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise _as_leyline_error(exc, prefix) from None


def parse_directives(data: Any) -> list[Directive]:
    """Validate a JSON list of directives; field paths read ``directives[i].span.end``."""
    try:
        return DIRECTIVE_LIST_ADAPTER.validate_python(data)
    except ValidationError as exc:
        raise _as_leyline_error(exc, "directives") from None


def parse_json(adapter: TypeAdapter[Any], raw: str | bytes, prefix: str = "") -> Any:
    try:
        return adapter.validate_json(raw)
    except ValidationError as exc:
        raise _as_leyline_error(exc, prefix) from None
