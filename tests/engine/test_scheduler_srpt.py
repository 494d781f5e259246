"""The scheduler's ``srpt`` policy: of the waiting jobs the one with the least estimated
work left goes first, a generation near its end finishes before a long job's next slice,
a long generation keeps the one-step-per-slice pace, and the setting reaches the server."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from leyline.core.turns import SamplingParams
from leyline.engine.engine import Engine
from leyline.engine.scheduler import ModelScheduler
from leyline.engine.session import SessionCache
from leyline.engine.work_estimates import WorkRates

from ._helpers import random_tokens, tiny_llama


class FixedRates(WorkRates):
    """Rates that learn nothing: the policy's choices then depend on the test's numbers
    alone, not on how fast this machine ran the last job."""

    def learn_job(self, tokens: int | None, service_s: float) -> None:
        pass

    def learn_step(self, seconds: float) -> None:
        pass


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(tiny_llama(), prefill_chunk=32)


def _scheduler(engine: Engine, policy: str, rates: WorkRates) -> ModelScheduler:
    scheduler = ModelScheduler(engine, policy=policy, aging=0.0)  # type: ignore[arg-type]
    scheduler.rates = rates
    return scheduler


@pytest.fixture
def srpt(engine: Engine) -> Iterator[ModelScheduler]:
    s = _scheduler(engine, "srpt", FixedRates(token_s=1e-3, step_s=1e-3))
    yield s
    s.shutdown()


@pytest.mark.parametrize(("policy", "expected"), [("srpt", "small"), ("las", "big")])
def test_of_two_waiting_jobs_srpt_runs_the_smaller_first(
    engine: Engine, policy: str, expected: str
) -> None:
    scheduler = _scheduler(engine, policy, FixedRates(token_s=1e-3))
    try:
        holding, release = threading.Event(), threading.Event()
        order: list[str] = []

        def holder() -> None:
            holding.set()
            release.wait(30)  # holds the model while the two queue behind it

        first = scheduler.submit(holder, cost=1)
        assert holding.wait(30)
        big = scheduler.submit(lambda: order.append("big"), cost=5000)
        small = scheduler.submit(lambda: order.append("small"), cost=10)
        release.set()
        for future in (first, big, small):
            future.result(timeout=60)
        assert order[0] == expected, order  # las: arrival order among equals
    finally:
        scheduler.shutdown()


def test_a_job_without_a_size_counts_as_one_chunk(engine: Engine) -> None:
    # 32-token chunks at 1 ms a token: 32 ms, between the two sized jobs.
    scheduler = _scheduler(engine, "srpt", FixedRates(token_s=1e-3))
    try:
        holding, release = threading.Event(), threading.Event()
        order: list[str] = []

        def holder() -> None:
            holding.set()
            release.wait(30)

        first = scheduler.submit(holder, cost=1)
        assert holding.wait(30)
        jobs = [
            scheduler.submit(lambda: order.append("big"), cost=500),
            scheduler.submit(lambda: order.append("unsized")),
            scheduler.submit(lambda: order.append("small"), cost=8),
        ]
        release.set()
        for future in (first, *jobs):
            future.result(timeout=60)
        assert order == ["small", "unsized", "big"]
    finally:
        scheduler.shutdown()


def _slices_until_generation_ends(
    engine: Engine, scheduler: ModelScheduler, max_new_tokens: int
) -> tuple[int, int, int]:
    """A 600-token prefill (19 slices of 32) runs; a generation starts during it. Returns
    the slices run when the generation was submitted and when it ended, and the tokens it
    made. (The prefill may have run a slice or more before the generation is submitted: on
    a busy machine the test's thread can be late.)"""
    session = SessionCache(engine)
    session.prefill(random_tokens(20, engine.vocab_size, seed=5))
    long = SessionCache(engine)
    prompt = random_tokens(600, engine.vocab_size, seed=6)
    started = threading.Event()

    def prefill() -> None:
        started.set()
        long.prefill(prompt)

    job = scheduler.submit(prefill, cost=len(prompt))
    assert started.wait(timeout=60)
    params = SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=(-1,))
    submitted = scheduler.stats().slices
    generation = scheduler.generate(session.begin_generation(params))
    slices_when_done: list[int] = []
    generation.add_done_callback(lambda _: slices_when_done.append(scheduler.stats().slices))
    made = len(generation.result(timeout=120).tokens)
    job.result(timeout=120)
    assert long.tokens == tuple(prompt)
    assert scheduler.stats().slices == 19  # the prefill was sliced as before
    return submitted, slices_when_done[0], made


def test_a_short_generation_ends_before_the_long_jobs_next_slice(
    engine: Engine, srpt: ModelScheduler
) -> None:
    # 10 tokens x 1 ms left against 600 tokens x 1 ms: the steps run to its end. At most
    # the slice running when it was submitted and one that began before it was queued.
    submitted, done, made = _slices_until_generation_ends(engine, srpt, 10)
    assert made == 10
    assert done - submitted <= 2, f"the generation took {done - submitted} slices to end"


def test_a_long_generation_keeps_one_step_per_slice(engine: Engine) -> None:
    # 40 tokens x 100 ms left against a 0.6 s prefill: the prefill keeps the model, and the
    # generation still advances one token per slice (as under las).
    scheduler = _scheduler(engine, "srpt", FixedRates(token_s=1e-3, step_s=0.1))
    try:
        _, slices, made = _slices_until_generation_ends(engine, scheduler, 40)
        assert made == 40
        assert slices >= 17, f"the generation ended after only {slices} of 19 slices"
    finally:
        scheduler.shutdown()


def test_las_advances_a_short_generation_one_token_per_slice(engine: Engine) -> None:
    scheduler = _scheduler(engine, "las", FixedRates(token_s=1e-3, step_s=1e-3))
    try:
        submitted, done, made = _slices_until_generation_ends(engine, scheduler, 10)
        assert made == 10 and done - submitted >= 9
    finally:
        scheduler.shutdown()


def test_finished_work_teaches_the_rates(engine: Engine) -> None:
    scheduler = ModelScheduler(engine, policy="srpt")
    try:
        prior = WorkRates()
        _slices_until_generation_ends(engine, scheduler, 10)
        assert scheduler.rates.token_s != prior.token_s
        assert scheduler.rates.step_s != prior.step_s
    finally:
        scheduler.shutdown()


def test_bad_settings_are_refused(engine: Engine) -> None:
    from leyline.serve.settings import ServerSettings

    with pytest.raises(ValueError, match="policy must be one of las, srpt"):
        ModelScheduler(engine, policy="fifo")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="aging"):
        ModelScheduler(engine, aging=-1.0)
    with pytest.raises(ValueError, match="schedule must be one of"):
        ServerSettings(schedule="fifo")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="schedule_aging"):
        ServerSettings(schedule_aging=-0.5)
    scheduler = ModelScheduler(engine)
    try:
        with pytest.raises(ValueError, match="token count"):
            scheduler.submit(lambda: None, cost=-1)
    finally:
        scheduler.shutdown()


def test_the_server_setting_reaches_the_scheduler(engine: Engine) -> None:
    from leyline.engine.backend import EngineBackend
    from leyline.serve.settings import ServerSettings

    settings = ServerSettings(schedule="srpt", schedule_aging=0.5)
    backend = EngineBackend(
        engine,
        limits=settings.limits,
        model_name="t",
        schedule=settings.schedule,
        schedule_aging=settings.schedule_aging,
    )
    try:
        assert (backend.scheduler.policy, backend.scheduler.aging) == ("srpt", 0.5)
    finally:
        backend.shutdown()


def test_a_servers_turns_carry_their_size_to_the_scheduler(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each turn's job is submitted with the tokens it prefills (the server's own count)."""
    from fastapi.testclient import TestClient

    from leyline.serve.serve import build_app
    from leyline.serve.settings import ServerSettings

    settings = ServerSettings(model="tiny-mla-v3", schedule="srpt", max_new_tokens=2)
    app = build_app(settings, prefix_cache_bytes=0)
    scheduler = app.state.service.backend.scheduler
    costs: list[int | None] = []
    submit = scheduler.submit

    def spy(fn, *, exclusive=False, cost=None):  # type: ignore[no-untyped-def]
        costs.append(cost)
        return submit(fn, exclusive=exclusive, cost=cost)

    monkeypatch.setattr(scheduler, "submit", spy)
    prompt = random_tokens(70, app.state.engine.vocab_size, seed=9)
    with TestClient(app) as client:
        prefilled = []
        for extra in ([], random_tokens(25, app.state.engine.vocab_size, seed=10)):
            prompt = prompt + extra
            reply = client.post(
                "/v1/completions",
                json={"prompt": prompt, "max_tokens": 2, "leyline": {"session": "sized"}},
            )
            assert reply.status_code == 200, reply.text
            prefilled.append(reply.json()["leyline"]["prefilled_tokens"])
    # The second prompt leaves the generated reply out: the session cuts it and prefills
    # the 25 new tokens.
    assert costs == prefilled, (costs, prefilled)
    assert prefilled == [70, 25]


def test_the_learned_rates_are_in_the_stats_and_metrics(engine: Engine) -> None:
    from leyline.serve.metrics import Metrics

    scheduler = _scheduler(engine, "srpt", FixedRates(token_s=0.004, step_s=0.03))
    try:
        stats = scheduler.stats()
        assert (stats.seconds_per_token, stats.seconds_per_decode_step) == (0.004, 0.03)
        metrics = Metrics()
        metrics.record_scheduler(stats)
        text = metrics.render().decode()
        assert 'leyline_scheduler_seconds{per="token"} 0.004' in text
        assert 'leyline_scheduler_seconds{per="decode_step"} 0.03' in text
    finally:
        scheduler.shutdown()
