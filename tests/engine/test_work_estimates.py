"""The scheduler's size estimates: tokens a turn runs through the model, and the learned
seconds per token and per decode step that turn sizes into remaining work."""

from __future__ import annotations

import pytest

from leyline.engine.work_estimates import WorkRates, turn_cost
from leyline.protocol.algebra import Edit
from leyline.protocol.directives import Mode, RecomputeDeviation, RecomputeNone
from leyline.protocol.resolve import ResolvedCompose

SESSION = tuple(range(100))


def test_a_plain_request_costs_the_prompt_past_what_the_session_holds() -> None:
    prompt = (*SESSION[:40], 7, 7, 7, *SESSION[43:], 1, 2, 3, 4, 5)
    assert turn_cost(SESSION, (), (), prompt) == len(prompt) - 40
    assert turn_cost(SESSION, (), (), (*SESSION, 9)) == 1
    assert turn_cost(SESSION, (), (), SESSION[:50]) == 0  # a truncation runs nothing


def test_a_splice_costs_its_replacement_the_last_token_and_the_new_prompt() -> None:
    edit = Edit(10, 60, (5, 6, 7, 8), Mode.amortize)
    edited = (*SESSION[:10], 5, 6, 7, 8, *SESSION[60:])
    prompt = (*edited, 1, 2, 3)
    assert turn_cost(edited, (edit,), (), prompt) == 4 + 1 + 3


def test_a_forget_costs_everything_after_it() -> None:
    edit = Edit(30, 40, (), Mode.forget)
    edited = SESSION[:30] + SESSION[40:]
    assert turn_cost(edited, (edit,), (), edited) == len(edited) - 30 + 1


def test_a_compose_costs_its_seam_and_recomputed_share_not_its_block() -> None:
    block = tuple(range(1000, 1300))
    edit = Edit(20, 20, block, Mode.amortize, index=0)
    edited = SESSION[:20] + block + SESSION[20:]
    plain = ResolvedCompose(0, "skill", 20, len(block), 16, RecomputeNone(mode="none"))
    assert turn_cost(edited, (edit,), (plain,), edited) == 16 + 1
    deviation = RecomputeDeviation(mode="deviation", ratio=0.1)
    blended = ResolvedCompose(0, "skill", 20, len(block), 16, deviation)
    assert turn_cost(edited, (edit,), (blended,), edited) == 16 + 29 + 1  # ceil(0.1 x 284)


def test_rates_learn_from_finished_work_and_ignore_tiny_jobs() -> None:
    rates = WorkRates(token_s=1e-3, step_s=0.05)
    rates.learn_job(4, 10.0)  # fixed costs dominate a 4-token job: no lesson
    rates.learn_job(None, 10.0)
    assert rates.token_s == 1e-3
    for _ in range(60):
        rates.learn_job(1000, 3.0)
        rates.learn_step(0.01)
    assert rates.token_s == pytest.approx(3e-3, rel=1e-3)
    assert rates.step_s == pytest.approx(0.01, rel=1e-3)


def test_remaining_work_falls_back_to_attained_service() -> None:
    rates = WorkRates(token_s=1e-3, step_s=0.02)
    assert rates.job_left(1000, 0.25, chunk_tokens=512) == pytest.approx(0.75)
    # Outran its estimate: what it has held the model is the best guess of what is left.
    assert rates.job_left(1000, 1.5, chunk_tokens=512) == pytest.approx(1.5)
    # No size: one chunk's worth, then attained service.
    assert rates.job_left(None, 0.0, chunk_tokens=512) == pytest.approx(0.512)
    assert rates.job_left(None, 2.0, chunk_tokens=512) == pytest.approx(2.0)
    assert rates.generation_left(4) == pytest.approx(0.08)
    assert rates.generation_left(0) == 0.0
