"""``/health`` latency while the server renders a very long chat (1,600 one-word messages).

Rendering runs on a thread, so the event loop should keep answering; a poller measures
it on its own connection for as long as the long requests run (and a baseline first).
The long chat is refused after rendering (its tokens pass the session limit), which is
fine: the render is the load being measured.
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any

import httpx

from .wire import auth_headers

POLL_GAP_S = 0.005


def _poll(
    base_url: str,
    stop: threading.Event,
    out: list[float],
    at_least: int = 0,
    ready: threading.Event | None = None,
) -> None:
    with httpx.Client(base_url=base_url, timeout=30) as http:
        http.get("/health").raise_for_status()  # connected before the clock starts
        if ready is not None:
            ready.set()
        while not stop.is_set() or len(out) < at_least:
            t0 = time.perf_counter()
            http.get("/health").raise_for_status()
            out.append((time.perf_counter() - t0) * 1000)
            time.sleep(POLL_GAP_S)


def health_under_render(
    base_url: str, key: str | None, messages: int, renders: int
) -> dict[str, Any]:
    idle: list[float] = []
    never = threading.Event()
    never.set()
    _poll(base_url, never, idle, at_least=50)
    chat = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"w{i}"}
        for i in range(messages - 1)
    ] + [{"role": "user", "content": "Reply with one word."}]
    body = {"messages": chat, "max_tokens": 1, "temperature": 0}
    busy: list[float] = []
    stop, ready = threading.Event(), threading.Event()
    poller = threading.Thread(target=_poll, args=(base_url, stop, busy, 0, ready))
    answers: list[dict[str, Any]] = []
    headers = auth_headers(key)
    with httpx.Client(base_url=base_url, headers=headers, timeout=600) as http:
        http.get("/v1/models").raise_for_status()  # this connection is open too
        poller.start()
        ready.wait(timeout=60)
        try:
            for _ in range(renders):
                t0 = time.perf_counter()
                reply = http.post("/v1/chat/completions", json=body)
                code = (
                    reply.json().get("error", {}).get("code") if reply.status_code >= 400 else None
                )
                answers.append(
                    {"status": reply.status_code, "code": code, "seconds": time.perf_counter() - t0}
                )
        finally:
            stop.set()
            poller.join()
    return {
        "messages": messages,
        "renders": answers,
        "idle_ms": _percentiles(idle),
        "busy_ms": _percentiles(busy),
    }


def _percentiles(samples: list[float]) -> dict[str, Any]:
    if not samples:
        return {"samples": 0, "p50": None, "p99": None, "max": None}
    ordered = sorted(samples)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {
        "samples": len(ordered),
        "p50": statistics.median(ordered),
        "p99": p99,
        "max": ordered[-1],
    }
