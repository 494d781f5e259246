"""``leyline serve``: the OpenAI-compatible server with Leyline directives."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from dataclasses import fields
from typing import Any


def register(commands: Any) -> None:
    parser: argparse.ArgumentParser = commands.add_parser(
        "serve",
        help="start the OpenAI-compatible server (embedded SmolLM2 on CPU by default)",
        description=(
            "Serve /v1/chat/completions and /v1/completions with the `leyline` extension, "
            "the /leyline/v1/ resources, /metrics and /health. With no arguments it loads "
            "the embedded SmolLM2-135M-Instruct (real weights, CPU). OpenAPI docs at /docs."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--model",
        default="smollm2",
        help="'smollm2' (embedded), 'tiny-mla-v2' / 'tiny-mla-v3' (random weights, for tests), "
        "a .gguf file or a Hugging Face model directory (never downloaded)",
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="weights and KV cache dtype (bf16 halves both; RoPE shifts stay fp32)",
    )
    parser.add_argument(
        "--served-model-name",
        default=None,
        help="name reported by /v1/models (default: the model's own)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind")
    parser.add_argument("--port", type=int, default=8000, help="port to bind")
    parser.add_argument(
        "--api-key",
        default=None,
        help="require `Authorization: Bearer KEY` on every route but /health, /server_info "
        "and /model_info (one tenant)",
    )
    parser.add_argument(
        "--api-keys-file",
        default=None,
        metavar="FILE",
        help="one 'TENANT KEY' per line: each key authenticates as its tenant; sessions and "
        "the shared prefix cache are partitioned by tenant (docs/server.md, 'Tenants')",
    )
    parser.add_argument(
        "--worker-name",
        default=None,
        metavar="NAME",
        help="send `X-Leyline-Worker: NAME` on every response, streamed ones included, so "
        "clients behind a router can tell which worker answered (1-128 visible ASCII "
        "characters; default: no header)",
    )
    parser.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )
    limits = parser.add_argument_group("limits (requests past them get typed 4xx errors)")
    limits.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024)
    limits.add_argument("--max-directives", type=int, default=64, help="per request")
    limits.add_argument("--max-replacement-tokens", type=int, default=4096)
    limits.add_argument("--max-session-tokens", type=int, default=8192)
    limits.add_argument(
        "--max-sessions",
        type=int,
        default=64,
        help="idle sessions past this are evicted, least recently used first",
    )
    limits.add_argument(
        "--max-cache-gib",
        type=float,
        default=4.0,
        help="KV bytes of all sessions together (idle ones evicted past it)",
    )
    limits.add_argument(
        "--tenant-max-sessions",
        type=int,
        default=None,
        metavar="N",
        help="sessions one tenant may hold: past it that tenant's own idle sessions are "
        "evicted, never another's (None: only --max-sessions applies)",
    )
    limits.add_argument(
        "--tenant-max-cache-gib",
        type=float,
        default=None,
        metavar="X",
        help="KV one tenant's sessions may hold together: past it that tenant's own idle "
        "sessions are evicted; a session alone past it is refused (None: only "
        "--max-cache-gib applies)",
    )
    limits.add_argument(
        "--prefix-cache-gib",
        type=float,
        default=1.0,
        help="shared prefix cache budget; 0 turns it off",
    )
    limits.add_argument(
        "--release-freed-memory",
        action="store_true",
        help="hand freed KV buffers back to the OS (resident memory then tracks what is in "
        "use, but every splice and generation pays first-touch page faults on its new KV; "
        "by default freed memory stays in the process for the next buffer)",
    )
    limits.add_argument(
        "--max-new-tokens",
        type=int,
        default=256,
        help="completion length when a request names none",
    )
    sched = parser.add_argument_group("scheduling (one model, shared fairly)")
    sched.add_argument(
        "--max-running-jobs",
        type=int,
        default=8,
        metavar="N",
        help="edits and prefills in progress at once, taking turns at prefill chunks so a "
        "short one never waits for a whole long one (1: one after another)",
    )
    sched.add_argument(
        "--max-decode-batch",
        type=int,
        default=32,
        metavar="N",
        help="generations stepped together in one batched decode forward (1: one at a time)",
    )
    sched.add_argument(
        "--decode-share",
        type=float,
        default=0.0,
        metavar="S",
        help="model time running generations may take between two prefill slices, as a "
        "share in [0, 1) (0: one decode step per slice; 0.5: as long as the slice took)",
    )
    sched.add_argument(
        "--schedule",
        choices=("srpt", "las"),
        default="srpt",
        help="which waiting edit or prefill takes the model next: srpt, the one with the "
        "least estimated work left (tokens to run times the measured seconds per token; "
        "short replies also finish before the next prefill chunk); las, the one that has "
        "held it least",
    )
    sched.add_argument(
        "--schedule-aging",
        type=float,
        default=0.1,
        metavar="A",
        help="srpt: seconds taken off a waiting job's estimate per second it waits, so long "
        "jobs are not starved (0: pure srpt)",
    )
    sched.add_argument(
        "--prefill-chunk",
        type=int,
        default=512,
        metavar="TOKENS",
        help="tokens a prefill runs per forward; other work may run between chunks",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from leyline.serve.serve import build_app
        from leyline.serve.settings import ServerSettings, load_api_keys
    except ModuleNotFoundError as exc:  # an SDK-only install has no server stack
        print(
            f"leyline serve: needs the server extras ({exc.name} is not installed): "
            "pip install 'leyline[server]'",
            file=sys.stderr,
        )
        return 2

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    retained = not args.release_freed_memory and _retain_freed_memory()
    try:
        # Every setting has a flag of its name, but those given in other units or a file.
        named = {f.name: getattr(args, f.name) for f in fields(ServerSettings) if f.name in args}
        settings = ServerSettings(
            **named,
            api_keys=load_api_keys(args.api_keys_file) if args.api_keys_file else (),
            max_cache_bytes=int(args.max_cache_gib * 1024**3),
            tenant_max_cache_bytes=_gib_or_none(args.tenant_max_cache_gib),
        )
        t0 = time.perf_counter()
        app = build_app(settings, prefix_cache_bytes=int(args.prefix_cache_gib * 1024**3))
    except (ValueError, FileNotFoundError) as exc:
        print(f"leyline serve: {exc}", file=sys.stderr)
        return 2
    engine = app.state.engine
    fused = f" ({engine.fused_layers} fused for few rows)" * bool(engine.fused_layers)
    lean = f"; {engine.lean_layers} decoder layers on the lean forward{fused}" * bool(
        engine.lean_layers
    )
    print(
        f"leyline: {engine.loaded.label} ready in {time.perf_counter() - t0:.1f}s; "
        f"serving on http://{settings.host}:{settings.port} (docs at /docs)"
        f"{'' if retained else '; freed memory released to the OS'}; "
        f"{engine.packing.describe()}{lean}",
        file=sys.stderr,
    )
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level)
    return 0


def _retain_freed_memory() -> bool:
    # Process-wide, hence here and not in build_app: an embedding application decides its own.
    from leyline.engine.kv.allocator import retain_freed_memory

    return retain_freed_memory()


def _gib_or_none(gib: float | None) -> int | None:
    return None if gib is None else int(gib * 1024**3)
