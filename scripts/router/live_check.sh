#!/usr/bin/env bash
# make router-live-check: the real sglang-router 0.3.2 in front of two real `leyline serve`
# workers on this CPU (SmolLM2), agent episodes through the SDK in routed mode, one worker
# killed in mid-run and started again (issue 48; docs/router-design.md section 5,
# docs/deploy.md).
#
#   bash scripts/router/live_check.sh        # after `make setup` (the main .venv)
#   bash scripts/router/live_check.sh --turns 4   # arguments go to the driver (--help)
#   bash scripts/router/live_check.sh --workers sglang   # SGLang workers (make router-live-check-sglang)
#
# Builds or reuses .venv-router (setup_env.sh), then runs the driver from the main .venv,
# `python -m leyline.evals.router_check`, which starts the two workers and the router, owns
# their PIDs and stops them on every exit (also on failure or interrupt). Its report goes to
# results/router-live-check (report.json, the workers' and the router's logs); it prints a
# table of targets and exits 1 if one is missed.
#
# Environment overrides:
#   LEYLINE_ROUTER_OUT   where the report goes   (default: results/router-live-check)
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"
t0=$SECONDS
say() { printf '[router live-check %4ss] %s\n' "$((SECONDS - t0))" "$*"; }
python=.venv/bin/python
out=${LEYLINE_ROUTER_OUT:-results/router-live-check}

[[ -x $python ]] || { echo "no $python: run make setup first" >&2; exit 1; }

say "1/2 .venv-router (built once, reused while sglang-router is the pinned version)"
bash scripts/router/setup_env.sh | sed 's/^/    /'
previous=
for arg in "$@"; do
  if [[ $previous == --workers && $arg == sglang || $arg == --workers=sglang ]]; then
    say "    SGLang workers: .venv-sglang (built once, reused while the pins match)"
    bash scripts/sglang/setup_env.sh | sed 's/^/    /'
  fi
  previous=$arg
done

say "2/2 the driver: python -m leyline.evals.router_check --out $out $*"
status=0
"$python" -m leyline.evals.router_check --router-python .venv-router/bin/python \
  --out "$out" "$@" || status=$?

if ((status)); then
  say "FAILED (exit $status) after $((SECONDS - t0)) s; logs and report.json in $out"
  exit "$status"
fi
say "done: passed in $((SECONDS - t0)) s (wall)"
