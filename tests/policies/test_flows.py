"""flows: one sans-IO flow, run by a sync and an async shell alike."""

from __future__ import annotations

import asyncio

import pytest

from leyline.policies.flows import Flow, arun, run


def flow() -> Flow[list[object]]:
    """Asks for "a", then "fail" (whose error it handles), then "b"."""
    answers: list[object] = [(yield "a")]
    try:
        yield "fail"
    except KeyError as exc:
        answers.append(f"handled {exc}")
    answers.append((yield "b"))
    return answers


def perform(request: object) -> object:
    if request == "fail":
        raise KeyError("fail")
    if request == "boom":
        raise ValueError("boom")
    return f"answer {request}"


async def aperform(request: object) -> object:
    return perform(request)


def test_run_and_arun_send_answers_and_throw_errors_into_the_flow() -> None:
    expected = ["answer a", "handled 'fail'", "answer b"]
    assert run(flow(), perform) == expected
    assert asyncio.run(arun(flow(), aperform)) == expected


def test_an_error_the_flow_does_not_handle_comes_out_as_it_is() -> None:
    def unhandled() -> Flow[None]:
        yield "boom"

    with pytest.raises(ValueError, match="boom"):
        run(unhandled(), perform)
    with pytest.raises(ValueError, match="boom"):
        asyncio.run(arun(unhandled(), aperform))
    assert run(_no_requests(), perform) == 7


def _no_requests() -> Flow[int]:
    return 7
    yield  # a generator that asks for nothing
