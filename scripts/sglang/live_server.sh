#!/usr/bin/env bash
# Start or stop one live SGLang 0.5.23 server with the Leyline plugin loaded: on CPU (the
# default), or on a GPU with LEYLINE_SGLANG_DEVICE=cuda (a user's SGLang install; see below).
#
#   bash scripts/sglang/live_server.sh start RUN_DIR MODEL_DIR PORT [LAUNCH_FLAG...]
#   bash scripts/sglang/live_server.sh stop RUN_DIR
#   bash scripts/sglang/live_server.sh run RUN_DIR MODEL_DIR PORT [LAUNCH_FLAG...]   # in the foreground
#
# `start` launches `python -m sglang.launch_server` on 127.0.0.1:PORT in its own process
# group, writes RUN_DIR/server.pid and RUN_DIR/server.log, and returns once the server
# answers a generate (at most LEYLINE_SGLANG_START_TIMEOUT s, default 300); on timeout or
# early exit it prints the log's tail, stops the server and fails. `stop` ends that process
# group (TERM, then KILL after 20 s); both by scripts/live_server_lib.sh.
# `run` becomes the server in the foreground, output on stdout, no pid file: for a caller
# that owns the process (the router check kills and restarts workers). No GPU, no
# sgl_kernel: every fused op runs its forward_native. The venv is scripts/sglang/
# setup_env.sh's (.venv-sglang).
#
# Test-only stand-ins go on the server's PYTHONPATH, never into site-packages: torchvision
# (tests/sglang/_stubs), vllm._custom_ops (tests/live/_stubs/sglang) and the live suite's
# test plugin (tests/live/_stubs/shims: torch_native -> absorbed MLA path, and the negative
# controls' switches read from the files named by LEYLINE_LIVE_ROTATION_OFF_FLAG and
# LEYLINE_LIVE_SHARED_SPLICE_FLAG, if set). See docs/sglang.md, "Live on CPU".
#
# LEYLINE_SGLANG_DEVICE=cuda: SGLang's GPU defaults plus fp32 on the triton attention backend
# (the live tests compare against the reference engine in fp32), in the venv named by
# LEYLINE_SGLANG_VENV (sglang==0.5.23 with its CUDA stack, and `pip install -e .` of this
# repository); only the test plugin goes on the path (the CPU stand-ins would shadow real
# packages there).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
venv=${LEYLINE_SGLANG_VENV:-$root/.venv-sglang}
device=${LEYLINE_SGLANG_DEVICE:-cpu}
start_timeout=${LEYLINE_SGLANG_START_TIMEOUT:-300}
say() { printf '[sglang live] %s\n' "$*"; }
# shellcheck source=../live_server_lib.sh
source "$root/scripts/live_server_lib.sh"

# ready URL: a 1-token generate answers (the HTTP port opens before the model is loaded).
ready() {
  curl -sf -m 30 "$1/generate" -H 'content-type: application/json' \
    -d '{"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}}' >/dev/null
}

# launch RUN_DIR MODEL_DIR PORT [FLAG...]: the server's command, by device.
launch() {
  local run=$1 model=$2 port=$3 stubs flags
  shift 3
  case $device in
    cpu)
      stubs="$root/tests/sglang/_stubs:$root/tests/live/_stubs/sglang:$root/tests/live/_stubs/shims"
      # SGLANG_USE_CPU_ENGINE stays unset: it selects SGLang's AMX engine (sgl_kernel).
      flags=(--device cpu --attention-backend torch_native
        --cuda-graph-backend-decode disabled --cuda-graph-backend-prefill disabled
        --dtype float32 --mem-fraction-static 0.1 --max-total-tokens 12288 --sleep-on-idle) ;;
    cuda)
      stubs="$run/plugin-path"
      mkdir -p "$stubs"
      ln -sf "$root/tests/live/_stubs/shims/leyline_live_shims.py" \
        "$root/tests/live/_stubs/shims/leyline_live_shims-0.0.0.dist-info" "$stubs/"
      flags=(--device cuda --attention-backend triton --dtype float32
        --mem-fraction-static 0.3) ;;
    *) say "LEYLINE_SGLANG_DEVICE must be cpu or cuda, not $device" >&2; exit 2 ;;
  esac
  launch_server "$run" env PYTHONPATH="$stubs${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 "$venv/bin/python" -m sglang.launch_server --model-path "$model" \
    --host 127.0.0.1 --port "$port" "${flags[@]}" --enable-cache-report --log-level info "$@"
}

live_server_main "$@"
