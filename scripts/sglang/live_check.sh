#!/usr/bin/env bash
# make sglang-live-check: the Leyline plugin in a real SGLang 0.5.23 server on this CPU.
#
#   bash scripts/sglang/live_check.sh        # after `make setup` (the main .venv)
#   LEYLINE_SGLANG_LIVE_EXTRA=1 bash scripts/sglang/live_check.sh   # + two servers
#   LEYLINE_SGLANG_DEVICE=cuda LEYLINE_SGLANG_VENV=/path/to/sglang-venv \
#     bash scripts/sglang/live_check.sh   # the same checks on a GPU (docs/sglang.md)
#
# Builds or reuses .venv-sglang (setup_env.sh), then for SmolLM2 (GQA) and a tiny random
# DeepSeek-V2 (MLA), one at a time (a server peaks at ~3.4 GB): start a server with the
# plugin loaded (live_server.sh), run the live contract suite tests/live from the main .venv
# against it (the reference engine on the same weights), stop it; then one more tiny-MLA server with API
# keys (LEYLINE_API_KEYS_FILE: two tenants) for the tenant test. With
# LEYLINE_SGLANG_LIVE_EXTRA=1, two more servers on the tiny MLA model: `--page-size 4` (the
# load, FORGET-purge and runtime tests) and `--disable-radix-cache` (the runtime test: a
# typed unsupported_runtime fallback). Every run always runs; exit 1 if any failed. Every server is stopped on exit,
# also on failure or interrupt. Run files (server logs, the figures) stay in a temp dir
# when something failed.
#
# SGLang's own KV invariant checks run strict in every server: after each batch (free +
# evictable + protected + in-flight slots = capacity; while requests run, no page twice in
# the free list and none both owned and free) and at idle (SGLang's default). A leak or a
# double free stops the scheduler, and the tests then fail.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"
t0=$SECONDS
say() { printf '[sglang live-check %4ss] %s\n' "$((SECONDS - t0))" "$*"; }
server=scripts/sglang/live_server.sh
python=.venv/bin/python
test_timeout=${LEYLINE_SGLANG_TEST_TIMEOUT:-1500}
extra=${LEYLINE_SGLANG_LIVE_EXTRA:-0}
export SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY=${SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY:-1}
export SGLANG_CHECK_KV_PAGE_INVARIANTS=${SGLANG_CHECK_KV_PAGE_INVARIANTS:-1}

[[ -x $python ]] || { echo "no $python: run make setup first" >&2; exit 1; }
run=$(mktemp -d "${TMPDIR:-/tmp}/leyline-sglang-live.XXXXXX")
stop_all() {
  for dir in "$run"/*/; do
    [[ -f $dir/server.pid ]] && bash "$server" stop "$dir"
  done
  return 0
}
trap stop_all EXIT
trap 'exit 130' INT TERM

if [[ ${LEYLINE_SGLANG_DEVICE:-cpu} == cpu ]]; then
  say "1/3 .venv-sglang (built once, reused while the pins match)"
  bash scripts/sglang/setup_env.sh | sed 's/^/    /'
else
  # A GPU: the user's own SGLang venv (LEYLINE_SGLANG_VENV), with this repository installed.
  sglang_python=${LEYLINE_SGLANG_VENV:?set LEYLINE_SGLANG_VENV to a venv with sglang on CUDA}/bin/python
  say "1/3 $sglang_python: sglang, CUDA and the plugin's entry point"
  "$sglang_python" - <<'PY'
import importlib.metadata as md

import torch

assert md.version("sglang") == "0.5.23", md.version("sglang")
assert torch.cuda.is_available(), "no CUDA device"
points = md.entry_points(group="sglang.srt.plugins")
assert any(p.name == "leyline" for p in points), "pip install -e . into this venv first"
print(f"    sglang 0.5.23, torch {torch.__version__}, {torch.cuda.get_device_name()}")
PY
fi

say "2/3 model directories (from the main venv's SmolLM2 wheel; built once into the cache)"
declare -A dirs
for model in smollm2 tiny-mla-v2; do
  dirs[$model]=$("$python" -m leyline.sglang.live_models "$model")
  say "    $model: ${dirs[$model]}"
done

# report FIGURES_JSONL: the measured lines, one row per check.
report() { "$python" scripts/live_report.py "$1"; }

# run_server NAME MODEL "LAUNCH FLAGS" TEST_PATH...: one server, the tests against it, then
# `leyline eval robustness --base-url` with the arguments in the array `robustness`, if any.
failed=()
robustness=()
run_server() {
  local name=$1 model=$2 flags=$3 port started=$SECONDS
  shift 3
  port=$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  # The test plugin in tests/live/_stubs/shims reads these in the server; the tests touch them.
  export LEYLINE_LIVE_ROTATION_OFF_FLAG=$run/$name/rotation-off
  export LEYLINE_LIVE_SHARED_SPLICE_FLAG=$run/$name/shared-splice
  # shellcheck disable=SC2086  # the launch flags are separate words
  if ! bash "$server" start "$run/$name" "${dirs[$model]}" "$port" $flags; then
    failed+=("$name (server start)")
    return 0
  fi
  say "    ${*#tests/} against $name"
  if ! LEYLINE_LIVE_BACKEND=sglang LEYLINE_LIVE_URL=http://127.0.0.1:$port \
    LEYLINE_LIVE_MODEL=${dirs[$model]} LEYLINE_LIVE_REPORT=$run/$name/figures.jsonl \
    timeout "$test_timeout" "$python" -m pytest -q -p no:cacheprovider "$@"; then
    failed+=("$name (tests)")
    tail -n 30 "$run/$name/server.log" | sed 's/^/    server.log: /'
  fi
  if ((${#robustness[@]})); then
    # The contract suite `leyline serve` passes, unchanged, against this live server.
    say "    leyline eval robustness ${robustness[*]} against $name"
    if ! timeout "$test_timeout" .venv/bin/leyline eval robustness \
      --base-url "http://127.0.0.1:$port" --fast --no-progress \
      --out "$run/$name/robustness" "${robustness[@]}" | sed 's/^/    /'; then
      failed+=("$name (robustness)")
    fi
  fi
  bash "$server" stop "$run/$name"
  [[ ! -f $run/$name/figures.jsonl ]] || report "$run/$name/figures.jsonl"
  say "    $name: $((SECONDS - started)) s"
}

say "3/3 one live server per run, the live tests against each"
# SmolLM2 (a real model): every check, cross-session against transformers on the weights.
robustness=(--model-dir "${dirs[smollm2]}")
run_server smollm2 smollm2 "" tests/live
robustness=()
run_server tiny-mla-v2 tiny-mla-v2 "" tests/live
# Tenants: the plugin with API keys (two tenants), its own small run; the suite's checks
# but cross-session (random weights: their top-20 is too flat to compare by membership).
mkdir -p "$run/tenants"
key() { head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n'; }
alpha=$(key) bravo=$(key)
printf 'alpha %s\nbravo %s\n' "$alpha" "$bravo" >"$run/tenants/keys"
export LEYLINE_API_KEYS_FILE=$run/tenants/keys
robustness=(--api-key "$alpha" --api-key-b "$bravo"
  --checks fuzz,lost_updates,redaction,cross_tenant,cross_salt)
run_server tenants tiny-mla-v2 "" tests/live/test_tenants.py
robustness=()
unset LEYLINE_API_KEYS_FILE
if [[ $extra == 1 ]]; then
  run_server tiny-mla-v2-page4 tiny-mla-v2 "--page-size 4" tests/live/test_load.py \
    tests/live/test_forget_purge.py tests/live/test_runtime.py
  run_server tiny-mla-v2-no-radix tiny-mla-v2 "--disable-radix-cache" \
    tests/live/test_runtime.py
fi

if ((${#failed[@]})); then
  say "FAILED: ${failed[*]}; run files kept in $run"
  exit 1
fi
rm -rf "$run"
say "done: every run passed in $((SECONDS - t0)) s"
