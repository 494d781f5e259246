"""`leyline serve` under load: splice vs re-prefill arms at several concurrencies, over HTTP.

Each simulated client replays the demo's tool-using episode (real tools on the bundled
sample project, scripted calls; ``evals/demo/``) through ``LeylineOpenAI`` with the paper's
policy ``TruncateOldToolOutputs(keep_last=2)``, in two sessions: the splice arm (the
policy's edits as directives) and the re-prefill arm (the same edited messages, no
directives). A client asks both arms each turn (alternating who goes first), so both arms
share the same queue and the same machine noise; ``c`` clients run at once.

TTFT is client-side: under the middleware (which does not stream) a thin client shim sends
each request with ``stream=True`` and times the first SSE chunk. The server starts a stream
only after the first token, so that is queue wait + edit + prefill + one token, as the
client sees it. The shim reassembles the stream into the ``ChatCompletion`` (with its
``leyline`` report) that the middleware expects.

The server runs all model work on one worker thread, so concurrency measures queueing:
latency grows about linearly with ``c``; the arms' ratio is the figure to read.

Also measured: HTTP + protocol overhead per request against the same call made
in-process on the server's own objects (chat with ``max_tokens=1`` on a warm session,
tokenize, and a splice on identical sessions).

Run: ``.venv/bin/python evals/bench_server.py`` (``--quick`` for a smoke run, ``--help``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import httpx
import openai
from openai.types.chat import ChatCompletion
from tqdm import tqdm

from leyline.evals.demo.script import SCRIPT, opening, tool_turn
from leyline.evals.demo.tools import TOOL_SPECS, ProjectTools, sample_project
from leyline.policies import LeylineOpenAI, TruncateOldToolOutputs
from leyline.protocol.resources import Routes

ARMS = ("splice", "reprefill")
QUEUE_NOTE = (
    "The server runs all model work on ONE worker thread: requests queue, so concurrency "
    "measures queueing (latency ~ c x work), not parallel throughput. Read the ratios."
)


@dataclass(frozen=True, slots=True)
class Settings:
    levels: tuple[int, ...] = (1, 4, 8, 16)
    turns: int = 4
    keep_last: int = 2
    max_tokens: int = 4
    overhead_reps: int = 15
    model: str = "smollm2"


@dataclass(frozen=True, slots=True)
class Sample:
    """One chat request of one arm, as the client saw it and as the server reported it."""

    level: int
    client: int
    turn: int
    arm: str
    e2e_s: float
    """Wall time of ``create`` through the middleware (its /tokenize round trip included)."""
    ttft_s: float
    path: str | None
    reused: int
    prefilled: int
    rotated: int
    directives: int


# -- a client shim that streams under the (non-streaming) middleware ----------------------


@dataclass
class Clock:
    """Where a client's shims put the TTFT of its last chat request."""

    last_ttft_s: float = 0.0


class _StreamedCompletions:
    def __init__(self, inner: openai.OpenAI, clock: Clock) -> None:
        self._inner, self._clock = inner, clock

    def create(self, **kwargs: Any) -> ChatCompletion:
        kwargs.pop("stream", None)
        t0 = time.perf_counter()
        stream = self._inner.chat.completions.create(
            stream=True, stream_options={"include_usage": True}, **kwargs
        )
        first: float | None = None
        content: list[str] = []
        calls: list[dict[str, Any]] = []
        finish, usage, leyline, meta = "stop", None, None, {}
        for chunk in stream:
            first = time.perf_counter() - t0 if first is None else first
            meta = {"id": chunk.id, "created": chunk.created, "model": chunk.model}
            leyline = (chunk.model_extra or {}).get("leyline", leyline)
            usage = chunk.usage.model_dump() if chunk.usage else usage
            for choice in chunk.choices:
                finish = choice.finish_reason or finish
                content.append(choice.delta.content or "")
                calls += [c.model_dump(exclude_none=True) for c in choice.delta.tool_calls or []]
        self._clock.last_ttft_s = first if first is not None else time.perf_counter() - t0
        return _assemble(meta, "".join(content), calls, finish, usage, leyline)


def _assemble(
    meta: dict[str, Any],
    text: str,
    calls: list[dict[str, Any]],
    finish: str,
    usage: object,
    leyline: object,
) -> ChatCompletion:
    """The non-streamed response the server would have sent (same content rule)."""
    for call in calls:
        call.pop("index", None)
    message: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
    if calls:
        message["tool_calls"] = calls
    body = {
        **meta,
        "object": "chat.completion",
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        "usage": usage,
        "leyline": leyline,
    }
    return ChatCompletion.model_validate(body)


class TimedClient:
    """Looks like ``openai.OpenAI`` to ``LeylineOpenAI``; chat requests stream underneath."""

    def __init__(self, inner: openai.OpenAI, clock: Clock) -> None:
        self.inner, self.clock = inner, clock
        self.chat = SimpleNamespace(completions=_StreamedCompletions(inner, clock))

    def with_options(self, **kwargs: Any) -> TimedClient:
        return TimedClient(self.inner.with_options(**kwargs), self.clock)

    def __getattr__(self, name: str) -> Any:  # base_url, get, post, delete: the real client
        return getattr(self.inner, name)


# -- the replay ------------------------------------------------------------------------------


class Client:
    """One simulated agent: the same episode in both arms, turn by turn."""

    def __init__(self, base: openai.OpenAI, settings: Settings, tag: str) -> None:
        self.settings = settings
        self.tools = ProjectTools(sample_project())
        self.messages: list[dict[str, Any]] = opening()
        self.clocks = {arm: Clock() for arm in ARMS}
        policy = TruncateOldToolOutputs(keep_last=settings.keep_last)
        self.arms = {
            arm: LeylineOpenAI(
                cast(openai.OpenAI, TimedClient(base, self.clocks[arm])),
                policy,
                session=f"{tag}-{arm}",
                directives=arm == "splice",
            )
            for arm in ARMS
        }

    def replay(self, level: int, index: int, tick: Callable[[], None]) -> list[Sample]:
        out: list[Sample] = []
        try:
            for turn in range(1, self.settings.turns + 1):
                self._add_tool_turn(turn)
                order = ARMS if (turn + index) % 2 else ARMS[::-1]  # alternate who goes first
                for arm in order:
                    out.append(self._ask(level, index, turn, arm))
                    tick()
        finally:
            for client in self.arms.values():
                client.close()
        return out

    def _add_tool_turn(self, turn: int) -> None:
        self.messages += tool_turn(self.tools.run, turn)

    def _ask(self, level: int, index: int, turn: int, arm: str) -> Sample:
        client = self.arms[arm]
        t0 = time.perf_counter()
        client.chat.completions.create(
            model=self.settings.model,
            messages=self.messages,
            tools=TOOL_SPECS,
            max_tokens=self.settings.max_tokens,
            temperature=0,
        )
        e2e = time.perf_counter() - t0
        r = client.records[-1]
        return Sample(
            level=level,
            client=index,
            turn=turn,
            arm=arm,
            e2e_s=e2e,
            ttft_s=self.clocks[arm].last_ttft_s,
            path=r.path,
            reused=r.reused_tokens or 0,
            prefilled=r.prefilled_tokens or 0,
            rotated=r.rotated_tokens or 0,
            directives=r.directives,
        )


def run_level(
    base: openai.OpenAI, settings: Settings, level: int, bar: tqdm[Any], run_id: str
) -> list[Sample]:
    lock = threading.Lock()

    def tick() -> None:
        with lock:
            bar.update(1)

    clients = [Client(base, settings, f"{run_id}-c{level}-{i}") for i in range(level)]
    with ThreadPoolExecutor(max_workers=level) as pool:
        futures = [pool.submit(c.replay, level, i, tick) for i, c in enumerate(clients)]
        return [s for f in futures for s in f.result()]


# -- statistics ------------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100)."""
    xs = sorted(values)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(samples: list[Sample]) -> dict[str, Any]:
    """Per level and arm: e2e and TTFT p50/p90 (ms), hit rate; re-prefill/splice p50 ratios."""
    table: dict[str, Any] = {}
    for level in sorted({s.level for s in samples}):
        row: dict[str, Any] = {}
        for arm in ARMS:
            mine = [s for s in samples if s.level == level and s.arm == arm]
            reused = sum(s.reused for s in mine)
            total = reused + sum(s.prefilled for s in mine)
            e2e = [s.e2e_s * 1e3 for s in mine]
            ttft = [s.ttft_s * 1e3 for s in mine]
            row[arm] = {
                "requests": len(mine),
                "e2e_p50_ms": pct(e2e, 50),
                "e2e_p90_ms": pct(e2e, 90),
                "ttft_p50_ms": pct(ttft, 50),
                "ttft_p90_ms": pct(ttft, 90),
                "hit_rate": reused / total if total else float("nan"),
                "prefilled_tokens": total - reused,
                "splice_paths": sum(s.path == "splice" for s in mine),
            }
        for key in ("e2e_p50_ms", "ttft_p50_ms"):
            row[f"ratio_{key}"] = row["reprefill"][key] / row["splice"][key]
        table[str(level)] = row
    return table


# -- HTTP + protocol overhead against in-process calls --------------------------------------


@dataclass
class Overhead:
    http_ms: list[float] = field(default_factory=list)
    inproc_ms: list[float] = field(default_factory=list)

    def summary(self) -> dict[str, float]:
        http, inproc = statistics.median(self.http_ms), statistics.median(self.inproc_ms)
        paired = [h - i for h, i in zip(self.http_ms, self.inproc_ms, strict=True)]
        return {
            "http_p50_ms": http,
            "inproc_p50_ms": inproc,
            "overhead_p50_ms": statistics.median(paired),
        }


def _ms(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def measure_overhead(app: Any, base_url: str, reps: int, run_id: str) -> dict[str, Any]:
    """Same work over HTTP and in-process, alternated rep by rep (paired differences).

    In-process = the call the route makes, submitted to the server's model worker through
    ``LeylineService.run`` (same thread, same queue hop), without HTTP, JSON or pydantic.
    Nothing else is in flight.
    """
    from leyline.server_adapter.http.openai_types import ChatCompletionRequest

    service = app.state.service
    loop = asyncio.new_event_loop()

    def on_worker(fn: Callable[[], object]) -> Callable[[], object]:
        return lambda: loop.run_until_complete(service.run(fn))

    messages = opening() + _tool_turns(4)
    session = f"{run_id}-ovh"
    body = {
        "model": "smollm2",
        "messages": messages,
        "tools": TOOL_SPECS,
        "max_tokens": 1,
        "temperature": 0,
        "leyline": {"session": session},
    }
    request = ChatCompletionRequest.model_validate(body)
    renderer = service.require_renderer()
    render = partial(renderer.render, request.messages, request.tools, add_generation_prompt=True)
    tok_body = {"messages": messages, "tools": TOOL_SPECS}
    info_url = Routes.session.format(session=session)
    pairs: dict[str, tuple[Callable[[], object], Callable[[], object]]] = {}
    results: dict[str, Overhead] = {}
    with httpx.Client(base_url=base_url.removesuffix("/v1"), timeout=300) as http:
        http.post("/v1/chat/completions", json=body).raise_for_status()  # warm the session
        pairs = {
            "session_info": (
                partial(http.get, info_url),
                lambda: service.session_info(service.sessions.get(session)),
            ),
            "tokenize": (partial(http.post, Routes.tokenize, json=tok_body), on_worker(render)),
            "chat_max_tokens_1": (
                partial(http.post, "/v1/chat/completions", json=body),
                on_worker(partial(service.chat, request)),
            ),
        }
        results = {name: Overhead() for name in [*pairs, "splice_directive"]}
        for _ in tqdm(range(reps), desc="overhead", leave=False):
            for name, (over_http, in_process) in pairs.items():
                results[name].http_ms.append(_ms(over_http))
                results[name].inproc_ms.append(_ms(in_process))
        tokens = list(render().tokens)
        splice = _splice_pair(http, service, tokens, run_id, on_worker)
        # Fewer reps: each one first prefills a fresh session over HTTP (not timed).
        for i in tqdm(range(max(1, reps // 3)), desc="overhead splice", leave=False):
            splice(i, results["splice_directive"])
        http.delete(info_url)
    loop.close()
    return {
        "what": {
            "session_info": "GET /leyline/v1/sessions/ID vs LeylineService.session_info "
            "(no model work: the bare HTTP + JSON cost)",
            "tokenize": "POST /leyline/v1/tokenize (messages + tools) vs ChatRenderer.render",
            "chat_max_tokens_1": "POST /v1/chat/completions (warm session, same messages, "
            "1 token) vs LeylineService.chat on the same parsed request",
            "splice_directive": "POST .../directives (one splice, no generation) vs "
            "SessionCache.apply_directives on a fork of an identical session",
        },
        "prompt_tokens": len(tokens),
        **{name: o.summary() | asdict(o) for name, o in results.items()},
    }


def _splice_pair(
    http: httpx.Client,
    service: Any,
    tokens: list[int],
    run_id: str,
    on_worker: Callable[[Callable[[], object]], Callable[[], object]],
) -> Callable[[int, Overhead], None]:
    """One rep: a ~1/4-context span replaced by a stub, on two sessions of the same tokens."""
    from leyline.protocol import SpliceDirective

    n = len(tokens)
    span = {"start": n // 3, "end": n // 3 + n // 4}
    directive = {"verb": "splice", "span": span, "replacement": "[evicted: tool output]"}
    batch = [SpliceDirective.model_validate(directive)]
    base = service.engine.create_session(f"{run_id}-ovh-base")
    base.prefill(tokens)

    def rep(i: int, out: Overhead) -> None:
        sid = f"{run_id}-ovh-http-{i}"
        info = http.post(Routes.sessions, json={"session": sid, "tokens": tokens}).json()
        apply = {"base_revision": info["revision"], "directives": [directive]}
        out.http_ms.append(
            _ms(partial(http.post, Routes.directives.format(session=sid), json=apply))
        )
        http.delete(Routes.session.format(session=sid))
        fork = base.fork(f"{run_id}-ovh-fork-{i}")
        work = partial(fork.apply_directives, batch, base_revision=fork.revision)
        out.inproc_ms.append(_ms(on_worker(work)))
        service.engine.close_session(fork.id)

    return rep


def _tool_turns(turns: int) -> list[dict[str, Any]]:
    tools = ProjectTools(sample_project())
    return [m for turn in range(1, turns + 1) for m in tool_turn(tools.run, turn)]


# -- the server ------------------------------------------------------------------------------


@contextmanager
def server(args: argparse.Namespace) -> Iterator[tuple[str, Any]]:
    """(base URL, the app or None): the embedded `leyline serve`, or ``--base-url``."""
    if args.base_url:
        yield args.base_url, None
        return
    from leyline.evals.demo.server import EmbeddedServer

    # The shared prefix cache is off (the demo's setting): each arm reuses only its session.
    with EmbeddedServer(args.model, max_new_tokens=args.max_tokens) as embedded:
        yield embedded.base_url, embedded.app


# -- report ---------------------------------------------------------------------------------


def print_table(table: dict[str, Any], overhead: dict[str, Any] | None) -> None:
    print(f"\n{QUEUE_NOTE}")
    print("e2e = chat call through LeylineOpenAI; TTFT = first streamed chunk (client side)")
    head = (
        f"{'c':>3} {'arm':<10} {'reqs':>5} {'e2e p50':>8} {'p90':>7} "
        f"{'TTFT p50':>9} {'p90':>7} {'hit rate':>9} {'splices':>8}"
    )
    print(head + "\n" + "-" * len(head))
    for level, row in table.items():
        for arm in ARMS:
            a = row[arm]
            print(
                f"{level:>3} {arm:<10} {a['requests']:>5} {a['e2e_p50_ms']:>6.0f}ms "
                f"{a['e2e_p90_ms']:>5.0f}ms {a['ttft_p50_ms']:>7.0f}ms {a['ttft_p90_ms']:>5.0f}ms "
                f"{a['hit_rate']:>8.1%} {a['splice_paths']:>8}"
            )
        print(
            f"{'':>3} re-prefill / splice: e2e p50 {row['ratio_e2e_p50_ms']:.2f}x, "
            f"TTFT p50 {row['ratio_ttft_p50_ms']:.2f}x"
        )
    if overhead is None:
        print("\nHTTP overhead: not measured (needs the embedded server, not --base-url)")
        return
    print(f"\nHTTP + protocol overhead per request (paired medians, {overhead['prompt_tokens']}")
    print("prompt tokens; in-process = the same call on the model worker):")
    for name in ("session_info", "tokenize", "chat_max_tokens_1", "splice_directive"):
        o = overhead[name]
        print(
            f"  {name:<18} http {o['http_p50_ms']:7.1f} ms  in-process {o['inproc_p50_ms']:7.1f} ms"
            f"  overhead {o['overhead_p50_ms']:+6.1f} ms"
        )


def plot(table: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = [int(k) for k in table]
    fig, ax = plt.subplots(figsize=(6, 4))
    for arm, color in zip(ARMS, ("tab:blue", "tab:orange"), strict=True):
        for key, style in (("e2e_p50_ms", "-o"), ("ttft_p50_ms", "--x")):
            ys = [table[str(c)][arm][key] for c in levels]
            ax.plot(levels, ys, style, color=color, label=f"{arm} {key.split('_')[0]} p50")
    ax.set(xlabel="concurrent clients", ylabel="ms", title="leyline serve: p50 latency")
    ax.set_xticks(levels)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- main ------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="levels 1,4, 3 turns, 5 overhead reps")
    p.add_argument("--levels", help="concurrency levels, comma-separated (default 1,4,8,16)")
    p.add_argument("--turns", type=int, help=f"turns per episode, 1..{len(SCRIPT)} (default 4)")
    p.add_argument("--max-tokens", type=int, default=4, help="generated tokens per request")
    p.add_argument("--keep-last", type=int, default=2, help="TruncateOldToolOutputs keep_last")
    p.add_argument("--overhead-reps", type=int, help="reps per overhead pair (default 15)")
    p.add_argument("--base-url", help="benchmark this server instead of the embedded one")
    p.add_argument("--api-key", default="-", help="API key for --base-url")
    p.add_argument("--model", default="smollm2", help="model to load / name in requests")
    p.add_argument("--out", type=Path, help="output folder (default results/bench-server-TS)")
    p.add_argument("--json", type=Path, help="also write the raw figures to this file")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    args = p.parse_args(argv)
    quick = args.quick
    args.levels = args.levels or ("1,4" if quick else "1,4,8,16")
    args.turns = args.turns or (3 if quick else 4)
    args.overhead_reps = (
        args.overhead_reps if args.overhead_reps is not None else (5 if quick else 15)
    )
    if not 1 <= args.turns <= len(SCRIPT):
        p.error(f"--turns must be in 1..{len(SCRIPT)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    levels = tuple(int(x) for x in args.levels.split(","))
    settings = Settings(levels, args.turns, args.keep_last, args.max_tokens, args.overhead_reps)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out_dir = args.out or Path("results") / f"bench-server-{stamp}"
    out_dir.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    t_start = time.perf_counter()
    with ExitStack() as stack:
        base_url, app = stack.enter_context(server(args))
        base = openai.OpenAI(base_url=base_url, api_key=args.api_key, timeout=600, max_retries=0)
        _warm(base, settings)
        total = 2 * settings.turns * sum(levels)
        samples: list[Sample] = []
        with tqdm(total=total, desc="requests", unit="req") as bar:
            for level in levels:
                bar.set_postfix(c=level)
                samples += run_level(base, settings, level, bar, f"bench-{stamp}")
        overhead = None
        if app is not None and settings.overhead_reps > 0:
            overhead = measure_overhead(app, base_url, settings.overhead_reps, f"bench-{stamp}")
    table = summarize(samples)
    wall = time.perf_counter() - t_start
    print_table(table, overhead)
    document: dict[str, Any] = {
        "settings": asdict(settings) | {"base_url": args.base_url or "embedded"},
        "note": QUEUE_NOTE,
        "machine": {
            "cpus": os.cpu_count(),
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
            "python": sys.version.split()[0],
        },
        "wall_s": wall,
        "summary": table,
        "overhead": overhead,
        "samples": [asdict(s) for s in samples],
    }
    text = json.dumps(document, indent=2)
    (out_dir / "bench_server.json").write_text(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text)
    if not args.no_plot:
        plot(table, out_dir / "bench_server.png")
    load = os.getloadavg()[0]
    print(f"\n{wall:.0f} s wall, load average {load:.2f} on {os.cpu_count()} CPUs -> {out_dir}")
    return 0


def _warm(base: openai.OpenAI, settings: Settings) -> None:
    """One stateless request first: the first forward pays one-time setup costs."""
    base.chat.completions.create(
        model=settings.model,
        messages=opening(),
        max_tokens=1,
        temperature=0,
    )


if __name__ == "__main__":
    sys.exit(main())
