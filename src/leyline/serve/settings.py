"""One config object for ``leyline serve``: model, address, limits, auth, logging."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from leyline.core.sessions import DEFAULT_TENANT
from leyline.engine.work_estimates import SCHEDULE_POLICIES, SchedulePolicy
from leyline.protocol import Limits
from leyline.serve.worker import checked_worker_name

_TENANT = re.compile(r"[A-Za-z0-9_.-]{1,64}")


@dataclass(frozen=True, slots=True)
class ServerSettings:
    model: str = "smollm2"
    """'smollm2' (embedded default), 'tiny-mla-v2'/'tiny-mla-v3' (random), a .gguf or HF dir."""
    dtype: str = "float32"
    """Weights and KV cache: 'float32' or 'bfloat16' (RoPE shifts are computed in fp32)."""
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    """One key, one tenant (``default``)."""
    api_keys: tuple[tuple[str, str], ...] = ()
    """``(tenant, key)`` pairs: each key authenticates as its tenant (``--api-keys-file``)."""
    log_level: str = "info"
    max_body_bytes: int = 4 * 1024 * 1024
    max_directives: int = 64
    max_replacement_tokens: int = 4096
    max_session_tokens: int = 8192
    max_sessions: int = 64
    max_cache_bytes: int = 4 * 1024**3
    """Budget for all session caches together; idle sessions are evicted LRU past it."""
    tenant_max_sessions: int | None = None
    """Sessions one tenant may hold (its own idle ones evicted LRU past it); None: no quota."""
    tenant_max_cache_bytes: int | None = None
    """KV bytes one tenant's sessions may hold (its own idle ones evicted past it)."""
    max_new_tokens: int = 256
    """Default completion length when the request names none."""
    served_model_name: str | None = None
    max_running_jobs: int = 8
    """Model jobs (edits, prefills) started and unfinished at a time; they take turns at
    prefill chunks (``scheduler``). 1 runs them one after another."""
    max_decode_batch: int = 32
    """Generations stepped together in one batched decode forward."""
    decode_share: float = 0.0
    """Model time the running generations may take between two prefill slices, as a share
    of the two (``scheduler``); 0: one decode step per slice."""
    schedule: SchedulePolicy = "srpt"
    """Which ready job takes the model next: ``srpt`` (shortest estimated remaining work,
    with ``schedule_aging``; each turn's job carries its size) or ``las`` (least attained
    service; ``scheduler``)."""
    schedule_aging: float = 0.1
    """``srpt``: seconds taken off a waiting job's estimate per second it waits."""
    prefill_chunk: int = 512
    """Tokens a prefill runs in one forward: the slice after which other work may run."""
    worker_name: str | None = None
    """Sent as ``X-Leyline-Worker`` on every response (a worker behind a router); None: no
    header."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.decode_share < 1.0:
            raise ValueError(f"decode_share must be in [0, 1), not {self.decode_share}")
        if self.schedule not in SCHEDULE_POLICIES:
            raise ValueError(
                f"schedule must be one of {', '.join(SCHEDULE_POLICIES)}, not {self.schedule!r}"
            )
        if self.worker_name is not None:
            checked_worker_name(self.worker_name, "worker_name")
        if self.schedule_aging < 0:
            raise ValueError(f"schedule_aging must be at least 0, not {self.schedule_aging}")
        positive = {
            "port": self.port,
            "max_body_bytes": self.max_body_bytes,
            "max_directives": self.max_directives,
            "max_session_tokens": self.max_session_tokens,
            "max_sessions": self.max_sessions,
            "max_cache_bytes": self.max_cache_bytes,
            "max_new_tokens": self.max_new_tokens,
            "max_running_jobs": self.max_running_jobs,
            "max_decode_batch": self.max_decode_batch,
            "prefill_chunk": self.prefill_chunk,
        }
        quotas = {
            "tenant_max_sessions": self.tenant_max_sessions,
            "tenant_max_cache_bytes": self.tenant_max_cache_bytes,
        }
        positive.update((name, value) for name, value in quotas.items() if value is not None)
        for name, value in positive.items():
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if self.max_replacement_tokens < 0:
            raise ValueError("max_replacement_tokens must not be negative")
        if not 0 < self.port < 65536:
            raise ValueError(f"port {self.port} is not in 1..65535")

    def tenants_by_key(self) -> dict[str, str]:
        """Every accepted key and the tenant it authenticates as (empty: an open server)."""
        keys = dict((key, tenant) for tenant, key in self.api_keys)
        if self.api_key:
            keys[self.api_key] = DEFAULT_TENANT
        return keys

    @property
    def limits(self) -> Limits:
        return Limits(
            max_directives=self.max_directives,
            max_replacement_tokens=self.max_replacement_tokens,
            max_session_tokens=self.max_session_tokens,
            max_sessions=self.max_sessions,
            tenant_max_sessions=self.tenant_max_sessions,
            tenant_max_cache_bytes=self.tenant_max_cache_bytes,
        )


def load_api_keys(path: str | Path) -> tuple[tuple[str, str], ...]:
    """``TENANT KEY`` per line (``#`` comments and blank lines skipped); raises ValueError
    naming the line of a malformed entry, a bad tenant name or a key used twice."""
    pairs: list[tuple[str, str]] = []
    seen: set[str] = set()
    for number, raw in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2:
            raise ValueError(f"{path}:{number}: expected 'TENANT KEY', got {len(parts)} fields")
        tenant, key = parts
        if not _TENANT.fullmatch(tenant):
            raise ValueError(f"{path}:{number}: tenant names are 1-64 of [A-Za-z0-9_.-]")
        if len(key) < 16:
            raise ValueError(f"{path}:{number}: keys must be at least 16 characters")
        if key in seen:
            raise ValueError(f"{path}:{number}: this key is already given to a tenant")
        seen.add(key)
        pairs.append((tenant, key))
    if not pairs:
        raise ValueError(f"{path}: no 'TENANT KEY' lines")
    return tuple(pairs)
