#!/usr/bin/env bash
# Build the environment of the SGLang plugin's CPU tests (idempotent; prints each step).
#
#   bash scripts/sglang/setup_env.sh      # -> .venv-sglang/ in the repository root
#
# `pip install sglang` resolves the whole CUDA stack (torch 2.14.1, ~6 GB). The memory-cache
# classes the plugin drives (KV pools, allocators, radix trees) import and run on CPU torch,
# so: the CPU torch wheel first, then sglang with --no-deps, then the small pure-Python
# modules it imports, with the pins that matter. PyPI's torchvision fails beside CPU torch;
# sglang imports it only for multimodal preprocessing, and the tests put a stand-in on their
# own path (tests/sglang/_stubs), never into site-packages. Leyline goes in editable and
# without extras, plus the few packages its engine modules import. The same venv runs a live
# CPU server (scripts/sglang/live_server.sh) with five more packages.
#
# Environment overrides:
#   LEYLINE_SGLANG_VENV   where the venv goes      (default: <repo>/.venv-sglang)
#   PYTHON311             the interpreter to use   (default: pyenv's 3.11, else python3.11)
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
venv=${LEYLINE_SGLANG_VENV:-$root/.venv-sglang}
say() { printf '[sglang setup_env] %s\n' "$*"; }

torch_pin=torch==2.13.0
nodeps=(sglang==0.5.23)
# What sglang's memory-cache, scheduler-side and server modules import; pins from its metadata
# where a newer release breaks it (transformers, tvm-ffi, openai).
requirements=(
  triton numpy orjson psutil pybase64 requests packaging pillow starlette msgspec
  "pydantic>=2.7,<3" pyzmq tqdm ipython aiohttp transformers==5.19.0 dill
  apache-tvm-ffi==0.1.11 sentencepiece compressed-tensors gguf openai==2.8.0
  partial_json_parser setproctitle einops uvicorn fastapi
)
# What a live server (`python -m sglang.launch_server`, make sglang-live-check) imports on top
# of the cache classes: each one a ModuleNotFoundError or FastAPI RuntimeError at launch.
server_requirements=(uvloop python-multipart jsonschema xgrammar==0.2.7 soundfile==0.13.1)
# The Leyline side: the SDK's own dependencies come with `-e .`; the tests and the plugin's
# chat routes (the reference server's metrics) need these.
leyline_extras=(httpx tiktoken safetensors pytest hypothesis prometheus_client)

# shellcheck source=../../.ci/venv_lib.sh
source "$root/.ci/venv_lib.sh"
make_venv 3.11 "${PYTHON311:-}"

if ! pins_installed "$torch_pin" "${nodeps[@]}" "${requirements[@]}" \
  "${server_requirements[@]}" "${leyline_extras[@]}"; then
  say "pip install $torch_pin (the CPU wheel, before anything can pull a CUDA build)  (log: $log)"
  pip_install "$torch_pin"
  say "pip install --no-deps ${nodeps[*]}"
  pip_install --no-deps "${nodeps[@]}"
  say "pip install sglang's CPU-side dependencies (${#requirements[@]} packages)"
  pip_install "$torch_pin" "${requirements[@]}"
  say "pip install what the live server imports: ${server_requirements[*]}"
  pip_install "$torch_pin" "${server_requirements[@]}"
  say "pip install --no-deps -e $root, then ${leyline_extras[*]}"
  pip_install --no-deps -e "$root"
  pip_install "$torch_pin" "${leyline_extras[@]}"
  pins_stamped
fi

say "checking: torch is the CPU build, sglang is 0.5.23, the plugin entry point is registered"
"$venv/bin/python" - <<'EOF'
import importlib.metadata as md

import torch

assert torch.__version__.startswith("2.13.0"), torch.__version__
assert md.version("sglang") == "0.5.23", md.version("sglang")
eps = [ep for ep in md.entry_points(group="sglang.srt.plugins") if ep.name == "leyline"]
assert eps, "the leyline entry point is not registered in the sglang.srt.plugins group"
print(f"torch {torch.__version__}, sglang {md.version('sglang')}, plugin {eps[0].value}")
EOF

say "done: $venv ($(du -sh "$venv" | cut -f1))"
say "run the tests:  $venv/bin/python -m pytest -p no:cacheprovider tests/sglang"
