"""The model scheduler: batched generations equal sequential ones, jobs are sliced at prefill
chunks (a short job overtakes a long one), FORGET-like exclusive jobs run alone, errors reach
their request and the scheduler keeps serving."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from leyline.core.turns import SamplingParams
from leyline.engine.engine import Engine
from leyline.engine.models import build_tiny_mla
from leyline.engine.scheduler import ModelScheduler
from leyline.engine.session import PendingGeneration, SessionCache
from leyline.engine.yield_points import chunk_boundary

from ._helpers import random_tokens, tiny_llama

GREEDY = SamplingParams(max_new_tokens=10, stop_token_ids=(-1,))


@pytest.fixture(scope="module", params=["llama", "mla-v3"])
def engine(request: pytest.FixtureRequest) -> Engine:
    loaded = tiny_llama() if request.param == "llama" else build_tiny_mla("v3")
    return Engine(loaded, prefill_chunk=32)


@pytest.fixture
def scheduler(engine: Engine) -> Iterator[ModelScheduler]:
    s = ModelScheduler(engine)
    yield s
    s.shutdown()


def _prompts(engine: Engine) -> list[list[int]]:
    return [random_tokens(n, engine.vocab_size, seed=n) for n in (5, 150, 37, 90, 12)]


def test_concurrent_generations_equal_sequential_ones(
    engine: Engine, scheduler: ModelScheduler
) -> None:
    prompts = _prompts(engine)
    expected = []
    for prompt in prompts:
        alone = SessionCache(engine)
        alone.prefill(prompt)
        expected.append(alone.generate(GREEDY).tokens)

    sessions = [SessionCache(engine) for _ in prompts]

    def begin(session: SessionCache, prompt: list[int]) -> PendingGeneration:
        session.prefill(prompt)
        return session.begin_generation(GREEDY)

    pairs = zip(sessions, prompts, strict=True)
    jobs = [scheduler.submit(lambda s=s, p=p: begin(s, p)) for s, p in pairs]
    generations = [scheduler.generate(job.result(timeout=60)) for job in jobs]
    results = [g.result(timeout=60) for g in generations]
    assert [r.tokens for r in results] == expected
    for session, prompt, result in zip(sessions, prompts, results, strict=True):
        assert session.tokens == tuple(prompt) + result.tokens  # committed, as generate does
    stats = scheduler.stats()
    assert stats.max_batch >= 2  # the steps were batched, not one row at a time
    assert stats.decoded_rows > stats.decode_steps


def test_a_short_job_overtakes_a_long_one_at_a_chunk_boundary(scheduler: ModelScheduler) -> None:
    started = threading.Event()
    short: list[object] = []

    def long_job() -> int:
        started.set()
        for i in range(10_000):
            chunk_boundary()  # as a prefill does between two chunks
            if short and short[0].done():  # type: ignore[attr-defined]
                return i
        return -1

    long = scheduler.submit(long_job)
    assert started.wait(30)
    short.append(scheduler.submit(lambda: "done"))
    assert long.result(timeout=60) >= 0, "the long job ran to its end before the short one"
    timing = scheduler.timing(long)
    assert timing is not None and timing.service > 0 and timing.queued >= 0


def test_the_job_that_has_held_the_model_least_goes_first(scheduler: ModelScheduler) -> None:
    started = threading.Event()
    short: list[object] = []
    between: list[int] = []  # the long job's slices while the short one was in progress

    def long_job() -> None:
        started.set()
        for _ in range(10_000):
            time.sleep(0.002)  # holding the model: attained service grows
            chunk_boundary()
            if short:
                if short[0].done():  # type: ignore[attr-defined]
                    return
                between.append(1)

    def short_job() -> None:
        for _ in range(3):
            chunk_boundary()  # three slices, each far shorter than the long job's service

    long = scheduler.submit(long_job)
    assert started.wait(30)
    time.sleep(0.05)  # the long job has held the model for a while
    short.append(scheduler.submit(short_job))
    long.result(timeout=60)
    # Round robin would have run the long job between the short one's slices.
    assert len(between) <= 1, f"the long job ran {len(between)} slices amid the short one"


def test_generations_advance_during_a_long_prefill(
    engine: Engine, scheduler: ModelScheduler
) -> None:
    session = SessionCache(engine)
    session.prefill(random_tokens(20, engine.vocab_size, seed=3))
    generation = scheduler.generate(session.begin_generation(GREEDY))
    long = SessionCache(engine)
    prompt = random_tokens(600, engine.vocab_size, seed=4)  # 19 chunks of 32
    seen: list[bool] = []

    def prefill() -> None:
        seen.append(generation.done())
        long.prefill(prompt)
        seen.append(generation.done())

    scheduler.submit(prefill).result(timeout=120)
    assert seen == [False, True], "the generation waited for the whole prefill"
    assert long.tokens == tuple(prompt)


def test_an_exclusive_job_runs_alone(engine: Engine, scheduler: ModelScheduler) -> None:
    session = SessionCache(engine)
    session.prefill(random_tokens(20, engine.vocab_size, seed=5))
    generation = scheduler.generate(session.begin_generation(GREEDY))
    order: list[str] = []
    gate = threading.Event()

    def exclusive() -> bool:
        order.append("exclusive")
        chunk_boundary()  # it pauses, yet nothing else starts meanwhile
        gate.wait(0.2)
        order.append("exclusive end")
        return generation.done()

    alone = scheduler.submit(exclusive, exclusive=True)
    after = scheduler.submit(lambda: order.append("after"))
    assert alone.result(timeout=60), "the exclusive job started beside a running generation"
    after.result(timeout=60)
    assert order == ["exclusive", "exclusive end", "after"]


def test_a_failing_job_or_generation_leaves_the_scheduler_serving(
    engine: Engine, scheduler: ModelScheduler
) -> None:
    def boom() -> None:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        scheduler.submit(boom).result(timeout=30)
    session = SessionCache(engine)
    session.prefill(random_tokens(8, engine.vocab_size, seed=6))
    before = session.state
    pending = session.begin_generation(GREEDY)
    session.prefill(random_tokens(9, engine.vocab_size, seed=7))  # the session moved meanwhile
    with pytest.raises(RuntimeError, match="changed while its generation ran"):
        scheduler.generate(pending).result(timeout=30)
    assert session.state is not before and len(session.tokens) == 9  # nothing clobbered
    assert scheduler.submit(lambda: 42).result(timeout=30) == 42


def test_max_batch_rotates_the_running_generations(engine: Engine) -> None:
    scheduler = ModelScheduler(engine, max_batch=2)
    try:
        sessions = []
        for n in (4, 9, 14, 19, 24):
            s = SessionCache(engine)
            s.prefill(random_tokens(n, engine.vocab_size, seed=n))
            sessions.append(s)
        futures = [scheduler.generate(s.begin_generation(GREEDY)) for s in sessions]
        assert all(len(f.result(timeout=60).tokens) == GREEDY.max_new_tokens for f in futures)
        assert scheduler.stats().max_batch == 2
    finally:
        scheduler.shutdown()


def test_shutdown_refuses_new_work(engine: Engine) -> None:
    scheduler = ModelScheduler(engine)
    scheduler.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        scheduler.submit(lambda: 1)
    with pytest.raises(ValueError, match="at least 1"):
        ModelScheduler(engine, max_jobs=0)


@pytest.mark.parametrize("share", [0.0, 0.99])
def test_decode_share_sets_how_far_a_generation_gets_per_prefill_slice(
    engine: Engine, share: float
) -> None:
    scheduler = ModelScheduler(engine, decode_share=share)
    try:
        session = SessionCache(engine)
        session.prefill(random_tokens(20, engine.vocab_size, seed=5))
        long = SessionCache(engine)
        prompt = random_tokens(600, engine.vocab_size, seed=6)  # 19 chunks of 32
        started = threading.Event()

        def prefill() -> None:
            started.set()
            long.prefill(prompt)

        job = scheduler.submit(prefill)
        assert started.wait(timeout=60)
        generation = scheduler.generate(session.begin_generation(GREEDY))
        slices_when_done: list[int] = []
        generation.add_done_callback(lambda _: slices_when_done.append(scheduler.stats().slices))
        assert len(generation.result(timeout=120).tokens) == GREEDY.max_new_tokens
        job.result(timeout=120)
        (slices,) = slices_when_done
        if share == 0.0:  # one token per slice: the 10 tokens span about 10 slices
            assert slices >= GREEDY.max_new_tokens - 1
        else:  # up to 99x the last slice's time in decode steps: done within a few slices
            assert slices <= 4
        assert scheduler.stats().slices == 19  # the prefill was sliced as before
    finally:
        scheduler.shutdown()


def test_decode_share_must_leave_the_jobs_some_time(engine: Engine) -> None:
    with pytest.raises(ValueError, match="decode_share"):
        ModelScheduler(engine, decode_share=1.0)


def test_the_server_setting_is_checked_and_reaches_the_scheduler(engine: Engine) -> None:
    from leyline.engine.backend import EngineBackend
    from leyline.serve.settings import ServerSettings

    with pytest.raises(ValueError, match="decode_share"):
        ServerSettings(decode_share=-0.1)
    settings = ServerSettings(decode_share=0.25)
    backend = EngineBackend(
        engine, limits=settings.limits, model_name="t", decode_share=settings.decode_share
    )
    try:
        assert backend.scheduler.decode_share == 0.25
    finally:
        backend.shutdown()
