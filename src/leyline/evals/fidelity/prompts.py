"""Deterministic agent transcripts whose old tool output is the span a splice replaces.

Each prompt is a chat transcript (SmolLM2's ``<|im_start|>`` format): system, a user task,
an assistant tool call, tool output 1 (the SPAN), an assistant remark, tool output 2 and
an unfinished assistant sentence whose next token is what the eval compares. The span is
replaced by a stub such as ``[tool output removed: 14 lines from `cat config/app.yaml`]``.

The last sentence asks about
- ``removed``: a fact that only the span holds (full context can answer, re-prefill cannot),
- ``kept``: a fact in tool output 2, downstream of the span (both can),
- ``continue``: nothing in particular (what the agent does next).

Everything comes from ``random.Random(f"{seed}:{index}")``: the same seed gives the same
prompts on every machine, and prompt ``i`` does not depend on how many are asked for.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

QuestionKind = Literal["removed", "kept", "continue"]
KINDS: tuple[QuestionKind, ...] = ("removed", "kept", "continue")
_KIND_WEIGHTS = (5, 3, 2)

SERVICES = ("billing-api", "auth-gateway", "report-worker", "search-indexer", "mail-relay")
MODULES = ("ledger", "invoices", "sessions", "tokens", "scheduler", "exporter", "cache", "quota")
FUNCS = ("reconcile", "parse_header", "flush_batch", "load_rules", "retry_send", "merge_rows")
HOSTS = ("db-main", "db-replica", "redis-cache", "queue-broker", "object-store")
STATUSES = ("suspended", "active", "pending", "locked", "expired", "archived")
PLANS = ("enterprise", "starter", "team", "trial")
WORDS = ("alpha", "harbor", "copper", "meadow", "signal", "falcon", "granite", "willow")


@dataclass(frozen=True, slots=True)
class Fact:
    """Something a tool output states: ``"<subject> is <answer>"``."""

    subject: str
    answer: str


@dataclass(frozen=True, slots=True)
class ToolOutput:
    command: str
    text: str
    facts: tuple[Fact, ...]

    @property
    def lines(self) -> int:
        return self.text.count("\n") + 1


@dataclass(frozen=True, slots=True)
class Prompt:
    """A transcript in three parts; the span is the whole content of the first tool turn."""

    id: str
    kind: QuestionKind
    prefix: str
    span: str
    stub: str
    suffix: str
    answer: str | None
    """The fact the last sentence asks for (``removed`` / ``kept``), else None."""


def _config(r: random.Random) -> ToolOutput:
    svc, host = r.choice(SERVICES), r.choice(HOSTS)
    port, timeout, pool = r.randrange(3000, 9900), r.randrange(5, 120), r.randrange(4, 64)
    lines = [
        f"# config/{svc}.yaml",
        "service:",
        f"  name: {svc}",
        f"  port: {port}",
        f"  timeout_seconds: {timeout}",
        f"  retries: {r.randrange(1, 6)}",
        f"  log_level: {r.choice(('debug', 'info', 'warning'))}",
        "database:",
        f"  host: {host}",
        f"  pool_size: {pool}",
        f"  statement_timeout_ms: {r.randrange(500, 30000)}",
        "features:",
    ] + [f"  {w}_enabled: {r.choice(('true', 'false'))}" for w in r.sample(WORDS, 2)]
    facts = (
        Fact(f"the port of {svc}", str(port)),
        Fact("the database host", host),
        Fact("the timeout in seconds", str(timeout)),
    )
    return ToolOutput(f"cat config/{svc}.yaml", "\n".join(lines), facts)


def _grep(r: random.Random) -> ToolOutput:
    func = r.choice(FUNCS)
    home = r.choice(MODULES)
    lines = [f"src/{home}/core.py:{r.randrange(20, 400)}:def {func}(batch, tolerance=0.02):"]
    for _ in range(r.randrange(3, 6)):
        mod = r.choice(MODULES)
        lines.append(
            f"src/{mod}/{r.choice(('api', 'jobs', 'views'))}.py:{r.randrange(10, 900)}:"
            f"    result = {func}(rows[{r.randrange(0, 9)}], tolerance={r.randrange(1, 9)}e-2)"
        )
    r.shuffle(lines)
    return ToolOutput(f"grep -rn {func} src/", "\n".join(lines), (Fact(f"{func} lives in", home),))


def _pytest(r: random.Random) -> ToolOutput:
    mod = r.choice(MODULES)
    tests = [f"test_{w}_{mod}" for w in r.sample(WORDS, 4)]
    failing = r.choice(tests)
    got, want = r.randrange(10, 99), r.randrange(10, 99)
    lines = ["============ test session starts ============", f"collected {len(tests)} items", ""]
    lines += [f"tests/test_{mod}.py::{t} {'FAILED' if t == failing else 'PASSED'}" for t in tests]
    lines += [
        "",
        f"_____________ {failing} _____________",
        f"    assert compute_total(rows) == {want}",
        f"E   assert {got} == {want}",
        f"============ 1 failed, {len(tests) - 1} passed in "
        f"{r.randrange(1, 9)}.{r.randrange(10, 99)}s",
    ]
    facts = (Fact("the failing test", failing), Fact("the value it got", str(got)))
    return ToolOutput(f"pytest tests/test_{mod}.py", "\n".join(lines), facts)


def _listing(r: random.Random) -> ToolOutput:
    names = [f"{m}.py" for m in r.sample(MODULES, 4)] + ["README.md"]
    sizes = {n: r.randrange(200, 9000) for n in names}
    biggest = max(sizes, key=lambda n: sizes[n])
    lines = [f"total {sum(sizes.values()) // 1024}"]
    lines += [
        f"-rw-r--r-- 1 agent staff {sizes[n]:>5} Mar {r.randrange(1, 28):>2} "
        f"10:{r.randrange(10, 59)} {n}"
        for n in names
    ]
    return ToolOutput("ls -l src/", "\n".join(lines), (Fact("the largest file", biggest),))


def _api(r: random.Random) -> ToolOutput:
    uid, status, plan = r.randrange(1000, 9999), r.choice(STATUSES), r.choice(PLANS)
    body = [
        "HTTP/1.1 200 OK",
        "content-type: application/json",
        "",
        "{",
        f'  "user_id": {uid},',
        f'  "status": "{status}",',
        f'  "plan": "{plan}",',
        f'  "seats": {r.randrange(1, 200)},',
        f'  "region": "{r.choice(("eu-west-1", "us-east-2", "ap-south-1"))}",',
        '  "invoices": [',
    ]
    body += [
        f'    {{"id": "inv-{r.randrange(10000, 99999)}", "amount": {r.randrange(10, 999)}.'
        f'{r.randrange(10, 99)}, "paid": {r.choice(("true", "false"))}}},'
        for _ in range(r.randrange(1, 4))
    ]
    body += ["  ]", "}"]
    facts = (Fact(f"the status of user {uid}", status), Fact(f"the plan of user {uid}", plan))
    return ToolOutput(f"curl -s api/users/{uid}", "\n".join(body), facts)


def _log(r: random.Random) -> ToolOutput:
    code = f"E{r.randrange(1000, 9999)}"
    worker = f"worker-{r.randrange(1, 9)}"
    lines = []
    bad = r.randrange(1, 5)
    for i in range(r.randrange(5, 9)):
        stamp = f"2024-03-{r.randrange(10, 28)}T{r.randrange(0, 23):02d}:{r.randrange(0, 59):02d}"
        if i == bad:
            lines.append(f"{stamp} ERROR {worker} job failed code={code} retrying in 30s")
        else:
            lines.append(
                f"{stamp} INFO worker-{r.randrange(1, 9)} processed batch {r.randrange(100, 999)} "
                f"rows={r.randrange(10, 5000)}"
            )
    facts = (Fact("the error code", code), Fact("the worker that failed", worker))
    return ToolOutput(f"tail -n 40 logs/{r.choice(SERVICES)}.log", "\n".join(lines), facts)


def _source(r: random.Random) -> ToolOutput:
    mod = r.choice(MODULES)
    batch, limit = 2 ** r.randrange(4, 10), r.randrange(10, 500)
    lines = [
        f'"""{mod.capitalize()} helpers."""',
        "",
        f"MAX_BATCH = {batch}",
        f"RATE_LIMIT = {limit}",
        "",
    ]
    for func in r.sample(FUNCS, 2):
        lines += [
            f"def {func}(rows, tolerance=0.02):",
            f'    """{func.replace("_", " ").capitalize()} for {mod}."""',
            f"    return [row * {r.randrange(2, 9)} for row in rows[:MAX_BATCH]]",
            "",
        ]
    facts = (Fact("MAX_BATCH", str(batch)), Fact("RATE_LIMIT", str(limit)))
    return ToolOutput(f"cat src/{mod}/core.py", "\n".join(lines), facts)


TOOLS: tuple[Callable[[random.Random], ToolOutput], ...] = (
    _config,
    _grep,
    _pytest,
    _listing,
    _api,
    _log,
    _source,
)

_TASKS = (
    "The nightly job for {svc} fails with a timeout. Find the cause and propose a fix.",
    "Users report wrong totals from {svc}. Find which module is responsible.",
    "Prepare a short status note on {svc} for the on-call engineer.",
    "The deploy of {svc} was rolled back. Work out what changed and what broke.",
)
_REMARKS = (
    "That is a lot of output. Let me look at one more thing before answering.",
    "OK. I need more context, so I will check another source.",
    "Noted. Next I want to compare this with a second tool result.",
)
_CONTINUE = ("Next, I will", "Based on these results, the next step is to", "To summarise so far,")


def _turn(role: str, text: str) -> str:
    return f"<|im_start|>{role}\n{text}<|im_end|>\n"


def make_prompt(seed: int, index: int) -> Prompt:
    r = random.Random(f"{seed}:{index}")
    first, second = r.sample(TOOLS, 2)
    out1, out2 = first(r), second(r)
    kind: QuestionKind = r.choices(KINDS, weights=_KIND_WEIGHTS)[0]
    svc = r.choice(SERVICES)
    prefix = (
        _turn(
            "system",
            "You are a coding agent. Call one tool per turn and answer precisely.",
        )
        + _turn("user", r.choice(_TASKS).format(svc=svc))
        + _turn("assistant", f"I will start by running `{out1.command}`.")
        + "<|im_start|>tool\n"
    )
    stub = f"[tool output removed: {out1.lines} lines from `{out1.command}`]"
    answer: str | None = None
    if kind == "continue":
        final = r.choice(_CONTINUE)
    else:
        fact = r.choice((out1 if kind == "removed" else out2).facts)
        source = "first" if kind == "removed" else "second"
        final = f"According to the {source} tool output, {fact.subject} is"
        answer = fact.answer
    suffix = (
        "<|im_end|>\n"
        + _turn("assistant", f"{r.choice(_REMARKS)} Running `{out2.command}`.")
        + _turn("tool", out2.text)
        + f"<|im_start|>assistant\n{final}"
    )
    return Prompt(f"p{index:04d}", kind, prefix, out1.text, stub, suffix, answer)


def make_prompts(seed: int, count: int) -> list[Prompt]:
    return [make_prompt(seed, i) for i in range(count)]
