"""The LangChain adapter (``leyline.policies.adapters.langchain``) with the real
``langchain`` / ``langchain-openai`` packages on the real `leyline serve` (SmolLM2, CPU): an
agent of ``langchain.agents.create_agent`` with a tool, run with ``invoke``, ``stream`` (the
chat model streaming) and ``ainvoke``.

SmolLM2-135M on 8 new tokens cannot write a tool call, so the agent's tool calls are
SCRIPTED: the ``ScriptedToolCalls`` middleware lets the real model answer each turn through
Leyline, then hands the agent the script's next call instead of that answer (the wrapper
sees the answer unsent and splices it out of the cache). The agent loop, the tool, the
messages ChatOpenAI builds, the directives and the server's cache edits are real; the last
turn is the model's own text.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

pytest.importorskip("langchain_openai")
pytest.importorskip("langchain.agents")

from langchain.agents import create_agent
from langchain.agents.middleware import AgentMiddleware, ModelRequest, ModelResponse
from langchain_core.messages import AIMessage
from langchain_core.tools import tool

from leyline.policies import CallRecord, EstimateCounter
from leyline.policies.adapters.langchain import (
    leyline_chat_openai,
    leyline_clients_of,
)

from . import agent_task
from .agent_task import FILES, POLICY, TASK, output
from .conftest import API_KEY, Server

pytestmark = [pytest.mark.slow, pytest.mark.model]


@tool
def read_file(path: str) -> str:
    """Read a file of the project."""
    return output(path)


class ScriptedToolCalls(AgentMiddleware):  # type: ignore[type-arg]
    """SCRIPTED tool calls over a real model (test scaffolding, not the adapter): the real
    model answers every turn through Leyline; for the first ``FILES`` turns the agent gets a
    ``read_file`` call of the next file instead of that answer."""

    def __init__(self) -> None:
        super().__init__()
        self.turns = 0

    def _replace(self, response: Any) -> Any:
        if self.turns >= FILES:
            return response
        self.turns += 1
        call = {
            "name": "read_file",
            "args": {"path": f"file_{self.turns}.py"},
            "id": f"call_{self.turns}",
            "type": "tool_call",
        }
        return ModelResponse(result=[AIMessage(content="", tool_calls=[call])])

    def wrap_model_call(self, request: ModelRequest, handler: Callable[[ModelRequest], Any]) -> Any:
        return self._replace(handler(request))

    async def awrap_model_call(
        self, request: ModelRequest, handler: Callable[[ModelRequest], Awaitable[Any]]
    ) -> Any:
        return self._replace(await handler(request))


def run_agent(
    server: Server, policy: str | None, tag: str, *, mode: str = "invoke", **options: Any
) -> tuple[list[CallRecord], str]:
    """One agent run of FILES scripted tool turns and a final answer: the records of the
    wrapper it used, the final answer. ``tag`` makes the task unique (no run hits the server's
    prefix cache of another one)."""
    model = leyline_chat_openai(
        "smollm2",
        f"{server.base_url}/v1",
        API_KEY,
        policy,
        leyline={"counter": EstimateCounter(), **options},
        temperature=0,
        max_tokens=4,
        max_retries=0,
        streaming=mode == "stream",
    )
    scripted = ScriptedToolCalls()
    agent = create_agent(
        model=model,
        tools=[read_file],
        system_prompt="You are a coding agent. Read files, then answer.",
        middleware=[scripted],
    )
    state = {"messages": [{"role": "user", "content": f"{TASK} (run {tag})"}]}
    config = {"recursion_limit": 4 * FILES}
    sync, async_ = leyline_clients_of(model)
    if mode == "ainvoke":

        async def main() -> Any:
            async with async_:
                answer = await agent.ainvoke(state, config)
            await async_.client.close()
            return answer

        result = asyncio.run(main())
        wrapper: Any = async_
    elif mode == "stream":
        for _ in agent.stream(state, config, stream_mode="messages"):
            pass
        result = None
        wrapper = sync
    else:
        result = agent.invoke(state, config)
        wrapper = sync
    assert scripted.turns == FILES
    sync.close()
    answer = "" if result is None else str(result["messages"][-1].content)
    return wrapper.records, answer


def test_invoke_with_a_policy_splices_and_shrinks_the_prompt(server: Server) -> None:
    baseline, _ = run_agent(server, None, "baseline")
    records, answer = run_agent(server, POLICY, "policy")
    agent_task.check_splices(records)
    assert isinstance(answer, str)
    agent_task.check_shrinks(records, baseline)


def test_the_same_edits_as_plain_messages_prefill_more(server: Server) -> None:
    spliced, _ = run_agent(server, POLICY, "spliced")
    plain, _ = run_agent(server, POLICY, "plain", directives=False)
    agent_task.check_plain_prefills_more(spliced, plain)


def test_stream(server: Server) -> None:
    records, _ = run_agent(server, POLICY, "stream", mode="stream")
    agent_task.check_splices(records)
    assert all(r.streamed for r in records)


def test_ainvoke(server: Server) -> None:
    records, answer = run_agent(server, POLICY, "async", mode="ainvoke")
    agent_task.check_splices(records)
    assert isinstance(answer, str)
