"""debug-gym's OpenAI LLM with the agent's history routed through a Leyline policy.

debug-gym rebuilds the whole history every step and hands it to ``LLM.generate``. Here
:class:`~leyline.policies.TurnPlanner` turns it into what is sent: the policy's edits
applied, and, in a session on a Leyline server, those edits as directives. Without a
session the edited messages go out plainly and the server re-prefills from the first
change. One instance per episode (the planner holds the episode's cache state).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

import httpx
import openai
from debug_gym.llms.base import LLMConfig, LLMResponse
from debug_gym.llms.openai import OpenAILLM
from debug_gym.logger import DebugGymLogger
from openai.types import CompletionUsage
from openai.types.chat import ChatCompletion
from pydantic import ValidationError

from leyline.policies import EstimateCounter, TurnPlan, TurnPlanner
from leyline.protocol import LeylineResponse
from leyline.protocol.resources import Routes

from .records import TurnRecord
from .server import server_root

COUNTER = EstimateCounter()
"""Token estimate for the policy and for debug-gym's own context check. debug-gym counts
with tiktoken, whose encodings download on first use (no timeout): not here."""


class LeylineLLM(OpenAILLM):
    def __init__(
        self,
        *,
        model: str,
        base_url: str,
        api_key: str,
        policy: str | None,
        session: str | None,
        logger: DebugGymLogger,
        context_limit_k: int = 128,
        generate_kwargs: Mapping[str, Any] | None = None,
        max_retries: int = 3,
        http_client: httpx.Client | None = None,
    ) -> None:
        # A non-"vllm" tag stops debug-gym from retrying 400s (it would, 100 times).
        config = LLMConfig(
            model=model,
            context_limit=context_limit_k,
            api_key=api_key or "EMPTY",
            endpoint=base_url,
            tags=["leyline-harness"],
        )
        super().__init__(
            model, config, logger=logger, runtime_generate_kwargs=dict(generate_kwargs or {})
        )
        self.planner = TurnPlanner(policy, counter=COUNTER)
        self.session = session
        """Leyline session id: edits go as directives. None: plain messages."""
        self.turns: list[TurnRecord] = []
        self.max_retries = max_retries
        self._retries_left = max_retries
        self._raw: ChatCompletion | None = None
        self._usage: CompletionUsage | None = None
        self._http_client = http_client
        self._call_ids: set[str] = set()
        self._client: openai.OpenAI | None = None

    @property
    def client(self) -> openai.OpenAI:
        if self._client is None:
            # No retries inside the client: it would retry a Leyline 409 (revision_conflict)
            # as a lock timeout; retries stay with debug-gym, bounded by max_retries.
            self._client = openai.OpenAI(
                api_key=self.config.api_key,
                base_url=self.config.endpoint,
                timeout=300.0,
                max_retries=0,
                http_client=self._http_client,
            )
        return self._client

    def end_session(self) -> None:
        """Free the episode's cache on the Leyline server (best effort: it may be gone).

        Call before :meth:`close` (which closes the HTTP client).
        """
        if self.session is None:
            return
        path = Routes.session.format(session=quote(self.session, safe=""))
        url = server_root(str(self.config.endpoint)) + path
        headers = {"Authorization": f"Bearer {self.config.api_key}"}
        try:
            if self._http_client is not None:
                self._http_client.delete(url, headers=headers, timeout=10.0)
            else:
                with httpx.Client(timeout=10.0) as http:
                    http.delete(url, headers=headers)
        except httpx.HTTPError:
            pass  # the report does not depend on it

    # -- what debug-gym calls ----------------------------------------------------------

    def generate(self, messages: list[dict[str, Any]], tools: Any, **kwargs: Any) -> LLMResponse:
        plan = self.planner.plan(messages)
        dropped = False
        try:
            response = self._generate(plan, tools, kwargs)
        except openai.APIStatusError:
            if self.session is None or not plan.directives:
                raise
            # The server refused the directives (session lost, stale revision): this turn
            # goes plain and is re-prefilled; the next one can splice again.
            self.planner.drop_session()
            plan, dropped = self.planner.plan(messages), True
            response = self._generate(plan, tools, kwargs)
        leyline = self._leyline()
        self.planner.commit(plan, leyline if self.session is not None else None)
        self.turns.append(self._turn(plan, leyline, dropped))
        self._unique_call_id(response)
        return response

    def tokenize(self, messages: list[dict[str, Any]]) -> list[list[str]]:
        return [[""] * COUNTER.count(_text(m)) for m in messages]

    def count_tokens(self, messages: list[dict[str, Any]] | str) -> int:
        if isinstance(messages, str):
            return COUNTER.count(messages)
        return sum(COUNTER.count(_text(m)) for m in messages)

    def need_to_be_retried(self, exception: BaseException) -> bool:
        # debug-gym retries up to 100 times with waits up to 40 s: bound it per call.
        if self._retries_left <= 0:
            return False
        self._retries_left -= 1
        return bool(super().need_to_be_retried(exception))

    def _perform_chat_completion(self, **kwargs: Any) -> ChatCompletion:
        raw = self._send(**kwargs)
        self._raw, self._usage = raw, raw.usage
        if raw.usage is None:  # debug-gym reads usage unconditionally
            raw.usage = CompletionUsage(prompt_tokens=0, completion_tokens=0, total_tokens=0)
        return raw

    # -- the transport (the scripted stand-in replaces this) ---------------------------

    def _send(self, **kwargs: Any) -> ChatCompletion:
        completion: ChatCompletion = self.client.chat.completions.create(**kwargs)
        return completion

    # -- helpers ----------------------------------------------------------------------

    def _generate(self, plan: TurnPlan, tools: Any, kwargs: Mapping[str, Any]) -> LLMResponse:
        call = dict(kwargs)
        if self.session is not None:
            body = plan.leyline(self.session).model_dump(mode="json", exclude_none=True)
            call["extra_body"] = {"leyline": body}
        self._raw, self._usage, self._retries_left = None, None, self.max_retries
        response: LLMResponse = super().generate([dict(m) for m in plan.messages], tools, **call)
        return response

    def _unique_call_id(self, response: LLMResponse) -> None:
        """Rename a reused tool-call id: the policy's transcript needs unique ids.

        debug-gym names every reply without a tool call ``empty_tool_response``, and some
        servers number their call ids per request.
        """
        tool = response.tool
        if tool is None:
            return
        if not tool.id or tool.id in self._call_ids:
            tool.id = f"{tool.id or 'call'}-{len(self._call_ids)}"
        self._call_ids.add(tool.id)

    def _leyline(self) -> LeylineResponse | None:
        extra = (self._raw.model_extra if self._raw is not None else None) or {}
        data = extra.get("leyline")
        if data is None:
            return None
        try:
            return LeylineResponse.model_validate(data)
        except ValidationError as exc:
            self.logger.warning(f"ignoring a malformed leyline object: {exc}")
            return None

    def _turn(self, plan: TurnPlan, leyline: LeylineResponse | None, dropped: bool) -> TurnRecord:
        usage = self._usage
        return TurnRecord(
            prompt_tokens=usage.prompt_tokens if usage else None,
            completion_tokens=usage.completion_tokens if usage else None,
            messages=len(plan.messages),
            policy_edits=len(plan.edits),
            directives=len(plan.directives),
            fallback=plan.fallback,
            path=leyline.path.value if leyline else None,
            reused_tokens=leyline.reused_tokens if leyline else None,
            prefilled_tokens=leyline.prefilled_tokens if leyline else None,
            rotated_tokens=leyline.rotated_tokens if leyline else None,
            session_dropped=dropped,
        )


def _text(message: Mapping[str, Any]) -> str:
    """What debug-gym's own tokenize() counts for a message."""
    return str(message.get("content", message.get("tool_calls", message)))
