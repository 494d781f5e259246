"""The reference engine's model scheduler: every job and decode step, one at a time, fairly.

A CPU runs one forward at a time well, so model work is serialised and only its order
changes with concurrent clients: decode steps of all running generations are batched into
one forward, jobs (edits, prefills) are sliced at prefill chunks so a short splice waits
for a chunk rather than a whole prefill, the next slice goes by ``policy`` (``las`` least
attained service, ``srpt`` shortest estimated work left, with ``aging``), and jobs that
purge the prefix cache (FORGET) run alone. The rules and their measured effects are in
docs/server.md ("Concurrency and cancellation").
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from leyline.core.turns import GenerationResult
from leyline.engine.batched_decode import Row
from leyline.engine.work_estimates import SCHEDULE_POLICIES, SchedulePolicy, WorkRates
from leyline.engine.yield_points import pausing_with

if TYPE_CHECKING:
    from leyline.engine.engine import Engine
    from leyline.engine.session import PendingGeneration

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class JobTiming:
    """Where a job's wall time went (seconds)."""

    queued: float
    """Waiting for the model: before its first slice and between its slices."""
    service: float
    """Holding the model."""


@dataclass(eq=False)
class _Job(Generic[T]):
    fn: Callable[[], T]
    exclusive: bool
    cost: int | None = None
    """Tokens it runs through the model (``srpt``'s size); None: unknown."""
    future: Future[T] = field(default_factory=Future)
    go: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.perf_counter)
    service: float = 0.0
    slice_start: float = 0.0
    ready_since: float = 0.0
    """When it last became ready for a slice (``srpt``'s aging)."""


@dataclass(eq=False)
class _Generation:
    pending: PendingGeneration
    future: Future[GenerationResult] = field(default_factory=Future)


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """Counters since start (``/metrics``)."""

    jobs: int
    slices: int
    decode_steps: int
    decoded_rows: int
    """Tokens decoded in batched steps: ``decoded_rows / decode_steps`` is the mean batch."""
    max_batch: int
    seconds_per_token: float = 0.0
    """The learned model time per job token (``srpt``'s rate, ``work_estimates``)."""
    seconds_per_decode_step: float = 0.0
    """The learned time of one batched decode step."""


class ModelScheduler:
    """Runs model jobs and decode steps of one engine (module docstring)."""

    def __init__(
        self,
        engine: Engine,
        *,
        max_jobs: int = 8,
        max_batch: int = 32,
        decode_share: float = 0.0,
        policy: SchedulePolicy = "las",
        aging: float = 0.1,
    ) -> None:
        if max_jobs < 1 or max_batch < 1:
            raise ValueError("max_jobs and max_batch must be at least 1")
        if not 0.0 <= decode_share < 1.0:
            raise ValueError("decode_share must be in [0, 1)")
        if policy not in SCHEDULE_POLICIES:
            names = ", ".join(SCHEDULE_POLICIES)
            raise ValueError(f"policy must be one of {names}, not {policy!r}")
        if aging < 0:
            raise ValueError("aging must be at least 0")
        self.engine, self.max_jobs, self.max_batch = engine, max_jobs, max_batch
        self.decode_share, self.policy, self.aging = decode_share, policy, aging
        self.rates = WorkRates()
        """Seconds per job token and per decode step, learned as work finishes (``srpt``)."""
        self._last_slice_s = 0.0  # the scheduler thread's own: the last slice's duration
        self._cv = threading.Condition()
        self._waiting: deque[_Job[Any]] = deque()  # submitted, not started
        self._ready: deque[_Job[Any]] = deque()  # started, waiting for their next slice
        self._in_flight = 0  # started and unfinished
        self._exclusive_running = False
        self._generations: deque[_Generation] = deque()
        self._holder: _Job[Any] | None = None
        self._stopped = False
        self._counts = {"jobs": 0, "slices": 0, "decode_steps": 0, "decoded_rows": 0, "max": 0}
        self._timings: weakref.WeakKeyDictionary[Future[Any], JobTiming] = (
            weakref.WeakKeyDictionary()
        )
        self._thread = threading.Thread(target=self._loop, name="leyline-scheduler", daemon=True)
        self._thread.start()

    # -- the API ---------------------------------------------------------------------------

    def submit(
        self, fn: Callable[[], T], *, exclusive: bool = False, cost: int | None = None
    ) -> Future[T]:
        """Run ``fn`` as a job; its future carries the result (or the exception). ``cost``:
        the tokens it runs through the model, if known (the ``srpt`` policy's size)."""
        if cost is not None and cost < 0:
            raise ValueError(f"a job's cost is a token count, not {cost}")
        job: _Job[T] = _Job(fn, exclusive, cost)
        self._enqueue(self._waiting, job)
        return job.future

    def timing(self, future: Future[Any]) -> JobTiming | None:
        """Where a finished job's time went (None for a future it did not make)."""
        return self._timings.get(future)

    def generate(self, pending: PendingGeneration) -> Future[GenerationResult]:
        """Step ``pending``'s decoder with the running generations until it ends, then
        commit it (``SessionCache.finish_generation``)."""
        generation = _Generation(pending)
        self._enqueue(self._generations, generation)
        return generation.future

    def _enqueue(self, queue: deque[Any], item: object) -> None:
        with self._cv:
            if self._stopped:
                raise RuntimeError("the model scheduler is shut down")
            queue.append(item)
            self._cv.notify_all()

    def stats(self) -> SchedulerStats:
        c = self._counts
        return SchedulerStats(
            c["jobs"],
            c["slices"],
            c["decode_steps"],
            c["decoded_rows"],
            c["max"],
            self.rates.token_s,
            self.rates.step_s,
        )

    def shutdown(self) -> None:
        """Stop taking work; cancel what has not started; running jobs finish."""
        with self._cv:
            self._stopped = True
            for job in self._waiting:
                job.future.cancel()
            self._waiting.clear()
            for gen in self._generations:
                gen.future.set_exception(RuntimeError("the model scheduler is shut down"))
            self._generations.clear()
            self._cv.notify_all()

    # -- the scheduler thread --------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cv:
                self._admit()
                while not self._stopped and not self._ready and not self._generations:
                    self._cv.wait()
                    self._admit()
                if self._stopped and not self._ready and self._in_flight == 0:
                    return
                job = self._next_ready()
            if self._generations:
                self._decode_steps(job)
            if job is not None:
                t0 = time.perf_counter()
                self._run_slice(job)
                self._last_slice_s = time.perf_counter() - t0

    def _decode_steps(self, job: _Job[Any] | None) -> None:
        """One decode step, then more while generations run and their time since the last
        slice stays under ``decode_share`` of the two together, or (``srpt``) while the
        generation nearest its end has less left than ``job`` (module docstring)."""
        share = self.decode_share
        budget = self._last_slice_s * share / (1.0 - share)
        self._last_slice_s = 0.0
        job_left = self._left(job, time.perf_counter()) if job is not None else 0.0
        t0 = time.perf_counter()
        self._decode_step()
        while self._generations and (
            time.perf_counter() - t0 < budget
            or (self.policy == "srpt" and self._shortest_generation_left() < job_left)
        ):
            self._decode_step()

    def _shortest_generation_left(self) -> float:
        with self._cv:
            tokens = min(g.pending.decoder.tokens_left for g in self._generations)
        return self.rates.generation_left(tokens)

    def _left(self, job: _Job[Any], now: float) -> float:
        """``srpt``'s key: the job's estimated model time left, less its aging credit."""
        left = self.rates.job_left(job.cost, job.service, self.engine.prefill_chunk)
        return left - self.aging * (now - job.ready_since)

    def _next_ready(self) -> _Job[Any] | None:
        """The ready job with the least estimated work left (``srpt``), or the one that has
        held the model least so far (``las``: a job's remaining work is unknown, but a short
        one has little attained when it arrives, so it runs before long ones in progress; a
        long one still gets every slice the short ones leave); oldest first among equals.
        Lock held."""
        if not self._ready:
            return None
        if self.policy == "srpt":
            now = time.perf_counter()
            job = min(self._ready, key=lambda j: (self._left(j, now), j.submitted))
        else:
            job = min(self._ready, key=lambda j: (j.service, j.submitted))
        self._ready.remove(job)
        return job

    def _admit(self) -> None:
        """Start waiting jobs in arrival order while the rules allow (lock held)."""
        while self._waiting and not self._exclusive_running:
            job = self._waiting[0]
            if job.exclusive:
                if self._in_flight or self._generations:
                    return  # runs alone: wait for the others to drain
                self._exclusive_running = True
            elif self._in_flight >= self.max_jobs:
                return
            self._waiting.popleft()
            self._in_flight += 1
            self._counts["jobs"] += 1
            job.ready_since = time.perf_counter()
            self._ready.append(job)
            threading.Thread(target=self._job_thread, args=(job,), daemon=True).start()

    def _run_slice(self, job: _Job[Any]) -> None:
        """Hand the model to ``job`` until it pauses or ends."""
        with self._cv:
            self._holder = job
            self._counts["slices"] += 1
            job.go.set()
            while self._holder is job:
                self._cv.wait()

    def _release(self, job: _Job[Any], *, again: bool) -> None:
        """The job hands the model back (at a pause, ``again``; or at its end)."""
        job.service += time.perf_counter() - job.slice_start
        with self._cv:
            job.go.clear()
            if again:
                job.ready_since = time.perf_counter()
                self._ready.append(job)
            else:
                self._in_flight -= 1
                if job.exclusive:
                    self._exclusive_running = False
            self._holder = None
            self._cv.notify_all()

    # -- a job's own thread ------------------------------------------------------------------

    def _job_thread(self, job: _Job[Any]) -> None:
        job.go.wait()
        job.slice_start = time.perf_counter()

        def pause() -> None:
            self._release(job, again=True)
            job.go.wait()
            job.slice_start = time.perf_counter()

        result: Any = None
        error: BaseException | None = None
        try:
            with pausing_with(pause):
                result = job.fn()
        except BaseException as exc:  # handed to the awaiting request, never lost
            error = exc
        self._release(job, again=False)
        if error is None:
            self.rates.learn_job(job.cost, job.service)
        wall = time.perf_counter() - job.submitted
        self._timings[job.future] = JobTiming(wall - job.service, job.service)
        if error is not None:
            job.future.set_exception(error)
        else:
            job.future.set_result(result)

    # -- decode steps -------------------------------------------------------------------------

    def _decode_step(self) -> None:
        """One token for every running generation (at most ``max_batch``, oldest first; the
        rest rotate in on later steps)."""
        with self._cv:
            batch = [
                self._generations.popleft()
                for _ in range(min(self.max_batch, len(self._generations)))
            ]
        live: list[_Generation] = []
        for gen in batch:
            try:
                going = gen.pending.decoder.choose()
            except BaseException as exc:
                gen.future.set_exception(exc)
                continue
            if going:
                live.append(gen)
            else:
                self._finish(gen)
        if live:
            t0 = time.perf_counter()
            rows = [
                Row(g.pending.decoder.buffers, g.pending.decoder.length, g.pending.decoder.pending)
                for g in live
            ]
            try:
                logits = self.engine.forward_rows(rows)
            except BaseException as exc:
                for gen in live:
                    gen.future.set_exception(exc)
                live = []
            else:
                for gen, row_logits in zip(live, logits, strict=True):
                    gen.pending.decoder.advance(row_logits)
                self.rates.learn_step(time.perf_counter() - t0)
            self._counts["decode_steps"] += 1
            self._counts["decoded_rows"] += len(rows)
            self._counts["max"] = max(self._counts["max"], len(rows))
        with self._cv:
            self._generations.extend(live)
            self._cv.notify_all()  # an exclusive job may be waiting for these to drain

    def _finish(self, gen: _Generation) -> None:
        try:
            result = gen.pending.session.finish_generation(gen.pending)
        except BaseException as exc:
            gen.future.set_exception(exc)
        else:
            gen.future.set_result(result)
