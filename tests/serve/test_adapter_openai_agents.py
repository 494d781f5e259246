"""The OpenAI Agents SDK adapter (``leyline.policies.adapters.openai_agents``) with the real
``openai-agents`` package on the real `leyline serve` (SmolLM2, CPU): ``Runner.run`` and
``Runner.run_streamed`` of an agent with a tool, the runner's retry settings (every model call
goes through ``client.with_options(max_retries=0)``), and the SDK's default client.

SmolLM2-135M on 8 new tokens cannot write a tool call, so the agent's tool calls are
SCRIPTED: ``ScriptedToolCalls`` lets the real model answer each turn through Leyline, then
shows the runner the script's next call instead of that answer (the wrapper sees the answer
unsent and splices it out of the cache). The runner, the tool, the messages the SDK builds,
the directives and the server's cache edits are real; the last turn is the model's own text.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

pytest.importorskip("agents")

from agents import (
    Agent,
    Model,
    ModelResponse,
    ModelRetrySettings,
    ModelSettings,
    RunConfig,
    Runner,
    function_tool,
)
from openai.types.responses import ResponseCompletedEvent, ResponseFunctionToolCall

from leyline.policies import AsyncLeylineOpenAI, CallRecord, EstimateCounter
from leyline.policies.adapters.openai_agents import (
    leyline_agents_model,
    leyline_client_of,
    use_leyline_by_default,
)

from . import agent_task
from .agent_task import FILES, POLICY, TASK, output
from .conftest import API_KEY, Server

pytestmark = [pytest.mark.slow, pytest.mark.model]

SETTINGS = ModelSettings(
    max_tokens=4, temperature=0, retry=ModelRetrySettings(max_retries=0)
)  # max_retries=0: the runner turns provider retries off with client.with_options(...)
RUN = RunConfig(tracing_disabled=True)


@function_tool
def read_file(path: str) -> str:
    """Read a file of the project."""
    return output(path)


class ScriptedToolCalls(Model):
    """SCRIPTED tool calls over a real model (test scaffolding, not the adapter): the real
    model answers every turn through Leyline; for the first ``len(paths)`` turns the runner
    is shown a ``read_file`` call of the next path instead of that answer."""

    def __init__(self, inner: Model, paths: list[str]) -> None:
        self.inner = inner
        self.paths = list(paths)
        self.turns = 0

    def _next_call(self) -> ResponseFunctionToolCall | None:
        if self.turns >= len(self.paths):
            return None
        self.turns += 1
        path = self.paths[self.turns - 1]
        return ResponseFunctionToolCall(
            type="function_call",
            call_id=f"call_{self.turns}",
            name="read_file",
            arguments=json.dumps({"path": path}),
            status="completed",
        )

    async def get_response(self, *args: Any, **kwargs: Any) -> ModelResponse:
        response = await self.inner.get_response(*args, **kwargs)
        call = self._next_call()
        if call is not None:
            response.output = [call]
        return response

    async def stream_response(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        async for event in self.inner.stream_response(*args, **kwargs):
            if isinstance(event, ResponseCompletedEvent):
                call = self._next_call()
                if call is not None:
                    response = event.response.model_copy(update={"output": [call]})
                    event = event.model_copy(update={"response": response})
            yield event


def run_agent(
    server: Server, policy: str | None, tag: str, *, streamed: bool = False, **options: Any
) -> tuple[list[CallRecord], Any]:
    """One agent run of FILES scripted tool turns and a final answer; its records. ``tag``
    makes the task unique, so no run hits the server's prefix cache of another one."""
    task = f"{TASK} (run {tag})"

    async def main() -> tuple[list[CallRecord], Any]:
        model = leyline_agents_model(
            "smollm2",
            f"{server.base_url}/v1",
            API_KEY,
            policy,
            counter=EstimateCounter(),
            **options,
        )
        wrapper = leyline_client_of(model)
        copies = 0
        copy = wrapper.copy

        def counted(**kw: Any) -> AsyncLeylineOpenAI:
            nonlocal copies
            copies += 1
            return copy(**kw)

        wrapper.with_options = counted  # type: ignore[method-assign]
        scripted = ScriptedToolCalls(model, [f"file_{n}.py" for n in range(1, FILES + 1)])
        agent = Agent(
            name="reader",
            instructions="You are a coding agent. Read files, then answer.",
            model=scripted,
            model_settings=SETTINGS,
            tools=[read_file],
        )
        if streamed:
            result = Runner.run_streamed(agent, task, run_config=RUN, max_turns=FILES + 2)
            async for _ in result.stream_events():
                pass
        else:
            result = await Runner.run(agent, task, run_config=RUN, max_turns=FILES + 2)
        assert scripted.turns == FILES
        assert copies >= FILES + 1, "every call went through with_options(max_retries=0)"
        await wrapper.aclose()
        await wrapper.client.close()
        return wrapper.records, result

    return asyncio.run(main())


@pytest.fixture(scope="module")
def baseline(server: Server) -> list[CallRecord]:
    records, _ = run_agent(server, None, "baseline")
    return records


def test_runner_run_with_a_policy(server: Server, baseline: list[CallRecord]) -> None:
    records, result = run_agent(server, POLICY, "policy")
    agent_task.check_splices(records)
    assert isinstance(result.final_output, str)
    agent_task.check_shrinks(records, baseline)


def test_runner_run_streamed(server: Server) -> None:
    records, result = run_agent(server, POLICY, "streamed", streamed=True)
    agent_task.check_splices(records)
    assert all(r.streamed for r in records)
    assert isinstance(result.final_output, str)


def test_the_same_edits_as_plain_messages_prefill_more(server: Server) -> None:
    spliced, _ = run_agent(server, POLICY, "spliced")
    plain, _ = run_agent(server, POLICY, "plain", directives=False)
    agent_task.check_plain_prefills_more(spliced, plain)


def test_the_default_client(server: Server) -> None:
    from agents.models import _openai_shared

    async def main() -> list[CallRecord]:
        wrapper = use_leyline_by_default(
            f"{server.base_url}/v1", API_KEY, POLICY, counter=EstimateCounter()
        )
        try:
            agent = Agent(name="plain", model="smollm2", model_settings=SETTINGS)
            # A RunConfig made after use_leyline_by_default: its provider reads the defaults.
            run = RunConfig(tracing_disabled=True)
            result = await Runner.run(agent, "Say hello.", run_config=run)
            assert isinstance(result.final_output, str)
        finally:
            _openai_shared.set_default_openai_client(None)  # type: ignore[arg-type]
            _openai_shared.set_use_responses_by_default(True)
            await wrapper.aclose()
            await wrapper.client.close()
        return wrapper.records

    records = asyncio.run(main())
    assert len(records) == 1 and records[0].leyline and records[0].resync is None
