#!/usr/bin/env bash
# Build the Python 3.12 environment of the debug-gym policy leg (idempotent; prints each step).
#
#   bash scripts/debug_gym/setup_env.sh            # -> .venv-debuggym/ in the repository root
#
# debug-gym 1.3.0 needs Python >= 3.12; a plain `pip install debug-gym` fails offline (its pin
# swesmith==0.0.4 pulls sglang's CUDA stack), so both go in with --no-deps and their pinned
# dependencies follow explicitly. The Leyline SDK goes in without extras (no torch). The
# mini_nightmare data is completed offline from shared/data/mini_nightmare-missing/.
# Only PyPI (through pip) is contacted. debug-gym's config and cache dirs go to a temp HOME
# (pip keeps its usual cache).
#
# Environment overrides:
#   LEYLINE_DEBUGGYM_VENV   where the venv goes        (default: <repo>/.venv-debuggym)
#   LEYLINE_SHARED_DIR      the shared folder          (default: <repo>/../shared)
#   PYTHON312               the interpreter to use     (default: pyenv's 3.12, else python3.12)
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
venv=${LEYLINE_DEBUGGYM_VENV:-$root/.venv-debuggym}
shared=${LEYLINE_SHARED_DIR:-$root/../shared}
missing=$shared/data/mini_nightmare-missing
say() { printf '[setup_env] %s\n' "$*"; }

# Pins from debug-gym 1.3.0's metadata, plus what swesmith's modules import at debug-gym's
# import time; matplotlib for the report's plot. pip's default strategy (only-if-needed)
# keeps openai==1.99.9 when the SDK (openai>=1.99.9) is installed afterwards.
requirements=(
  datasets==3.6.0 openai==1.99.9 azure-identity==1.22.0 tenacity==9.1.2 pyyaml==6.0.2
  pytest==8.3.5 gitignore_parser==0.1.12 termcolor==3.1.0 transformers==4.51.3 tiktoken
  docker==7.1.0 swebench==4.0.3 prompt_toolkit==3.0.51 anthropic==0.51.0 jinja2==3.1.6
  rich==14.0.0 kubernetes==33.1.0 litellm==1.80.0 tree-sitter tree-sitter-go astor
  matplotlib tqdm
)
nodeps=(debug-gym==1.3.0 swesmith==0.0.4)

# shellcheck source=../../.ci/venv_lib.sh
source "$root/.ci/venv_lib.sh"
make_venv 3.12 "${PYTHON312:-}"

if ! pins_installed "${nodeps[@]}" "${requirements[@]}"; then
  say "pip install --no-deps ${nodeps[*]}   (log: $log)"
  pip_install --no-deps "${nodeps[@]}"
  say "pip install debug-gym's pinned dependencies: ${requirements[*]}"
  pip_install "${requirements[@]}"
  say "pip install -e $root (the Leyline SDK, base install: no extras, no torch)"
  pip_install -e "$root"
  pins_stamped
fi

say "checking: openai is debug-gym's 1.99.9 (the SDK allows >=1.99.9), torch is absent"
openai_version=$("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("openai"))')
[[ $openai_version == 1.99.9 ]] || { echo "openai is $openai_version, want 1.99.9" >&2; exit 1; }
if "$venv/bin/python" -c 'import importlib.util as u, sys; sys.exit(u.find_spec("torch") is None)'
then
  echo "torch is installed in $venv: the SDK or a pin pulled it" >&2
  exit 1
fi

# Complete the mini_nightmare copy: the wheel's tasks plus the three kinds of file it omits.
data=$venv/mini_nightmare
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
[[ -d $missing ]] || { echo "missing data folder $missing (set LEYLINE_SHARED_DIR)" >&2; exit 1; }
missing=$(cd "$missing" && pwd)
say "completing mini_nightmare: $site/data/mini_nightmare + $missing -> $data"
mkdir -p "$data"
cp -r "$site/data/mini_nightmare/." "$data/"
find "$data" -name __pycache__ -type d -prune -exec rm -rf {} +
for task in "$data"/*/; do
  [[ -d $task ]] || continue
  install -m 644 "$missing/debugignore" "$task/.debugignore"
  install -m 644 "$missing/debugreadonly" "$task/.debugreadonly"
done
install -m 644 "$missing/patcher/source_code.txt" "$data/patcher/source_code.txt"

say "checking: the 10 tasks load offline (HOME and debug-gym's dirs in a temp folder)"
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
HOME=$scratch LITELLM_LOCAL_MODEL_COST_MAP=True LEYLINE_MINI_NIGHTMARE=$data \
  "$venv/bin/python" -m leyline.evals.debug_gym.tasks

say "done: $venv ($(du -sh "$venv" | cut -f1))"
say "run the harness:  $venv/bin/python -m leyline.evals.debug_gym --help"
