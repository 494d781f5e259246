"""The processes of ``make router-live-check`` (``router_check``): two workers (``leyline
serve``, or SGLang servers with the plugin) and sglang-router, each in its own process group
so that a worker can be killed as a crash and started again with the same command, and
every process is stopped on exit.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from leyline.evals.serve_process import free_port, serve_command, wait_healthy
from leyline.serve.worker import WORKER_NAME_ENV

WORKER_NAMES = ("A", "B")
WORKER_KINDS = ("leyline", "sglang")
"""``leyline serve`` workers, or SGLang servers with the plugin (the router check's
``--workers``)."""

SGLANG_SCRIPT = Path("scripts/sglang/live_server.sh")
"""Starts an SGLang server with the plugin on this CPU (``run``: in the foreground)."""

SGLANG_POOL = ("--max-total-tokens", "80000", "--mem-fraction-static", "0.4")
"""An SGLang worker's KV pool: a pass's sessions and their earlier revisions fit on one
worker, so that pass 1 (one worker) is not starved of cache beside pass 2 (two). SGLang
sizes its pool from the memory free at start times the fraction, capped by the tokens;
the live suite's flags (0.1, 12,288 tokens) gave about 11k tokens here, and the LRU
evicted splice sources in pass 1 (``missing_source``)."""

ROUTER_FLAGS = (
    "--policy",
    "manual",
    "--assignment-mode",
    "min_group",
    "--disable-circuit-breaker",
    "--health-check-interval-secs",
    "1",
    "--health-failure-threshold",
    "2",
    "--health-success-threshold",
    "1",
    "--health-check-timeout-secs",
    "30",
    "--worker-startup-check-interval",
    "1",
)
"""The router flags of a Leyline fleet (docs/deploy.md). The health check's timeout is long
because a busy SGLang worker's ``/health`` runs a one-token generate behind the queue (5 s,
the default, timed out under load here and marked live workers unhealthy); a dead worker
refuses the connection at once, whatever the timeout."""

WORKER_ENV = {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
"""Two workers share the cores: one OpenMP thread each, not spinning while the other runs."""


class Clock:
    def __init__(self) -> None:
        self.t0 = time.monotonic()

    def now(self) -> float:
        return time.monotonic() - self.t0


class Say:
    """The progress lines: ``[router-check  12 s] ...``."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock

    def __call__(self, message: str) -> None:
        print(f"[router-check {self.clock.now():5.0f} s] {message}", flush=True)


def _stop_group(process: subprocess.Popen[bytes], timeout_s: float = 20) -> None:
    """TERM the process group ``process`` leads, KILL it after ``timeout_s``."""
    if process.poll() is not None:
        return
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    except ProcessLookupError:
        pass


def worker_command(
    kind: str, name: str, port: int, folder: Path, args: argparse.Namespace
) -> tuple[list[str], dict[str, str]]:
    """The command line and extra environment of worker ``name`` of ``kind``."""
    if kind == "leyline":
        options = ["--max-new-tokens", str(args.max_tokens), *args.worker_option]
        return serve_command(port, ["--worker-name", name, *options]), {}
    if kind != "sglang":
        raise ValueError(f"a worker is one of {', '.join(WORKER_KINDS)}, not {kind!r}")
    run_dir = folder / f"sglang-{name}"
    command = ["bash", str(SGLANG_SCRIPT), "run", str(run_dir), str(sglang_model_dir()), str(port)]
    flags = [*SGLANG_POOL, *args.worker_option]
    return [*command, *flags], {WORKER_NAME_ENV: name}


def sglang_model_dir() -> Path:
    """SmolLM2 as an HF directory SGLang loads, built once from the embedded weights (in a
    child process: evals do not import the SGLang plugin's package)."""
    command = [sys.executable, "-m", "leyline.sglang.live_models", "smollm2"]
    built = subprocess.run(command, capture_output=True, text=True, check=False)
    if built.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{built.stderr[-3000:]}")
    return Path(built.stdout.strip().splitlines()[-1])


class Worker:
    """One worker in its own process group, on a fixed port, so that a restart is the same
    command."""

    def __init__(
        self,
        name: str,
        port: int,
        folder: Path,
        command: Sequence[str],
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.name, self.port = name, port
        self.log = folder / f"worker-{name}.log"
        self.command = list(command)
        self.env = dict(env or {})
        self.process: subprocess.Popen[bytes] | None = None
        self.generation = 0
        """How many times it was started (the label of its answers: ``A``, then ``A#2``)."""
        self.lock = threading.Lock()
        self.stopped = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def label(self) -> str:
        return self.name if self.generation <= 1 else f"{self.name}#{self.generation}"

    def start(self) -> None:
        """Start it (again); never once :meth:`stop` ran (the restart runs in a thread)."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **WORKER_ENV, **self.env}
        with self.lock:
            if self.stopped:
                raise RuntimeError(f"worker {self.name} was stopped")
            with self.log.open("ab") as sink:
                sink.write(f"--- start {self.generation + 1}: {' '.join(self.command)}\n".encode())
                sink.flush()
                self.process = subprocess.Popen(
                    self.command,
                    stdout=sink,
                    stderr=subprocess.STDOUT,
                    env=env,
                    start_new_session=True,
                )
            self.generation += 1

    def wait_healthy(self, timeout_s: float) -> None:
        """``/health``, then the protocol's capabilities (a plugin's routes are mounted)."""
        assert self.process is not None
        paths = ("/health", "/leyline/v1/capabilities")
        wait_healthy(self.process, self.url, self.log, timeout_s, paths)

    def kill(self) -> None:
        """SIGKILL, as a crash: no shutdown, its sessions gone."""
        assert self.process is not None
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def stop(self) -> None:
        with self.lock:
            self.stopped = True
        if self.process is not None:
            _stop_group(self.process)


class Router:
    """sglang-router in its own process group (the router's venv)."""

    def __init__(self, python: Path, port: int, workers: Sequence[str], folder: Path) -> None:
        self.port = port
        self.log = folder / "router.log"
        self.command = [
            str(python),
            "-m",
            "sglang_router.launch_router",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(free_port()),
            "--worker-urls",
            *workers,
            *ROUTER_FLAGS,
        ]
        self.process: subprocess.Popen[bytes] | None = None
        self.http = httpx.Client(timeout=5)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        with self.log.open("wb") as sink:
            self.process = subprocess.Popen(
                self.command, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
            )

    def health(self) -> dict[str, bool]:
        """Each worker URL's ``is_healthy`` in the router's ``GET /workers``."""
        try:
            listed = self.http.get(f"{self.url}/workers").json().get("workers", [])
        except (httpx.HTTPError, ValueError):
            return {}
        return {w["url"]: bool(w.get("is_healthy")) for w in listed}

    def wait_until(
        self, want: Callable[[dict[str, bool]], bool], timeout_s: float, what: str
    ) -> None:
        deadline = time.monotonic() + timeout_s
        while not want(self.health()):
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"the router exited:\n{self.log.read_text()[-3000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the router did not show {what} in {timeout_s:g} s")
            time.sleep(0.25)

    def stop(self) -> None:
        self.http.close()
        if self.process is not None:
            _stop_group(self.process)


@dataclass
class Fleet:
    workers: dict[str, Worker]
    router: Router


@contextmanager
def fleet(args: argparse.Namespace, folder: Path, say: Say) -> Iterator[Fleet]:
    """Two workers and the router, up and listed healthy; every process stopped on exit."""
    with ExitStack() as stack:
        workers = {}
        for n in WORKER_NAMES:
            port = free_port()
            command, env = worker_command(args.workers, n, port, folder, args)
            workers[n] = Worker(n, port, folder, command, env)
        for w in workers.values():
            stack.callback(w.stop)
            w.start()
        t0 = time.monotonic()
        for w in workers.values():
            w.wait_healthy(args.start_timeout)
        say(f"    workers up in {time.monotonic() - t0:.1f} s: " + _urls(workers))
        router = Router(args.router_python, free_port(), [w.url for w in workers.values()], folder)
        stack.callback(router.stop)
        t0 = time.monotonic()
        router.start()
        urls = {w.url for w in workers.values()}
        router.wait_until(
            lambda h: all(h.get(u) for u in urls), args.start_timeout, "both workers healthy"
        )
        took = time.monotonic() - t0
        say(f"    router {router.url} lists both workers healthy after {took:.1f} s")
        yield Fleet(workers, router)


def _urls(workers: Mapping[str, Worker]) -> str:
    return ", ".join(f"{n} {w.url} (pid {w.pid})" for n, w in workers.items())
