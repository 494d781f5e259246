"""`leyline serve` in this process: the real app (model, engine, HTTP) on a loopback port.

Uvicorn runs in a daemon thread; requests go over real HTTP on 127.0.0.1, so a client
cannot tell it from a `leyline serve` started elsewhere.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import uvicorn

from leyline.engine.work_estimates import SchedulePolicy
from leyline.evals.serve_process import free_port
from leyline.serve.serve import build_app
from leyline.serve.settings import ServerSettings


class EmbeddedServer:
    """``with EmbeddedServer() as server: ... server.base_url ...``

    Args:
        model: what ``leyline serve --model`` takes ('smollm2' is the embedded SmolLM2).
        prefix_cache_bytes: the shared prefix cache; 0 (default here) turns it off, so each
            session reuses only its own cache (the demo's arms then cannot help each other).
        max_new_tokens: completion length when a request names none.
        max_running_jobs, max_decode_batch, decode_share, schedule: the model scheduler's
            (``leyline serve``'s ``--max-running-jobs``, ``--max-decode-batch``,
            ``--decode-share``, ``--schedule``; None: the server's defaults).
    """

    def __init__(
        self,
        model: str = "smollm2",
        *,
        prefix_cache_bytes: int = 0,
        max_new_tokens: int = 64,
        startup_timeout_s: float = 120.0,
        max_running_jobs: int | None = None,
        max_decode_batch: int | None = None,
        decode_share: float | None = None,
        schedule: SchedulePolicy | None = None,
    ) -> None:
        self.port = free_port()
        scheduling: dict[str, Any] = {}
        if max_running_jobs is not None:
            scheduling["max_running_jobs"] = max_running_jobs
        if max_decode_batch is not None:
            scheduling["max_decode_batch"] = max_decode_batch
        if decode_share is not None:
            scheduling["decode_share"] = decode_share
        if schedule is not None:
            scheduling["schedule"] = schedule
        settings = ServerSettings(
            model=model,
            port=self.port,
            log_level="warning",
            max_new_tokens=max_new_tokens,
            **scheduling,
        )
        t0 = time.perf_counter()
        self.app = build_app(settings, prefix_cache_bytes=prefix_cache_bytes)
        self.load_s = time.perf_counter() - t0
        self.label: str = self.app.state.engine.loaded.label
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="leyline-serve", daemon=True)
        self._timeout = startup_timeout_s

    @property
    def base_url(self) -> str:
        """The OpenAI base URL (``.../v1``)."""
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> EmbeddedServer:
        self._thread.start()
        deadline = time.monotonic() + self._timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the embedded server did not start on port {self.port}")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)

    def __enter__(self) -> EmbeddedServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
