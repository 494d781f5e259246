#!/usr/bin/env bash
# make sglang-live-check: the Leyline plugin in a real SGLang 0.5.23 server on this CPU.
#
#   bash server_adapter/sglang/live_check.sh        # after `make setup` (the main .venv)
#
# Builds or reuses .venv-sglang (setup_env.sh), then for SmolLM2 (GQA) and a tiny random
# DeepSeek-V2 (MLA), one at a time (a server peaks at ~3.4 GB): start a server with the
# plugin loaded (live_server.sh), run tests/sglang_live from the main .venv against it (the
# reference engine on the same weights), stop it. Both models always run; exit 1 if either
# failed. Every server is stopped on exit, also on failure or interrupt. Run files (server
# logs, the figures) stay in a temp dir when something failed.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"
t0=$SECONDS
say() { printf '[sglang live-check %4ss] %s\n' "$((SECONDS - t0))" "$*"; }
server=server_adapter/sglang/live_server.sh
python=.venv/bin/python
test_timeout=${LEYLINE_SGLANG_TEST_TIMEOUT:-360}

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

say "1/3 .venv-sglang (built once, reused while the pins match)"
bash server_adapter/sglang/setup_env.sh | sed 's/^/    /'

say "2/3 model directories (from the main venv's SmolLM2 wheel; built once into the cache)"
declare -A dirs
for model in smollm2 tiny-mla-v2; do
  dirs[$model]=$("$python" -m leyline.server_adapter.sglang.live_models "$model")
  say "    $model: ${dirs[$model]}"
done

say "3/3 one live server per model, the live tests against each"
failed=()
for model in smollm2 tiny-mla-v2; do
  port=$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  # The test plugin in tests/sglang_live/_stubs reads this in the server; the test touches it.
  export LEYLINE_LIVE_ROTATION_OFF_FLAG=$run/$model/rotation-off
  if ! bash "$server" start "$run/$model" "${dirs[$model]}" "$port"; then
    failed+=("$model (server start)")
    continue
  fi
  say "    tests/sglang_live against $model"
  if ! LEYLINE_SGLANG_URL=http://127.0.0.1:$port LEYLINE_SGLANG_MODEL=${dirs[$model]} \
    LEYLINE_SGLANG_REPORT=$run/$model/figures.jsonl \
    timeout "$test_timeout" "$python" -m pytest -q -p no:cacheprovider tests/sglang_live; then
    failed+=("$model (tests)")
    tail -n 30 "$run/$model/server.log" | sed 's/^/    server.log: /'
  fi
  bash "$server" stop "$run/$model"
  if [[ -f $run/$model/figures.jsonl ]]; then
    "$python" - "$run/$model/figures.jsonl" <<'EOF'
import json, sys

for line in open(sys.argv[1]):
    f = json.loads(line)
    same = f.get("same_edit_max_delta_logprob")
    extra = f"  (same edit: {same:.1e})" if same is not None else ""
    print(f"    max |Δ logprob| {f['max_delta_logprob']:.1e}  {f['check']}{extra}")
EOF
  fi
done

if ((${#failed[@]})); then
  say "FAILED: ${failed[*]}; run files kept in $run"
  exit 1
fi
rm -rf "$run"
say "done: both models passed in $((SECONDS - t0)) s"
