"""What a server speaks: protocol version, verbs, architectures, limits; version rules."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from .directives import RecomputeMode, Verb
from .errors import ErrorCode, LeylineError

PROTOCOL_VERSION = "1.0"
"""``MAJOR.MINOR``. A minor bump only adds (optional fields, verbs, codes); a major breaks."""


class Limits(BaseModel):
    """Server limits a client can plan around. ``None`` means no limit."""

    # A response: a client ignores fields a newer minor version adds (docs/protocol.md, 9).
    model_config = ConfigDict(extra="ignore", frozen=True)

    max_directives: int | None = Field(default=64, ge=1)
    max_replacement_tokens: int | None = Field(default=4096, ge=0)
    max_session_tokens: int | None = Field(default=None, ge=1)
    max_sessions: int | None = Field(default=None, ge=1)
    tenant_max_sessions: int | None = Field(
        default=None,
        ge=1,
        description="Sessions one tenant may hold; past it that tenant's own idle sessions "
        "are evicted, least recently used first (never another tenant's).",
    )
    tenant_max_cache_bytes: int | None = Field(
        default=None,
        ge=1,
        description="KV bytes one tenant's sessions may hold together; past it that tenant's "
        "own idle sessions are evicted, and a session that alone exceeds it is refused.",
    )
    max_skill_tokens: int | None = Field(
        default=None,
        ge=1,
        description="Tokens one skill may hold; a longer one is refused (limit_exceeded).",
    )


class Capabilities(BaseModel):
    # A response: a client ignores fields a newer minor version adds (docs/protocol.md, 9).
    model_config = ConfigDict(extra="ignore", frozen=True)

    protocol_version: str = PROTOCOL_VERSION
    verbs: list[Verb] = Field(description="Verbs the server executes; others get unsupported_verb.")
    architectures: list[str] = Field(
        default_factory=list, description="Cache layouts it can rotate, e.g. 'gqa', 'mla'."
    )
    models: list[str] = Field(default_factory=list)
    limits: Limits = Field(default_factory=Limits)
    tenants: bool = Field(
        default=False,
        description="The server maps credentials to tenants and isolates sessions and "
        "shared-cache reuse per tenant (false: every client is one tenant).",
    )
    cache_salt: bool = Field(
        default=False,
        description="Requests and sessions may carry a cache_salt that narrows the "
        "shared-cache partition inside their tenant (false: the server cannot honour one, "
        "and refuses a session's cache_salt).",
    )
    require_session: bool = Field(
        default=False,
        description="A chat or completion request may set options.require_session: a session "
        "it names that does not exist is then unknown_session (404), never created (false: "
        "do not send it; a server without the option refuses it as an unknown field).",
    )
    compose_recompute: list[RecomputeMode] = Field(
        default_factory=lambda: [RecomputeMode.none],
        description="Recompute modes compose executes (with compose in verbs); another mode "
        "is refused with unsupported_option.",
    )
    skill_anchors: bool = Field(
        default=False,
        description="With compose: a skill may be registered with an anchor, context tokens "
        "its block is compiled after (false: an anchor is unsupported_option).",
    )


def parse_version(version: str) -> tuple[int, int]:
    try:
        major, minor = (int(part) for part in version.split("."))
    except ValueError:
        raise LeylineError(
            ErrorCode.incompatible_version,
            f"protocol version {version!r} is not MAJOR.MINOR (e.g. '1.0')",
            "protocol_version",
        ) from None
    return major, minor


def is_compatible(client: str, server: str) -> bool:
    """A client built for ``client`` can talk to ``server``: same major, server minor >= ours."""
    (c_major, c_minor), (s_major, s_minor) = parse_version(client), parse_version(server)
    return c_major == s_major and s_minor >= c_minor
