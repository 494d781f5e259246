"""What the endpoint is: an OpenAI-compatible server, with or without Leyline.

The splice arm needs a Leyline server (``GET /leyline/v1/capabilities`` answering with the
``splice`` verb in a compatible protocol version). Against any other server it runs as the
re-prefill arm and the report says so, with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx
from pydantic import ValidationError

from leyline.protocol import PROTOCOL_VERSION, LeylineError, Verb, is_compatible
from leyline.protocol.client import LeylineClient, LeylineHTTPError

from .config import Arm


@dataclass(frozen=True, slots=True)
class ServerInfo:
    leyline: bool
    """Directives can be sent: the server speaks a compatible Leyline with ``splice``."""
    note: str
    """What the probe found, in words (shown in the report)."""
    models: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class ArmPlan:
    """An arm as it will run against this server."""

    arm: Arm
    directives: bool
    """Edits go as Leyline directives in a session (else as edited plain messages)."""
    degraded: str | None = None
    """Why a splice arm runs as re-prefill."""

    @property
    def transport(self) -> str:
        if self.directives:
            return "Leyline directives (session per episode)"
        if self.degraded:
            return f"plain messages: splice DEGRADED to re-prefill ({self.degraded})"
        return "plain messages" if self.arm.policy is None else "edited plain messages"

    def to_json(self) -> dict[str, object]:
        return {
            "arm": self.arm.name,
            "policy": self.arm.policy,
            "directives": self.directives,
            "degraded": self.degraded,
            "transport": self.transport,
        }


def plan_arm(arm: Arm, server: ServerInfo) -> ArmPlan:
    if not arm.splice:
        return ArmPlan(arm, directives=False)
    if server.leyline:
        return ArmPlan(arm, directives=True)
    return ArmPlan(arm, directives=False, degraded=server.note)


def server_root(base_url: str) -> str:
    """``http://host:8000/v1`` -> ``http://host:8000`` (Leyline routes hang off the root)."""
    root = base_url.rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


def probe_server(
    base_url: str,
    api_key: str | None = None,
    *,
    timeout: float = 10.0,
    transport: httpx.BaseTransport | None = None,
) -> ServerInfo:
    """Ask ``/v1/models`` and ``/leyline/v1/capabilities``; never raises for a plain server.

    Raises:
        httpx.HTTPError: the endpoint does not answer at all (nothing to evaluate against).
    """
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(timeout=timeout, headers=headers, transport=transport) as http:
        listing = http.get(base_url.rstrip("/") + "/models")
        models: tuple[str, ...] = ()
        if listing.is_success:
            data = listing.json().get("data", [])
            models = tuple(str(m["id"]) for m in data if isinstance(m, dict) and "id" in m)
        client = LeylineClient(server_root(base_url), api_key=api_key, http_client=http)
        try:
            caps = client.capabilities()
        except (LeylineHTTPError, LeylineError, ValidationError, ValueError) as exc:
            return ServerInfo(False, f"no Leyline capabilities ({_short(exc)})", models)
    if not is_compatible(PROTOCOL_VERSION, caps.protocol_version):
        note = f"Leyline {caps.protocol_version} is incompatible with {PROTOCOL_VERSION}"
        return ServerInfo(False, note, models)
    if Verb.splice not in caps.verbs:
        return ServerInfo(False, f"Leyline without the splice verb ({caps.verbs})", models)
    verbs = ", ".join(v.value for v in caps.verbs)
    return ServerInfo(True, f"Leyline {caps.protocol_version} (verbs: {verbs})", models)


def _short(exc: Exception) -> str:
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return text[:120]
