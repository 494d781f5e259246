"""COMPOSE on the live server vs the reference engine's compose on the same weights.

A skill is registered over HTTP (the plugin prefills it and holds it: SGLang locks its
tree path, vLLM keeps a reference on its blocks), a session composes it mid-prompt with a
4-token seam, and a completion turn on the session reads the next-token distribution: the
server's own forward over the KV the plugin built. The reference engine compiles the same
skill and composes it into the same tokens; both run in fp32, so the logprobs must agree
to ``TOLERANCE``. They must also differ from a full prefill of the composed tokens (a
compose is an approximation: without that gap the check could not tell a compose from a
re-prefill), and a plain request of the composed tokens must not find the composed KV
(protocol 3.4: only the session reads it). Both backends run every test here; vLLM caches
whole blocks only, so what a plain request finds is rounded down to a block
(``floor_page``), and it counts the composed sequence's last token, recomputed in context
(protocol 3.1), as prefilled where SGLang counts it reused.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from leyline.protocol.resources import Routes

from ._live import (
    BACKEND,
    TOLERANCE,
    apply,
    create_session,
    edited_session,
    generate,
    max_delta,
    prompt_text,
    record,
    reference_compose_logprobs,
    reference_logprobs,
    session_generate,
    session_tokens,
)
from ._plain import floor_page, generate_ids, idle_used_cache, plain_hit

LAST = 1 if BACKEND == "vllm" else 0
"""The composed sequence's last token: vLLM reports it prefilled (recomputed in context)."""

if TYPE_CHECKING:
    from leyline.engine.engine import Engine

SEAM = 4
RULES = (
    "Rules for this agent: read a file before editing it; run the tests after every edit; "
    "never delete a test to make it pass; keep each change small and explain it in one line."
)


def _register(server: httpx.Client, skill: str, tokens: list[int]) -> dict[str, Any]:
    reply = server.post(Routes.skills, json={"skill": skill, "tokens": tokens})
    assert reply.status_code == 201, reply.text
    return dict(reply.json())


def _turn_top(
    server: httpx.Client, session: str, tokens: list[int]
) -> tuple[dict[int, float], dict[str, Any]]:
    """The session's distribution (by token id) and the turn's ``leyline`` report."""
    got = session_generate(server, session, tokens)
    assert got.report is not None
    return got.top, got.report


def test_compose_matches_the_reference_compose_and_stays_private(
    server: httpx.Client, reference: Engine, report_path: Path | None, page: int
) -> None:
    tokens = list(reference.encode(prompt_text("compose")))
    skill = list(reference.encode(f"{RULES} (rule set {uuid.uuid4().hex[:6]})"))
    skill_id = f"rules-{uuid.uuid4().hex[:8]}"
    info = _register(server, skill_id, skill)
    assert info["num_tokens"] == len(skill)
    at = len(tokens) // 3
    directive = {"verb": "compose", "skill": skill_id, "at": at, "seam_tokens": SEAM}
    session, _, body = edited_session(server, tokens, [directive])
    assert body["path"] == "splice" and body["fallback_reason"] is None, body
    assert [(b["start"], b["end"]) for b in body["composed"]] == [(at, at + len(skill))]
    assert body["prefilled_tokens"] == SEAM + LAST, body  # the seam; the rest reused, rotated
    assert body["rotated_tokens"] == len(skill) - SEAM + len(tokens) - at - LAST, body
    new, _ = session_tokens(server, session)
    assert new == tokens[:at] + skill + tokens[at:]

    got, turn = _turn_top(server, session, new)
    assert turn["path"] == "prefix_hit" and turn["reused_tokens"] == len(new) - 1, turn

    delta = max_delta(got, reference_compose_logprobs(reference, tokens, skill, at, SEAM))
    full = reference_logprobs(reference, new)
    gap = max_delta(got, full)
    # Nobody else reads the composed KV: a plain request of the same tokens finds only
    # the public prefix (whole blocks of it on vLLM) and computes a full prefill.
    plain = generate(server, new)
    plain_delta = max_delta(plain.top, full)
    record(
        report_path, check="compose (K=4, mid-prompt)", max_delta_logprob=delta,
        gap_to_full_prefill=gap, plain_generate_cached=plain.cached_tokens,
        plain_generate_delta_to_full=plain_delta, tokens=len(new), block=len(skill),
    )  # fmt: skip
    assert delta <= TOLERANCE
    assert gap > 10 * TOLERANCE, "the compose should differ from a full prefill"
    assert plain.cached_tokens == floor_page(at, page) and plain_delta <= TOLERANCE

    # A forget past the block: nothing derived from the span stays anywhere, including
    # the public copy of the session from before the compose, where the span sat
    # len(skill) earlier: purged from there, what precedes it kept.
    assert generate(server, tokens).cached_tokens == plain_hit(len(tokens), page)
    _, revision = session_tokens(server, session)
    span = {"start": len(new) - 20, "end": len(new) - 10}
    forget = apply(server, session, revision, [{"verb": "forget", "span": span}])
    assert forget.status_code == 200 and forget.json()["path"] == "reprefill", forget.text
    assert generate(server, tokens).cached_tokens == floor_page(len(tokens) - 20, page)

    assert server.delete(Routes.skill.format(skill=skill_id)).status_code == 204
    session2, base2 = create_session(server, tokens)
    gone = apply(server, session2, base2, [directive])
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "unknown_skill"
    assert session_tokens(server, session2) == (tokens, base2)


CLIENTS = 4


def _compose_client(url: str, tokens: list[int], skill_id: str, at: int) -> dict[str, Any]:
    """One client: a session, a compose, a completion turn on it, then the session deleted."""
    with httpx.Client(base_url=url, timeout=600) as http:
        directive = {"verb": "compose", "skill": skill_id, "at": at, "seam_tokens": SEAM}
        session, _, body = edited_session(http, tokens, [directive])
        new, _ = session_tokens(http, session)
        top, turn = _turn_top(http, session, new)
        assert http.delete(Routes.session.format(session=session)).status_code == 204
        return {"body": body, "turn": turn, "top": top, "tokens": new}


def test_composes_under_load_leak_nothing(
    server: httpx.Client, reference: Engine, report_path: Path | None, page: int
) -> None:
    """Clients compose two skills (one shared by all) into sessions of their own at once,
    beside registrations and a delete; every answer is typed and a splice; one session
    equals the reference compose; once skills and sessions are gone, what the cache holds
    at idle (SGLang's used slots, vLLM's used blocks) is back at its baseline (the holds
    were let go, nothing leaked)."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    url = os.environ["LEYLINE_LIVE_URL"]
    baseline = idle_used_cache(server)
    nonce = uuid.uuid4().hex[:6]
    skills = {
        f"shared-{nonce}": list(reference.encode(f"{RULES} (shared {nonce})")),
        f"own-{nonce}": list(reference.encode(f"Tool manual {nonce}: call read(path) first.")),
    }
    for skill_id, skill in skills.items():
        _register(server, skill_id, skill)
    held = idle_used_cache(server)  # held slots or blocks are neither free nor evictable
    unit = page if BACKEND == "vllm" else 1  # vLLM holds whole blocks, the last partial
    assert held == baseline + sum(-(-len(s) // unit) for s in skills.values()), (baseline, held)
    ids = list(skills)
    prompts = [list(reference.encode(prompt_text(f"compose-load-{i}", lines=6))) for i in range(4)]
    with ThreadPoolExecutor(CLIENTS) as pool:
        runs = [
            pool.submit(_compose_client, url, prompts[i], ids[i % 2], 10 + 7 * i)
            for i in range(CLIENTS)
        ]
        outs = [run.result() for run in runs]
    for out in outs:
        assert out["body"]["path"] == "splice" and out["body"]["fallback_reason"] is None
        assert out["turn"]["reused_tokens"] == len(out["tokens"]) - 1, out["turn"]
    expected = reference_compose_logprobs(reference, prompts[0], skills[ids[0]], 10, SEAM)
    delta = max_delta(outs[0]["top"], expected)
    for skill_id in ids:
        assert server.delete(Routes.skill.format(skill=skill_id)).status_code == 204
    after = idle_used_cache(server)
    record(
        report_path, check="composes under load", clients=CLIENTS, max_delta_logprob=delta,
        used_tokens_before=baseline, used_tokens_while_held=held, used_tokens_after=after,
    )  # fmt: skip
    assert delta <= TOLERANCE
    assert after == baseline, f"KV slots used at idle: {baseline} before, {after} after"


def test_the_sdk_composes_a_registered_skill_in_a_chat(server: httpx.Client) -> None:
    """The agent-side path against the plugin, as against ``leyline serve``: ``SkillLibrary``
    registers a message's block (plain, then anchored after the rendered context) and
    ``LeylineOpenAI`` sends a compose for it in a chat turn; the block's KV is copied."""
    import os

    from ..serve.sdk_compose import chat_with_a_skill

    url = os.environ["LEYLINE_LIVE_URL"]
    assert server.get(Routes.capabilities).json()["skill_anchors"] is True
    for anchored in (False, True):
        skill_id = f"rules-sdk-{uuid.uuid4().hex[:6]}"
        entry, record = chat_with_a_skill(
            url, None, "default", RULES, skill_id=skill_id, anchored=anchored
        )
        assert (entry.info.anchor_tokens > 0) is anchored
        assert record.composed == (entry.skill,) and record.resync is None, record
        assert record.path == "splice"
        # Copied, rotated (on vLLM less the block's last token when it ends the sequence).
        assert (record.rotated_tokens or 0) >= entry.info.num_tokens - 4 - LAST


def test_compose_time_to_first_token_is_recorded(
    server: httpx.Client, reference: Engine, report_path: Path | None, page: int
) -> None:
    """Figures only (timings are not asserted; the machine is shared): a ~400-token skill
    composed at the end of a ~1.5k-token session, then a one-token turn, against the host's
    own plain request of the same tokens with the session's prefix cached (the public
    namespace) and with nothing cached (a fresh ``cache_salt``). Medians of 3, each on fresh
    tokens."""
    import time

    arms: dict[str, list[float]] = {"compose": [], "prefix_cached": [], "nothing_cached": []}
    for i in range(3):
        tokens = list(reference.encode(prompt_text(f"ttft-{i}", lines=60)))
        skill = list(reference.encode(prompt_text(f"ttft-skill-{i}", lines=16)))
        skill_id = f"ttft-{uuid.uuid4().hex[:8]}"
        _register(server, skill_id, skill)
        session, base = create_session(server, tokens)
        directive = {"verb": "compose", "skill": skill_id, "at": len(tokens), "seam_tokens": 16}
        new = tokens + skill
        turn = {"prompt": new, "max_tokens": 1, "temperature": 0, "leyline": {"session": session}}
        t0 = time.perf_counter()
        reply = apply(server, session, base, [directive])
        answer = server.post("/v1/completions", json=turn)
        arms["compose"].append(time.perf_counter() - t0)
        assert reply.json()["path"] == "splice", reply.text
        assert answer.json()["leyline"]["reused_tokens"] == len(new) - 1, answer.text
        t0 = time.perf_counter()
        prefix = generate(server, new).cached_tokens
        arms["prefix_cached"].append(time.perf_counter() - t0)
        assert prefix == floor_page(len(tokens), page)  # the prefix, public
        t0 = time.perf_counter()
        _, fresh = generate_ids(server, new, 1, salt=f"fresh-{uuid.uuid4().hex}")
        arms["nothing_cached"].append(time.perf_counter() - t0)
        assert fresh == 0
        assert server.delete(Routes.skill.format(skill=skill_id)).status_code == 204
    median = {k: sorted(v)[1] for k, v in arms.items()}
    record(
        report_path, check="compose TTFT (s, median of 3)", tokens=len(new), block=len(skill),
        compose_s=round(median["compose"], 3), prefix_cached_s=round(median["prefix_cached"], 3),
        nothing_cached_s=round(median["nothing_cached"], 3),
        speedup_vs_prefix_cached=round(median["prefix_cached"] / median["compose"], 2),
        speedup_vs_nothing_cached=round(median["nothing_cached"] / median["compose"], 2),
    )  # fmt: skip
