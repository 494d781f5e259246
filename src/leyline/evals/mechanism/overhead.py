"""HTTP + protocol overhead: the same work over HTTP and in-process, on the embedded server."""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any

import httpx

from leyline.engine.session import SessionCache
from leyline.evals.common import progress
from leyline.protocol.resources import Routes

from .trajectories import demo_trajectory


@dataclass
class Overhead:
    http_ms: list[float] = field(default_factory=list)
    inproc_ms: list[float] = field(default_factory=list)

    def summary(self) -> dict[str, float]:
        http, inproc = statistics.median(self.http_ms), statistics.median(self.inproc_ms)
        paired = [h - i for h, i in zip(self.http_ms, self.inproc_ms, strict=True)]
        return {
            "http_p50_ms": http,
            "inproc_p50_ms": inproc,
            "overhead_p50_ms": statistics.median(paired),
        }


def _ms(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def measure_overhead(
    app: Any, base_url: str, reps: int, run_id: str, *, show_progress: bool = True
) -> dict[str, Any]:
    """Same work over HTTP and in-process, alternated rep by rep (paired differences).

    In-process = the call the route makes, submitted to the server's model worker through
    ``EngineBackend.run`` (same thread, same queue hop), without HTTP, JSON or pydantic.
    Nothing else is in flight.
    """
    from leyline.core.openai_types import ChatCompletionRequest
    from leyline.core.sessions import DEFAULT_TENANT

    service = app.state.service
    loop = asyncio.new_event_loop()

    def on_worker(fn: Callable[[], object]) -> Callable[[], object]:
        return lambda: loop.run_until_complete(service.backend.run(fn))

    trajectory = demo_trajectory()
    messages = trajectory.opening() + [m for t in range(1, 5) for m in trajectory.turn(t)]
    tool_specs = trajectory.tool_specs()
    session = f"{run_id}-ovh"
    body = {
        "model": "smollm2",
        "messages": messages,
        "tools": tool_specs,
        "max_tokens": 1,
        "temperature": 0,
        "leyline": {"session": session},
    }
    request = ChatCompletionRequest.model_validate(body)
    renderer = service.backend.renderer.chat_renderer()
    render = partial(renderer.render, request.messages, request.tools, add_generation_prompt=True)
    tok_body = {"messages": messages, "tools": tool_specs}
    info_url = Routes.session.format(session=session)
    pairs: dict[str, tuple[Callable[[], object], Callable[[], object]]] = {}
    results: dict[str, Overhead] = {}
    with httpx.Client(base_url=base_url.removesuffix("/v1"), timeout=300) as http:
        http.post("/v1/chat/completions", json=body).raise_for_status()  # warm the session
        pairs = {
            "session_info": (
                partial(http.get, info_url),
                lambda: service.session_info(service.sessions.get(DEFAULT_TENANT, session)),
            ),
            "tokenize": (partial(http.post, Routes.tokenize, json=tok_body), on_worker(render)),
            "chat_max_tokens_1": (
                partial(http.post, "/v1/chat/completions", json=body),
                lambda: loop.run_until_complete(service.chat(request)),
            ),
        }
        results = {name: Overhead() for name in [*pairs, "splice_directive"]}
        for _ in progress(range(reps), desc="overhead", enabled=show_progress):
            for name, (over_http, in_process) in pairs.items():
                results[name].http_ms.append(_ms(over_http))
                results[name].inproc_ms.append(_ms(in_process))
        tokens = list(render().tokens)
        splice = _splice_pair(http, service, tokens, run_id, on_worker)
        # Fewer reps: each one first prefills a fresh session over HTTP (not timed).
        for i in progress(range(max(1, reps // 3)), desc="overhead splice", enabled=show_progress):
            splice(i, results["splice_directive"])
        http.delete(info_url)
    loop.close()
    return {
        "what": {
            "session_info": "GET /leyline/v1/sessions/ID vs LeylineService.session_info "
            "(no model work: the bare HTTP + JSON cost)",
            "tokenize": "POST /leyline/v1/tokenize (messages + tools) vs ChatRenderer.render",
            "chat_max_tokens_1": "POST /v1/chat/completions (warm session, same messages, "
            "1 token) vs LeylineService.chat on the same parsed request",
            "splice_directive": "POST .../directives (one splice, no generation) vs "
            "SessionCache.apply_directives on a fork of an identical session",
        },
        "prompt_tokens": len(tokens),
        **{name: o.summary() | asdict(o) for name, o in results.items()},
    }


def _splice_pair(
    http: httpx.Client,
    service: Any,
    tokens: list[int],
    run_id: str,
    on_worker: Callable[[Callable[[], object]], Callable[[], object]],
) -> Callable[[int, Overhead], None]:
    """One rep: a ~1/4-context span replaced by a stub, on two sessions of the same tokens."""
    from leyline.protocol import SpliceDirective

    n = len(tokens)
    span = {"start": n // 3, "end": n // 3 + n // 4}
    directive = {"verb": "splice", "span": span, "replacement": "[evicted: tool output]"}
    batch = [SpliceDirective.model_validate(directive)]
    base = SessionCache(service.backend.engine)
    base.prefill(tokens)

    def rep(i: int, out: Overhead) -> None:
        sid = f"{run_id}-ovh-http-{i}"
        info = http.post(Routes.sessions, json={"session": sid, "tokens": tokens}).json()
        apply = {"base_revision": info["revision"], "directives": [directive]}
        out.http_ms.append(
            _ms(partial(http.post, Routes.directives.format(session=sid), json=apply))
        )
        http.delete(Routes.session.format(session=sid))
        fork = base.fork()
        work = partial(fork.apply_directives, batch, base_revision=fork.revision)
        out.inproc_ms.append(_ms(on_worker(work)))
        fork.release()

    return rep
