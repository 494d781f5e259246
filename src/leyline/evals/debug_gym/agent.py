"""The agent: debug-gym's Froggy with upstream's mini_nightmare prompt; submit ends it."""

from __future__ import annotations

from typing import Any

from debug_gym.agents.froggy_agent import FroggyAgent, FroggyAgentArgs
from debug_gym.gym.envs.env import EnvInfo

from .records import StopReason

# debug-gym's configs/mini_nightmare.yaml (MIT, microsoft/debug-gym), verbatim. A fixed
# system prompt also keeps message 0 stable, so every arm's prefix stays cacheable.
SYSTEM_PROMPT = (
    "You are a debugging agent specialized in fixing Python programs. "
    "Your goal is to debug a Python program to make sure it can pass a set of hidden test "
    "functions. You have access to a problem statement that describes the issue, you also "
    "have access to a set of tools to help you investigate the code before proposing a "
    "patch. While the code may seem familiar to you from your training, you should not "
    "assume you know the code. Instead, you must investigate the code carefully to "
    "understand the potential bugs. Once you have gained enough information, propose a "
    "patch to fix the bugs. Avoid editing the entire code, focus on the bugs only. You "
    "must make tool calls to interact with the environment, but you can only call one tool "
    "at a time. Do not repeat your previous action, especially if it returned tool calling "
    "errors or it resulted in information that you already know. You can spend some time "
    "thinking to help you make the decision when you are stuck, but you must be concise and "
    "avoid overthinking. Once you are done, use the submit tool to end the debugging "
    "session, note you can only call it once. Output both your thinking process (if any) "
    "and the tool call (must) in the response."
)


class HarnessAgent(FroggyAgent):
    """Froggy, plus: a submit ends the episode, and the reason it ended is kept.

    debug-gym 1.3.0 lets a failing submit run on (``step()`` overwrites ``terminated``
    with ``resolved``) although its prompt says submit can be called once.
    """

    name = "leyline_froggy"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.stop_reason: StopReason | None = None

    def should_stop(self, step: int, info: EnvInfo) -> tuple[bool, str | None]:
        stop, reason = super().should_stop(step, info)
        call = info.action_tool_call
        if info.resolved:
            self.stop_reason = "resolved"
        elif call is not None and call.name == "submit":
            stop, reason, self.stop_reason = True, "submitted", "submitted"
        elif stop:
            self.stop_reason = "max_steps"
        return stop, reason


def agent_args(max_steps: int) -> FroggyAgentArgs:
    return FroggyAgentArgs(system_prompt=SYSTEM_PROMPT, max_steps=max_steps)
