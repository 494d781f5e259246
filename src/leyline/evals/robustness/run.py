"""``leyline eval robustness``: a server with two tenants (started here, or any live backend
at ``--base-url``), the checks that apply to it, a report."""

from __future__ import annotations

import importlib.util
import os
import random
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

import httpx

from leyline.evals.common import Report, progress, results_dir

from .checks import Checker, owns_every_route, summarize
from .cli import CHECKS
from .fuzz import Fuzzer, Limits
from .health import health_under_render
from .isolation import ExactReference, Server, cross_salt, cross_session
from .leaks import Client, cross_tenant, redaction
from .races import lost_updates
from .report import fill, targets, text
from .server import ServerLimits, serve
from .source import RandomSource
from .wire import Wire, auth_headers

EXTERNAL_BODY_BYTES = ServerLimits().max_body_bytes
"""The body limit the fuzz assumes at --base-url (capabilities do not list one)."""
EXTERNAL_SESSION_TOKENS = 8192
"""The session limit the fuzz assumes at --base-url when capabilities say none."""


@dataclass(frozen=True, slots=True)
class Options:
    mode: str = "default"
    """``fast`` (CI), ``default`` or ``full`` (the issue's targets); sizes below."""
    requests: int = 2000
    clients: int = 8
    turns: int = 20
    trials: int = 3
    renders: int = 3
    scenarios: int = 6
    """Cross-session scenarios (and cross-salt trials)."""
    messages: int = 1600
    prompt_tokens: int = 300
    """About how long a cross-session prompt is."""
    seed: int = 0
    model: str = "smollm2"
    out: Path | None = None
    progress: bool = True
    base_url: str | None = None
    """A live server to check (no server is started); None: start ``leyline serve``."""
    api_key: str | None = None
    api_key_b: str | None = None
    """A second tenant's key at --base-url (cross-tenant runs only with it)."""
    model_dir: Path | None = None
    """A HF model directory of the served model: the exact reference of ``cross_session``."""
    checks: tuple[str, ...] = ()
    """Only these checks (none: every one that applies)."""


@dataclass(slots=True)
class Target:
    """The server under test, as the checks see it."""

    base_url: str
    key: str | None
    key_b: str | None
    capabilities: dict[str, Any]
    limits: Limits
    description: str
    log: Path | None = None
    config: dict[str, Any] = field(default_factory=dict)
    every_route: bool = True
    """False: Leyline is hosted beside the server's own routes (SGLang; ``checks``)."""


def run_robustness(options: Options, out: TextIO | None = None) -> dict[str, Any]:
    out = out or sys.stdout
    folder = results_dir("robustness", options.out)
    t0 = time.perf_counter()
    with _target(options, folder, out) as target:
        print(f"Checking {target.description} ...", file=out)
        _warm(target.base_url, target.key)
        phases = _phases(target, options, out)
        internal = None
        if target.log is not None:
            internal = target.log.read_text(errors="replace").count("internal error on")
    wall = time.perf_counter() - t0
    command = "leyline eval robustness" + (
        "" if options.mode == "default" else f" --{options.mode}"
    )
    if options.base_url:
        command += f" --base-url {options.base_url}"
    config = {
        "command": command,
        **{
            k: str(v) if isinstance(v, Path) else v
            for k, v in asdict(options).items()
            if k not in ("out", "progress", "api_key", "api_key_b")
        },
        "server": target.config,
        "capabilities": target.capabilities,
    }
    report = Report("robustness", "leyline eval robustness", config, folder)
    report.data = {
        "wall_s": wall,
        "machine": {"cpus": os.cpu_count(), "loadavg_after": os.getloadavg()},
        "server": target.description,
        "internal_errors_logged": internal,
        "targets": targets(phases, options.mode),
        **phases,
    }
    fill(report, report.data)
    written = report.write()
    print(text(report.data), file=out)
    print(f"\n{wall:.0f} s wall -> {', '.join(str(p) for p in written)}", file=out)
    return report.data


@contextmanager
def _target(options: Options, folder: Path, out: TextIO) -> Iterator[Target]:
    if options.base_url is not None:
        base = options.base_url.rstrip("/")
        caps = _capabilities(base, options.api_key)
        limits = caps.get("limits") or {}
        fuzz_limits = Limits(
            limits.get("max_directives") or 64,
            limits.get("max_replacement_tokens") or 4096,
            EXTERNAL_BODY_BYTES,
            limits.get("max_session_tokens") or EXTERNAL_SESSION_TOKENS,
        )
        keys = 1 + (options.api_key_b is not None)
        every_route = owns_every_route(base)
        config = {
            "base_url": base,
            "api_keys": keys,
            "fuzz_limits": asdict(fuzz_limits),
            "owns_every_route": every_route,
        }
        yield Target(
            base, options.api_key, options.api_key_b, caps, fuzz_limits,
            f"the live server at {base} ({', '.join(caps.get('models') or ['?'])})", None, config,
            every_route,
        )  # fmt: skip
        return
    server_limits = ServerLimits()
    print(f"Starting leyline serve ({options.model}, CPU, two tenants) ...", file=out)
    with serve(folder, server_limits, options.model) as served:
        alpha, bravo = served.keys["alpha"], served.keys["bravo"]
        fuzz_limits = Limits(
            server_limits.max_directives,
            server_limits.max_replacement_tokens,
            server_limits.max_body_bytes,
            server_limits.max_session_tokens,
        )
        config = asdict(server_limits) | {"tenants": 2, "prefix_cache": "1 GiB (default)"}
        yield Target(
            served.base_url, alpha, bravo, _capabilities(served.base_url, alpha), fuzz_limits,
            f"leyline serve ({options.model}, started here)", served.log, config,
        )  # fmt: skip


def _capabilities(base_url: str, key: str | None) -> dict[str, Any]:
    reply = httpx.get(f"{base_url}/leyline/v1/capabilities", headers=auth_headers(key), timeout=60)
    if reply.status_code != 200:
        raise RuntimeError(
            f"GET {base_url}/leyline/v1/capabilities answered {reply.status_code}: "
            f"{reply.text[:300]} (not a Leyline server, or a key is needed: --api-key)"
        )
    return dict(reply.json())


def _phases(target: Target, options: Options, out: TextIO) -> dict[str, Any]:
    """Every check, or ``{"n/a": why}`` where it does not apply to this server."""
    caps = target.capabilities
    verbs = set(caps.get("verbs") or ())
    # Kept short: cross-tenant's prompts of one trial share "Case <stamp>-<trial>-"; a
    # longer stamp fills a 16-token block that tenant B's own earlier prompt then serves.
    stamp = time.strftime("rb%H%M%S")
    why: dict[str, str | None] = dict.fromkeys(CHECKS)
    if "forget" not in verbs:
        why["redaction"] = "no forget among the capabilities' verbs"
    if not {"splice", "forget"} <= verbs:
        why["cross_session"] = "no splice and forget among the capabilities' verbs"
    if target.key_b is None:
        why["cross_tenant"] = "one API key (a second tenant's: --api-key-b)"
    elif not caps.get("tenants"):
        why["cross_tenant"] = "capabilities.tenants is false (every client is one tenant)"
    if not caps.get("cache_salt"):
        why["cross_salt"] = "capabilities.cache_salt is false"
    if not target.every_route:
        why["health"] = "/health is the host server's own route, not Leyline's"
    elif (status := _health_status(target.base_url)) != 200:
        why["health"] = f"GET /health answered {status or 'nothing'}"
    for check in CHECKS:
        if options.checks and check not in options.checks:
            why[check] = "not asked for (--checks)"
    phases: dict[str, Any] = {c: {"n/a": reason} for c, reason in why.items() if reason}
    if why["fuzz"] is None:
        phases["fuzz"] = _fuzz(
            target.base_url, target.key, target.limits, options, target.every_route
        )
    if why["lost_updates"] is None:
        with _bar(options.clients * options.turns, "lost-update writes", options.progress) as tick:
            phases["lost_updates"] = lost_updates(
                target.base_url, target.key, options.clients, options.turns, tick, stamp
            )
    redact, crossed = why["redaction"] is None, why["cross_tenant"] is None
    if redact or crossed:
        redacted, tenants = _leaks(target, stamp, options, redact, crossed)
        if redact:
            phases["redaction"] = redacted
        if crossed:
            phases["cross_tenant"] = tenants
    if why["cross_session"] is None:
        phases["cross_session"] = _cross_session(target, stamp, options, out)
    if why["cross_salt"] is None:
        phases["cross_salt"] = _cross_salt(target, stamp, options)
    if why["health"] is None:
        print("Measuring /health while long chats render ...", file=out)
        phases["health"] = health_under_render(
            target.base_url, target.key, options.messages, options.renders
        )
    return {c: phases[c] for c in CHECKS}


def _fuzz(
    base_url: str, key: str | None, limits: Limits, options: Options, every_route: bool
) -> dict[str, Any]:
    wire = Wire(base_url, key)
    checker = Checker(wire, every_route=every_route)
    fuzzer = Fuzzer(RandomSource(options.seed), limits)
    t0 = time.perf_counter()
    for _ in progress(range(options.requests), desc="fuzz requests", enabled=options.progress):
        checker.step(fuzzer)
    seconds = time.perf_counter() - t0
    checker.sweep()
    checker.cleanup()
    wire.close()
    return summarize(checker.tally, seconds)


def _leaks(
    target: Target, stamp: str, options: Options, redact: bool, crossed: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    a = Client(target.base_url, target.key)
    b = Client(target.base_url, target.key_b) if crossed else None
    redacted: list[dict[str, Any]] = []
    tenants: list[dict[str, Any]] = []
    try:
        trials = progress(range(options.trials), desc="leak trials", enabled=options.progress)
        for trial in trials:
            if redact:
                redacted += redaction(a, trial, stamp)
            if b is not None:
                tenants += cross_tenant(a, b, trial, stamp)
    finally:
        a.close()
        if b is not None:
            b.close()
    return redacted, tenants


def _cross_session(
    target: Target, stamp: str, options: Options, out: TextIO
) -> list[dict[str, Any]]:
    reference = None
    if options.model_dir is not None:
        print(f"Loading the exact reference from {options.model_dir} ...", file=out)
        reference = ExactReference(options.model_dir)
    server = Server(target.base_url, target.key)
    rng = random.Random(random.SystemRandom().getrandbits(64))  # nonces: new every run
    rows = []
    try:
        scenarios = progress(
            range(options.scenarios), desc="cross-session", enabled=options.progress
        )
        for scenario in scenarios:
            salt = bool(target.capabilities.get("cache_salt"))
            row = cross_session(
                server, scenario, stamp, options.prompt_tokens, reference, salt, rng
            )
            rows.append(row)
    finally:
        server.close()
    return rows


def _cross_salt(target: Target, stamp: str, options: Options) -> list[dict[str, Any]]:
    server = Server(target.base_url, target.key)
    rng = random.Random(random.SystemRandom().getrandbits(64))
    try:
        return [row for t in range(options.scenarios) for row in cross_salt(server, t, stamp, rng)]
    finally:
        server.close()


def _health_status(base_url: str) -> int | None:
    try:
        return httpx.get(f"{base_url}/health", timeout=30).status_code
    except httpx.TransportError:
        return None


def _warm(base_url: str, key: str | None) -> None:
    """One request first: the first forward pass pays one-time setup costs."""
    body = {"prompt": "Hello", "max_tokens": 1}
    httpx.post(f"{base_url}/v1/completions", json=body, headers=auth_headers(key), timeout=300)


@contextmanager
def _bar(total: int, desc: str, enabled: bool) -> Iterator[Callable[[], None]]:
    if not enabled or importlib.util.find_spec("tqdm") is None:
        yield lambda: None
        return
    from tqdm import tqdm

    with tqdm(total=total, desc=desc, dynamic_ncols=True, leave=False) as bar:
        yield lambda: bar.update(1)
