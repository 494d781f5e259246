"""Isolation of KV that is not a prefill (``cross_session``) and of salted cache partitions
(``cross_salt``), as any client of a Leyline backend can see them.

* Cross-session (docs/protocol.md 3.1-3.2): session P SPLICEs a tool output out of a prompt;
  a plain request and a session Q that FORGETs the same span must then get the exact
  prefill's next-token top-20 log-probabilities (|delta| <= 1e-3), the splice arm its own
  definition (``ExactReference.splice_top``), an ERRATUM session the exact prefill of its
  tokens. The reference is ``transformers`` fp32 on ``--model-dir``, else a fresh
  session's prefill under a salt of its own (weaker: the server checks itself).
* Cross-salt: prompts cached under salt X must reuse 0 tokens under salt Y, with no salt and
  in a plain request; a second session under X (the control) must reuse.

Prompts start with random token ids (a per-run nonce), so no two scenarios share a cache
prefix. The method in full: docs/reports/eval-robustness.md.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from .fuzz import session_path
from .wire import auth_headers

TOP = 20
"""Next-token log-probabilities compared (OpenAI's most)."""
TOLERANCE = 1e-3
"""Max |delta log-probability| over the exact top-20 for the plain request and the FORGET."""
NONCE_IDS = 4
NONCE_RANGE = (1000, 30000)
"""Random token ids that start every prompt: below every vocabulary the evals serve."""
STUB = " [tool output elided]"
ERRATUM = " [STATE UPDATE] budget -> 250; overrides the earlier value."


@dataclass(frozen=True, slots=True)
class Answer:
    top: dict[str, float]
    """Next-token log-probabilities by token text (the response's top_logprobs[0])."""
    leyline: dict[str, Any] | None
    reused: int | None
    """Prompt tokens served from cache: ``leyline.reused_tokens``, else
    ``usage.prompt_tokens_details.cached_tokens``; None when the server says neither."""


class Server:
    """One client's requests to the server under test (token ids in, answers out)."""

    def __init__(self, base_url: str, key: str | None) -> None:
        self.http = httpx.Client(base_url=base_url, headers=auth_headers(key), timeout=300)
        self._texts: dict[int, str] = {}
        self.sessions: list[str] = []

    def tokens(self, text: str) -> list[int]:
        reply = self.http.post("/leyline/v1/tokenize", json={"text": text})
        reply.raise_for_status()
        return list(reply.json()["tokens"])

    def text_of(self, token: int) -> str:
        """The server's text of one token id (what its top_logprobs are keyed by)."""
        if token not in self._texts:
            reply = self.http.post("/leyline/v1/detokenize", json={"tokens": [token]})
            reply.raise_for_status()
            self._texts[token] = str(reply.json()["text"])
        return self._texts[token]

    def complete(
        self,
        prompt: Sequence[int],
        leyline: dict[str, Any] | None = None,
        cache_salt: str | None = None,
    ) -> Answer:
        body: dict[str, Any] = {
            "prompt": list(prompt),
            "max_tokens": 1,
            "temperature": 0,
            "logprobs": TOP,
        }
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        if leyline is not None:
            body["leyline"] = leyline
            self.sessions.append(leyline["session"])
        reply = self.http.post("/v1/completions", json=body)
        if reply.status_code != 200:
            raise RuntimeError(f"completion answered {reply.status_code}: {reply.text[:300]}")
        return parse_answer(reply.json())

    def create(self, session: str, tokens: Sequence[int]) -> int:
        self.sessions.append(session)
        body = {"session": session, "tokens": list(tokens)}
        reply = self.http.post("/leyline/v1/sessions", json=body)
        if reply.status_code != 201:
            raise RuntimeError(f"session create answered {reply.status_code}: {reply.text[:300]}")
        return int(reply.json()["revision"])

    def session_tokens(self, session: str) -> list[int]:
        reply = self.http.get(session_path(session), params={"tokens": "true"})
        if reply.status_code != 200:
            raise RuntimeError(f"session read answered {reply.status_code}: {reply.text[:300]}")
        return list(reply.json()["tokens"])

    def apply(self, session: str, revision: int, directives: list[dict[str, Any]]) -> Any:
        body = {"base_revision": revision, "directives": directives}
        reply = self.http.post(session_path(session) + "/directives", json=body)
        if reply.status_code != 200:
            raise RuntimeError(f"directives answered {reply.status_code}: {reply.text[:300]}")
        return reply.json()

    def close(self) -> None:
        for session in dict.fromkeys(self.sessions):
            self.http.delete(session_path(session))
        self.http.close()


def parse_answer(body: Mapping[str, Any]) -> Answer:
    logprobs = body["choices"][0].get("logprobs") or {}
    tops = logprobs.get("top_logprobs") or [{}]
    top = {str(k): float(v) for k, v in (tops[0] or {}).items()}
    leyline = body.get("leyline")
    reused = None
    if isinstance(leyline, dict) and leyline.get("reused_tokens") is not None:
        reused = int(leyline["reused_tokens"])
    else:
        details = (body.get("usage") or {}).get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            reused = int(details["cached_tokens"])
    return Answer(top, leyline if isinstance(leyline, dict) else None, reused)


# -- the comparison --------------------------------------------------------------------


def keyed(top: Sequence[tuple[int, float]], text_of: Callable[[int], str]) -> dict[str, float]:
    """The reference's top ids as the server's texts; a text two ids share is left out."""
    texts = [(text_of(token), logprob) for token, logprob in top]
    shared = Counter(text for text, _ in texts)
    return {text: logprob for text, logprob in texts if shared[text] == 1}


def compare(exact: Mapping[str, float], got: Mapping[str, float]) -> dict[str, Any]:
    """Max |delta log-probability| over the exact top-k, by token text.

    A token of the exact top-k missing from ``got`` had at most ``got``'s smallest value
    there (it was not in the server's top-k), so ``exact - min(got)`` bounds its delta from
    below (near 0 only for a tie at the cut); a token ``got`` has and the exact top-k lacks
    is bounded the same way from the other side. No ``got`` at all is an infinite delta.
    """
    if not exact:
        return {"max_abs_delta": None, "compared": 0, "missing": 0}
    if not got:
        return {"max_abs_delta": math.inf, "compared": 0, "missing": len(exact)}
    floor_got, floor_exact = min(got.values()), min(exact.values())
    deltas, missing = [], 0
    for text, logprob in exact.items():
        if text in got:
            deltas.append(abs(logprob - got[text]))
        else:
            missing += 1
            deltas.append(max(0.0, logprob - floor_got))
    for text, logprob in got.items():
        if text not in exact:
            deltas.append(max(0.0, logprob - floor_exact))
    return {"max_abs_delta": max(deltas), "compared": len(exact) - missing, "missing": missing}


# -- references --------------------------------------------------------------------------


class ExactReference:
    """Next-token log-probabilities of a plain ``transformers`` forward in fp32: no Leyline
    engine code, no cache, the whole prompt in one pass."""

    name = "transformers fp32 (--model-dir)"

    def __init__(self, model_dir: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        self.model = model.to(torch.float32)  # whatever the checkpoint's dtype
        self.model.eval()

    def top(self, tokens: Sequence[int], k: int = TOP) -> list[tuple[int, float]]:
        torch = self.torch
        with torch.no_grad():
            logits = self.model(torch.tensor([list(tokens)])).logits[0, -1]
        return self._top(logits, k)

    def splice_top(
        self, tokens: Sequence[int], start: int, end: int, stub: Sequence[int], k: int = TOP
    ) -> list[tuple[int, float]] | None:
        """The next token after a SPLICE of ``[start, end)`` by ``stub``, by its definition
        (protocol 3.1): the prefix and the stub prefilled; every downstream token's values
        and keys as the original prefill computed them, keys turned by the model's own
        rotary embedding at ``delta``; the last token run in its new context. None for a
        model whose rotary embedding is not transformers' ``rotate_half`` kind."""
        import importlib

        torch = self.torch
        model = self.model
        rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
        rotate_half = getattr(importlib.import_module(type(model).__module__), "rotate_half", None)
        if rotary is None or rotate_half is None:
            return None
        from transformers import DynamicCache

        tokens, stub = list(tokens), list(stub)
        n, delta = len(tokens), len(stub) - (end - start)
        with torch.no_grad():
            original = _cache_of(model(torch.tensor([tokens[:-1]]), use_cache=True))
            head = _cache_of(model(torch.tensor([tokens[:start] + stub]), use_cache=True))
            cos, sin = rotary(torch.zeros(1, 1, 1), torch.tensor([[delta]]))
            cos, sin = cos.double()[:, None], sin.double()[:, None]
            cache = DynamicCache()
            for i, (old, new) in enumerate(zip(original.layers, head.layers, strict=True)):
                keys = old.keys[:, :, end : n - 1].double()
                keys = (keys * cos + rotate_half(keys) * sin).to(old.keys.dtype)
                values = old.values[:, :, end : n - 1]
                cache.update(torch.cat([new.keys, keys], 2), torch.cat([new.values, values], 2), i)
            at = n - 1 + delta
            logits = model(
                torch.tensor([tokens[-1:]]),
                **{_cache_arg(model): cache},
                position_ids=torch.tensor([[at]]),
                cache_position=torch.tensor([at]),
            ).logits[0, -1]
        return self._top(logits, k)

    def _top(self, logits: Any, k: int) -> list[tuple[int, float]]:
        logprobs = self.torch.log_softmax(logits.double(), dim=-1)
        values, ids = self.torch.topk(logprobs, k)
        return [(int(i), float(v)) for i, v in zip(ids, values, strict=True)]


def _cache_of(output: Any) -> Any:
    """The KV cache a forward returned (``cache`` in transformers 5.x, earlier
    ``past_key_values``)."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values


def _cache_arg(model: Any) -> str:
    """The forward's cache argument: ``cache`` where it has one, else ``past_key_values``."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


# -- cross-session -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Prompt:
    tokens: list[int]
    start: int
    end: int
    """The tool output: tokens ``[start, end)``."""
    stub: list[int]

    @property
    def edited(self) -> list[int]:
        return self.tokens[: self.start] + self.stub + self.tokens[self.end :]


def nonce(rng: random.Random) -> list[int]:
    return [rng.randrange(*NONCE_RANGE) for _ in range(NONCE_IDS)]


def build_prompt(server: Server, head: list[int], size: int, tag: str) -> Prompt:
    """About ``size`` tokens: an agent's notes, a tool output a third of the way in, more
    notes and a question (``head``, the nonce, first)."""
    before: list[int] = []
    tool: list[int] = []
    after: list[int] = []
    step = 0
    while len(head) + len(before) < size // 3:
        before += server.tokens(
            f" Step {step}: the agent planned trip {tag} and called the flight search tool."
        )
        step += 1
    rows = 0
    while len(tool) < max(8, size // 4):
        tool += server.tokens(
            f' {{"id": {rows}, "from": "OSL", "to": "LIS", "price": {173 + 37 * rows}}},'
        )
        rows += 1
    tool = server.tokens(" <tool_output>[") + tool + server.tokens("]</tool_output>")
    question = server.tokens(" Question: which flight is the cheapest? Answer: flight")
    while len(head) + len(before) + len(tool) + len(after) + len(question) < size:
        after += server.tokens(f" Note {len(after)}: the user prefers morning departures.")
    start = len(head) + len(before)
    tokens = head + before + tool + after + question
    return Prompt(tokens, start, start + len(tool), server.tokens(STUB))


def cross_session(
    server: Server,
    scenario: int,
    prefix: str,
    size: int,
    reference: ExactReference | None,
    cache_salt: bool,
    rng: random.Random,
) -> dict[str, Any]:
    """One scenario: P splices; a plain request and a FORGET in Q must give the exact prefill."""
    tag = f"{prefix}-xs{scenario}"
    prompt = build_prompt(server, nonce(rng), size, tag)
    span = {"start": prompt.start, "end": prompt.end}
    edited = prompt.edited
    p, q, r, e = f"{tag}-P", f"{tag}-Q", f"{tag}-R", f"{tag}-E"
    revision = server.create(p, prompt.tokens)
    splice = {"verb": "splice", "span": span, "replacement": prompt.stub}
    spliced = server.apply(p, revision, [splice])
    splice_arm = server.complete(edited, {"session": p})
    plain = server.complete(edited)
    revision = server.create(q, prompt.tokens)
    forget = {"verb": "forget", "span": span, "replacement": prompt.stub}
    forgot = server.complete(
        edited, {"session": q, "base_revision": revision, "directives": [forget]}
    )
    # An erratum is appended: the session's tokens then are a prefill of themselves.
    revision = server.create(e, prompt.tokens)
    erratum = {"verb": "erratum", "text": ERRATUM}
    server.apply(e, revision, [erratum])
    noted = server.session_tokens(e)
    noted_arm = server.complete(noted, {"session": e})
    definition: dict[str, float] | None = None
    if reference is not None:
        exact = keyed(reference.top(edited), server.text_of)
        exact_noted = keyed(reference.top(noted), server.text_of)
        # A splice that reports a fallback (protocol 6: e.g. ``page_alignment``, part of it
        # re-prefilled) is not its definition, by its own account: counted, not compared.
        if spliced.get("fallback_reason") is None:
            top = reference.splice_top(prompt.tokens, prompt.start, prompt.end, prompt.stub)
            definition = None if top is None else keyed(top, server.text_of)
        how = reference.name
    else:
        salt = f"{tag}-reference" if cache_salt else None
        exact = server.complete(edited, {"session": r}, cache_salt=salt).top
        exact_noted = server.complete(noted, {"session": f"{r}2"}, cache_salt=salt).top
        how = "server prefill, fresh session" + (" and cache_salt" if cache_salt else "")
    bound = prompt.start + len(prompt.stub)
    row: dict[str, Any] = {
        "scenario": scenario,
        "tokens": len(prompt.tokens),
        "edited_tokens": len(edited),
        "span": [prompt.start, prompt.end],
        "stub_tokens": len(prompt.stub),
        "reference": how,
        "exact_top": len(exact),
        "splice": {
            "path": spliced.get("path"),
            "fallback": spliced.get("fallback_reason"),
            "reused": splice_arm.reused,
            **compare(exact, splice_arm.top),
            "definition": None if definition is None else compare(definition, splice_arm.top),
        },
        "erratum": {
            "path": (noted_arm.leyline or {}).get("path"),
            "reused": noted_arm.reused,
            **compare(exact_noted, noted_arm.top),
        },
        "plain": {
            "reused": plain.reused,
            "reused_past_edit": None if plain.reused is None else max(0, plain.reused - bound),
            **compare(exact, plain.top),
        },
        "forget": {
            "path": (forgot.leyline or {}).get("path"),
            "reused": forgot.reused,
            **compare(exact, forgot.top),
        },
    }
    row["leaks"] = leaks(row)
    return row


def leaks(row: Mapping[str, Any]) -> list[str]:
    """What a scenario shows crossing sessions: empty when it passes."""
    out = []
    for arm in ("plain", "forget", "erratum"):
        delta = row[arm]["max_abs_delta"]
        if delta is None or not delta <= TOLERANCE:
            out.append(f"{arm}: max |delta logprob| {delta}")
    definition = row["splice"].get("definition")
    if definition is not None and not definition["max_abs_delta"] <= TOLERANCE:
        out.append(f"splice vs its definition: max |delta logprob| {definition['max_abs_delta']}")
    if row["plain"].get("reused_past_edit"):
        out.append(f"plain: reused {row['plain']['reused_past_edit']} tokens past the edit")
    return out


# -- cross-salt --------------------------------------------------------------------------


def cross_salt(server: Server, trial: int, prefix: str, rng: random.Random) -> list[dict[str, Any]]:
    """Salt X caches two prompts; salt Y, no salt and a plain request send them back."""
    tag = f"{prefix}-cs{trial}"
    # Over two blocks of 128 tokens: whole-block caches have something to reuse.
    body = server.tokens(f" Case {tag}: the escalation notes say refund order 5501 today. " * 12)
    first, second = nonce(rng) + body, nonce(rng) + body
    x, y = f"{tag}-X", f"{tag}-Y"
    rows: list[tuple[str, str | None, int | None]] = []
    for name, tokens in (("x1", first), ("x2", second)):
        got = server.complete(tokens, {"session": f"{tag}-{name}"}, cache_salt=x)
        rows.append((f"salt X caches prompt {name[-1]}", x, got.reused))
    control = server.complete(first, {"session": f"{tag}-x3"}, cache_salt=x)
    rows.append(("control: salt X again", x, control.reused))
    probes = (
        ("session, salt Y", f"{tag}-y", y, first),
        ("session, no salt", f"{tag}-n", None, first),  # after Y: Y's copy is salted too
        ("plain request, no salt", None, None, second),  # its own prompt: nothing public yet
    )
    for how, session, salt, tokens in probes:
        leyline = {"session": session} if session else None
        rows.append((how, salt, server.complete(tokens, leyline, cache_salt=salt).reused))
    return [
        {
            "trial": trial,
            "how": how,
            "salt": salt,
            "reused": reused,
            "probe": not (how.startswith("control") or how.startswith("salt X caches")),
        }
        for how, salt, reused in rows
    ]
