#!/usr/bin/env bash
# `leyline eval mechanism` against a fresh live vLLM server with the Leyline plugins, what
# vLLM itself computed counted by its own counter (docs/vllm.md, "Measured").
#
#   bash scripts/vllm/mechanism.sh [--block-size N] [EVAL FLAG...]
#
# Starts a server on SmolLM2 (scripts/vllm/live_server.sh: fp32, eager, 4 GiB of KV cache
# unless LEYLINE_VLLM_KV_GIB says otherwise) with the connector and, if given, vLLM's
# --block-size (CPU: a multiple of 32; vLLM's CPU default is 128); runs the eval with
# --server-counter on vLLM's `local_compute` prompt tokens (which implies the arms run apart)
# with --levels 1,8 --trajectories synthetic --synthetic 8 --turns 6 and the flags given;
# stops the server on every exit. The report's folder is printed at the end.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"
server=scripts/vllm/live_server.sh
python=.venv/bin/python
say() { printf '[vllm mechanism] %s\n' "$*"; }
[[ -x $python ]] || { echo "no $python: run make setup first" >&2; exit 1; }

vllm_flags=()
if [[ ${1:-} == --block-size ]]; then
  vllm_flags=(--block-size "${2:?--block-size needs a number}")
  shift 2
fi
# The defaults first: a flag given again later wins (argparse keeps the last).
eval_flags=(--levels 1,8 --trajectories synthetic --synthetic 8 --turns 6 "$@")

bash scripts/vllm/setup_env.sh | sed 's/^/    /'
model=$("$python" -m leyline.sglang.live_models smollm2)
port=$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
run=$(mktemp -d "${TMPDIR:-/tmp}/leyline-vllm-mech.XXXXXX")
trap 'bash "$server" stop "$run"' EXIT
trap 'exit 130' INT TERM
connector='{"kv_connector":"LeylineConnector","kv_connector_module_path":"leyline.vllm.connector",
"kv_role":"kv_both","kv_load_failure_policy":"recompute"}'

say "a server on $model (${vllm_flags[*]:-the default block size}), port $port"
LEYLINE_VLLM_KV_GIB=${LEYLINE_VLLM_KV_GIB:-4} LEYLINE_VLLM_START_TIMEOUT=${LEYLINE_VLLM_START_TIMEOUT:-600} \
  VLLM_PLUGINS=leyline bash "$server" start "$run" "$model" "$port" \
  --kv-transfer-config "$connector" "${vllm_flags[@]}" | sed 's/^/    /'
say "leyline eval mechanism ${eval_flags[*]}"
.venv/bin/leyline eval mechanism --base-url "http://127.0.0.1:$port/v1" --model "$model" \
  --server-counter 'vllm:prompt_tokens_by_source_total{source="local_compute"}' "${eval_flags[@]}"
