"""The processes of ``make router-live-check`` (``router_check``): two ``leyline serve``
workers and sglang-router, each in its own process group so that a worker can be killed
as a crash and started again with the same command, and every process is stopped on exit.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from leyline.evals.serve_process import free_port, serve_command, wait_healthy

WORKER_NAMES = ("A", "B")

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
    "--worker-startup-check-interval",
    "1",
)
"""The router flags of a Leyline fleet (docs/router-design.md, "Router flags")."""

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


class Worker:
    """One ``leyline serve`` worker in its own process group, on a fixed port, so that a
    restart is the same command."""

    def __init__(self, name: str, port: int, folder: Path, options: Sequence[str]) -> None:
        self.name, self.port = name, port
        self.log = folder / f"worker-{name}.log"
        self.command = serve_command(port, ["--worker-name", name, *options])
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
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **WORKER_ENV}
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
        assert self.process is not None
        wait_healthy(self.process, self.url, self.log, timeout_s)

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
        options = ["--max-new-tokens", str(args.max_tokens), *args.worker_option]
        workers = {n: Worker(n, free_port(), folder, options) for n in WORKER_NAMES}
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
