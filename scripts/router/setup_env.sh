#!/usr/bin/env bash
# Build the environment of sglang-router (idempotent; prints each step).
#
#   bash scripts/router/setup_env.sh      # -> .venv-router/ in the repository root
#
# sglang-router is a Rust binary in a Python wheel (about 30 MB; 25 packages, about 146 MB
# installed, no torch and no sglang: docs/reports/router-probe.md). Leyline does not go into
# this venv: the router only forwards HTTP, and the driver (python -m
# leyline.evals.router_check) runs from the main .venv, starting
# `.venv-router/bin/python -m sglang_router.launch_router`. The venv is reused while the
# installed sglang-router is the pinned version.
#
# Environment overrides:
#   LEYLINE_ROUTER_VENV   where the venv goes      (default: <repo>/.venv-router)
#   PYTHON311             the interpreter to use   (default: pyenv's 3.11, else python3.11)
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
venv=${LEYLINE_ROUTER_VENV:-$root/.venv-router}
say() { printf '[router setup_env] %s\n' "$*"; }

router_version=0.3.2
router_pin=sglang-router==$router_version

# shellcheck source=../../.ci/venv_lib.sh
source "$root/.ci/venv_lib.sh"
make_venv 3.11 "${PYTHON311:-}"

installed() {
  "$venv/bin/python" - "$router_version" <<'PY' 2>/dev/null
import importlib.metadata as md
import sys

sys.exit(md.version("sglang-router") != sys.argv[1])
PY
}

if installed; then
  say "$router_pin already installed"
else
  : >"$log"
  say "pip install $router_pin and its dependencies  (log: $log)"
  pip_install "$router_pin"
fi

say "checking: sglang_router imports, and its launcher has the flags the check uses"
help=$("$venv/bin/python" -m sglang_router.launch_router --help)
for flag in --worker-urls --policy --assignment-mode --disable-circuit-breaker \
  --health-check-interval-secs --health-failure-threshold --health-success-threshold \
  --worker-startup-check-interval; do
  grep -q -- "$flag" <<<"$help" || { say "launch_router --help has no $flag" >&2; exit 1; }
done
"$venv/bin/python" -c '
import importlib.metadata as md
print("sglang-router", md.version("sglang-router"))'

say "done: $venv ($(du -sh "$venv" | cut -f1))"
